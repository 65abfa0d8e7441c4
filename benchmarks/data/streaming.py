#!/usr/bin/python3
"""Reading a training set larger than the cache budget: --data-mode stream against the whole set in
memory and against the cache mode's per-request reads past the budget, side by side in one run.

Fashion-MNIST's training set is converted in small shards (--shard-size, default 1000 samples, 0.75
MB) so that it is --times (default 10) or more times the per-rank budget; each mode trains the same
steps of simple_cnn on --ranks ranks (mpiexec), in turn, --repeats times. Reported per mode (medians):
samples/s and its ratio to the in-memory run, the steady-state data wait as a share of the step (log
lines after the first), the first step's time after start, rank 0's peak resident memory, the node's
memory (the ranks' proportional set sizes summed, polled every 0.1 s: shared pages count once) and
the input bytes rank 0 read from the files per epoch it trained (data_mib / ranks when each shard is
read once by one rank).

  benchmarks/data/streaming.py --dtrain build/dtrain --work runs/streaming
"""
import argparse
import json
import os
import statistics
import subprocess
import time

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def convert(a):
    data = os.path.join(a.work, f"fashion-{a.shard_size}")
    if not os.path.isdir(os.path.join(data, "train")):
        subprocess.run([a.dtrain, "convert", "fashion-mnist", "--out", data, "--shard-size", str(a.shard_size)],
                       check=True, stdout=subprocess.DEVNULL)
    files = [os.path.join(data, "train", f) for f in os.listdir(os.path.join(data, "train"))]
    return data, sum(os.path.getsize(f) for f in files) / 2**20


def pids_with(text):
    pids = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and text in open(f"/proc/{pid}/cmdline").read() and "mpiexec" not in open(
                    f"/proc/{pid}/cmdline").read():
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


def train(a, data, mode, cache_mb, tag):
    metrics = os.path.join(a.work, f"{tag}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = ["mpiexec", "-n", str(a.ranks), "--oversubscribe", "--bind-to", "none", a.dtrain, "train", "--model",
           "simple_cnn", "--data", f"{data}/train", "--steps", str(a.steps), "--epochs", "1000", "--log-every",
           str(a.log_every),
           "--threads", "1", "--progress", "off", "--data-mode", mode, "--data-cache-mb", str(cache_mb),
           "--metrics", metrics]
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
    epochs = summary["steps"] * 64 * a.ranks / 60000
    return {"samples_per_s": summary["samples_per_s"],
            "wait_share": statistics.mean(x["data_wait_s"] / x["step_time_s"] for x in steps[1:]),
            "first_step_s": summary["first_step_at_s"],
            "rss_mib": summary["peak_rss_mib"], "node_pss_mib": node_pss,
            "read_mib_per_epoch": summary["data_bytes_read"] / 2**20 / epochs,
            "whole_shard_reads": summary["data_whole_shard_reads"], "mode": summary["data_mode"]}


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
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    data, data_mib = convert(a)
    budget_mb = max(1, int(data_mib / a.times * a.ranks))  # per node, so data_mib / budget per rank >= times
    runs = {"in memory (cache, 2048 MB: one copy per node)": ("cache", 2048), f"stream, {budget_mb} MB": ("stream", budget_mb),
            f"cache, {budget_mb} MB": ("cache", budget_mb)}
    results = {name: [] for name in runs}
    for rep in range(a.repeats):
        for i, (name, (mode, mb)) in enumerate(runs.items()):
            results[name].append(train(a, data, mode, mb, f"run{rep}-{i}"))
    print(f"Fashion-MNIST train, {data_mib:.1f} MiB in shards of {a.shard_size}; {a.ranks} ranks, budget "
          f"{budget_mb} MB per node ({data_mib / (budget_mb / a.ranks):.1f}x a rank's); simple_cnn, {a.steps} "
          f"steps; medians of {a.repeats}")
    print("| mode | samples/s | vs in memory | data wait / step | first step s | peak RSS MiB (rank 0) | "
          "peak node PSS MiB | MiB read per epoch (rank 0) | whole-shard reads (rank 0) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    base = statistics.median(r["samples_per_s"] for r in results[next(iter(runs))])
    for name, rs in results.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "mode"}
        print(f"| {name} | {med['samples_per_s']:.0f} | {med['samples_per_s'] / base:.2f} | "
              f"{100 * med['wait_share']:.1f} % | {med['first_step_s']:.2f} | {med['rss_mib']:.0f} | "
              f"{med['node_pss_mib']:.0f} | "
              f"{med['read_mib_per_epoch']:.1f} | {med['whole_shard_reads']:.0f} |")


if __name__ == "__main__":
    main()
