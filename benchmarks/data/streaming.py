#!/usr/bin/python3
"""Reading a training set larger than the cache budget: --data-mode stream and the job-wide store
against the whole set in memory and against the cache mode's per-request reads past the budget,
side by side in one run.

Fashion-MNIST's training set is converted in small shards (--shard-size, default 1000 samples, 0.75
MB) so that it is --times (default 10) or more times the per-rank budget; --copies K lists its
shards K times (symbolic links: a K times larger set on the same disk and page cache), indexed by
`dtrain convert index`; --compare-index runs every mode again on the same shards without their
shards.index (every shard opened at start). Each mode
trains the same steps of simple_cnn on --ranks ranks (mpiexec), in turn, --repeats times; with
--nodes N the ranks run on N nodes of an emulated cluster (cluster/emulate/, root only; --rate
limits each node's link), where the store's budget is half the set per node: past one node's, within
the job's. Reported per mode (medians):
samples/s and its ratio to the in-memory run, the steady-state data wait as a share of the step (log
lines after the first), the first step's time after start, rank 0's peak resident memory, the node's
memory (the ranks' proportional set sizes summed, polled every 0.1 s: shared pages count once) and
the input bytes rank 0 read from the files per epoch it trained (data_mib / ranks when each shard is
read once by one rank).

  benchmarks/data/streaming.py --dtrain build/dtrain --work runs/streaming [--nodes 2 --rate 1gbit]
"""
import argparse
import json
import os
import statistics
import shlex
import subprocess
import time

EMULATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "cluster", "emulate")
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def link_shards(files, folder, copies):
    os.makedirs(folder, exist_ok=True)
    for k in range(copies):
        for f in files:
            link = os.path.join(folder, f"copy{k:03d}-{os.path.basename(f)}")
            if not os.path.exists(link):
                os.symlink(os.path.abspath(f), link)


def convert(a):
    """The training folder (with its shards.index) and its size in MiB; with --compare-index also the
    same shards in a folder without an index."""
    data = os.path.join(a.work, f"fashion-{a.shard_size}")
    if not os.path.isdir(os.path.join(data, "train")):
        subprocess.run([a.dtrain, "convert", "fashion-mnist", "--out", data, "--shard-size", str(a.shard_size)],
                       check=True, stdout=subprocess.DEVNULL, env={**os.environ, **MPI_ENV})
    files = sorted(os.path.join(data, "train", f) for f in os.listdir(os.path.join(data, "train")) if f.endswith(".h5"))
    train_dir = os.path.join(data, "train")
    if a.copies > 1:
        train_dir = os.path.join(data, f"train-x{a.copies}")
        link_shards(files, train_dir, a.copies)
        subprocess.run([a.dtrain, "convert", "index", train_dir], check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, **MPI_ENV})
    if a.compare_index:
        link_shards(files, train_dir + "-noindex", a.copies)
    return train_dir, a.copies * sum(os.path.getsize(f) for f in files) / 2**20


def pids_with(text):
    """The dtrain processes whose command line holds `text` (not the launchers around them)."""
    pids = []
    for pid in os.listdir("/proc"):
        try:
            args = open(f"/proc/{pid}/cmdline").read().split("\0")
            if pid.isdigit() and args[0].endswith("dtrain") and any(text in x for x in args):
                pids.append(pid)
        except OSError:
            pass
    return pids


def pss_mib(pid):
    try:
        for line in open(f"/proc/{pid}/smaps_rollup"):
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def launch(a, cmd):
    """mpiexec of `cmd` on this host, or mpirun on the emulated cluster's nodes (ranks spread evenly)."""
    if not a.nodes:
        return ["mpiexec", "-n", str(a.ranks), "--oversubscribe", "--bind-to", "none"] + cmd
    hosts = ",".join(f"{n}:{a.ranks // len(a.nodes)}" for n in a.nodes)
    return [os.path.join(EMULATE, "on.sh"), a.nodes[0],
            shlex.join(["mpirun", "--host", hosts, "-n", str(a.ranks), "--bind-to", "none"] + cmd)]


def train(a, data, mode, cache_mb, tag):
    metrics = os.path.abspath(os.path.join(a.work, f"{tag}.jsonl"))
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = launch(a, [os.path.abspath(a.dtrain), "train", "--model", "simple_cnn", "--data", data, "--steps",
                     str(a.steps), "--epochs", "1000", "--log-every", str(a.log_every), "--threads", "1", "--progress",
                     "off", "--data-mode", mode, "--data-cache-mb", str(cache_mb), "--metrics", metrics])
    p = subprocess.Popen(cmd, env={**os.environ, **MPI_ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    node_pss = 0.0
    while p.poll() is None:  # the node's memory: proportional set sizes of the run's processes, summed
        node_pss = max(node_pss, sum(pss_mib(pid) for pid in pids_with(metrics)))
        time.sleep(0.1)
    out = p.stdout.read()
    assert p.returncode == 0, f"{tag} failed:\n{out}"
    rows = [json.loads(line) for line in open(metrics)]
    steps = [x for x in rows if "step" in x and "data_wait_s" in x]
    summary = next(x for x in rows if x.get("summary") == "run")
    epochs = summary["steps"] * 64 * a.ranks / (60000 * a.copies)
    return {"samples_per_s": summary["samples_per_s"],
            "wait_share": statistics.mean(x["data_wait_s"] / x["step_time_s"] for x in steps[1:]),
            "first_step_s": summary["first_step_at_s"],
            "rss_mib": summary["peak_rss_mib"], "node_pss_mib": node_pss,
            "read_mib_per_epoch": summary["data_bytes_read"] / 2**20 / epochs,
            "read_mib": summary["data_bytes_read"] / 2**20,
            "whole_shard_reads": summary["data_whole_shard_reads"], "mode": summary["data_mode"]}


def start_cluster(a):
    """The emulated cluster of --nodes nodes in WORK/emu; returns its node names."""
    os.environ["DTRAIN_EMU_DIR"] = os.path.abspath(os.path.join(a.work, "emu"))
    rate = ["--rate", a.rate] if a.rate else []
    rc = subprocess.run([os.path.join(EMULATE, "start.sh"), "--nodes", str(a.nodes)] + rate +
                        [os.environ["DTRAIN_EMU_DIR"]]).returncode
    if rc != 0:
        raise SystemExit(f"cluster/emulate/start.sh failed (status {rc}; 77: cannot run here)")
    with open(os.path.join(os.environ["DTRAIN_EMU_DIR"], "node-names")) as f:
        return f.read().split()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtrain", default="build/dtrain")
    ap.add_argument("--work", default="runs/streaming")
    ap.add_argument("--shard-size", type=int, default=1000)
    ap.add_argument("--times", type=float, default=10, help="the data is at least this many times a rank's budget")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--copies", type=int, default=1, help="list the training set's shards this many times")
    ap.add_argument("--modes", default="memory,store,stream,cache",
                    help="the runs to make: memory (cache under 2048 MB), store, stream, cache (past the budget)")
    ap.add_argument("--compare-index", action="store_true",
                    help="run each mode again on the same shards without their shards.index")
    ap.add_argument("--nodes", type=int, default=1, help="emulated nodes the ranks spread over (1: this host)")
    ap.add_argument("--rate", default="", help="each emulated node's link rate (tc units: 1gbit)")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    data, data_mib = convert(a)
    ranks_per_node = a.ranks // a.nodes
    budget_mb = max(1, int(data_mib / a.times * ranks_per_node))  # per node, so data_mib / budget per rank >= times
    store_mb = int(data_mib / a.nodes * 1.1) + 1 if a.nodes > 1 else 2048  # past a node's, within the job's
    runs = {"in memory (cache, 2048 MB: one copy per node)": ("cache", 2048),
            f"store, {store_mb} MB": ("store", store_mb), f"stream, {budget_mb} MB": ("stream", budget_mb),
            f"cache, {budget_mb} MB": ("cache", budget_mb)}
    keep = a.modes.split(",")
    runs = {name: run for name, run, key in zip(runs, runs.values(), ("memory", "store", "stream", "cache"))
            if key in keep}
    if a.compare_index:
        runs = {**{name: (mode, mb, True) for name, (mode, mb) in runs.items()},
                **{f"{name}, no shards.index": (mode, mb, False) for name, (mode, mb) in runs.items()}}
    else:
        runs = {name: (mode, mb, True) for name, (mode, mb) in runs.items()}
    a.nodes = start_cluster(a) if a.nodes > 1 else []
    try:
        results = {name: [] for name in runs}
        for rep in range(a.repeats):
            for i, (name, (mode, mb, indexed)) in enumerate(runs.items()):
                results[name].append(train(a, data if indexed else data + "-noindex", mode, mb, f"run{rep}-{i}"))
    finally:
        if a.nodes:
            subprocess.run([os.path.join(EMULATE, "stop.sh"), os.environ["DTRAIN_EMU_DIR"]])
    where = f"{len(a.nodes)} emulated nodes (link {a.rate or 'unlimited'})" if a.nodes else "one node"
    print(f"Fashion-MNIST train x{a.copies}, {data_mib:.1f} MiB in shards of {a.shard_size}; {a.ranks} ranks on "
          f"{where}, budget {budget_mb} MB per node ({data_mib / (budget_mb / ranks_per_node):.1f}x a rank's); "
          f"simple_cnn, {a.steps} steps; medians of {a.repeats}")
    versus = "vs in memory" if "memory" in keep else f"vs {next(iter(runs))}"
    print(f"| mode | samples/s | {versus} | data wait / step | first step s | peak RSS MiB (rank 0) | "
          "peak PSS MiB, all ranks | MiB read per epoch (rank 0) | MiB read in all (rank 0) | whole-shard reads (rank 0) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    base = statistics.median(r["samples_per_s"] for r in results[next(iter(runs))])
    for name, rs in results.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "mode"}
        print(f"| {name} | {med['samples_per_s']:.0f} | {med['samples_per_s'] / base:.2f} | "
              f"{100 * med['wait_share']:.1f} % | {med['first_step_s']:.2f} | {med['rss_mib']:.0f} | "
              f"{med['node_pss_mib']:.0f} | "
              f"{med['read_mib_per_epoch']:.1f} | {med['read_mib']:.1f} | {med['whole_shard_reads']:.0f} |")


if __name__ == "__main__":
    main()
