#!/usr/bin/python3
"""Scaling study for dtrain: sweeps, a report, and an overlap-aware performance model.

  scaling.py all   --dtrain build/dtrain --out runs/scaling      # the whole study, ~10 min, RESULTS.md
  scaling.py sweep --dtrain build/dtrain --ranks 1,2,4 --mode strong,weak --out runs/scaling
  scaling.py model --dtrain build/dtrain --results runs/scaling/results.csv --out runs/scaling
  scaling.py batch --dtrain build/dtrain --batch-sizes 32,128,512 --out runs/scaling
  scaling.py all   --dtrain build/dtrain --out runs/emu --emulate-nodes 2 --link-rates local,1gbit,10gbit \
                   --ranks 1,2,4 --models mlp,simple_cnn --mode weak --overlap-model ''   # 2 emulated nodes (root)

`sweep` runs `dtrain train --synthetic` for every combination of ranks, mode, model, batch size,
compressor and precision, through mpirun or srun, reads each run's JSON-lines metrics (step time and
its split into forward, backward, optimizer, communication wait, data wait; the slowest rank's
compute; the gradient bucket count) and writes results.csv, report.md and (with matplotlib)
speedup.png, efficiency.png, breakdown.png. Strong scaling keeps the global batch (--batch-sizes are
global); weak scaling keeps the per-rank batch (--batch-sizes are per rank).

Beside each multi-rank run the sweep starts as many independent 1-rank runs at once (no
communication), which measures the compute a rank gets when the node is shared that way.

With --emulate-nodes N the sweep runs on an emulated cluster (cluster/emulate, started and stopped
here; root): at each of --link-rates (tc units; 'local': every rank on the first node) 1 rank on
one node, then one rank per node, then the same number on each node; rows carry nodes, ranks per
node and link rate. Beside the runs it benchmarks the allreduce for the two-level model: 2 ranks
on one node (intra), one rank on each of 2 nodes at each rate (inter-RATE) and with the link
unlimited (inter-none), and the sweep's most ranks as placed there (check-RATE, also with Open
MPI's ring and Rabenseifner forced), into OUT/bench.

`model` fits t(S) = alpha + beta * S * 2(n-1)/n to `dtrain bench allreduce` (one level, or two: inside
a node and over the link at each rate) and keeps the measured curves too; across nodes an allreduce
is the exchanges of its algorithm (ring, Rabenseifner, or Open MPI's pick by size: ALGORITHMS;
--allreduce-model, auto: the one the check benchmarks fit best), each at its level's cost. It
predicts every multi-rank step as compute + the allreduce time of the gradient
buckets not hidden behind backward (bucket i can start once backward has produced its share) +
optimizer + unnamed host work + data wait, in variants (serial, calibrated, contended, placed,
slowest; see VARIANTS), reports each variant's error on step time and
efficiency (report.md, model.csv, model.json), and projects to larger clusters (flat ring against
hierarchical allreduce) for a given link bandwidth, latency and GPUs per node.

`batch` trains on a held-out split (a Fashion-MNIST subset, or --dataset blobs) for each global
batch, all in one `dtrain train --sweep global-batch-size=... --lr-scaling linear` job (trainer
groups), and reports throughput and the training time (evaluation left out) until the TEST accuracy
first reaches --target-accuracy, or "not reached".

Needs only the Python standard library and numpy; plots are skipped without matplotlib
(Debian: python3-matplotlib).
"""
import argparse
import csv
import itertools
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import numpy as np

FIELDS = ["mode", "model", "ranks", "nodes", "ranks_per_node", "link_rate", "batch_per_rank", "global_batch",
          "compression", "precision",
          "params", "samples_per_s", "step_time_s", "compute_s", "comm_wait_s", "data_wait_s",
          "forward_s", "backward_s", "optimizer_s", "other_s", "compute_max_s", "bucket_count", "bucket_mb",
          "bytes_sent_per_step", "alone_forward_s", "alone_backward_s", "alone_optimizer_s", "alone_other_s",
          "final_train_accuracy", "speedup", "efficiency", "wall_s"]
TEXT_FIELDS = ("mode", "model", "compression", "precision", "link_rate")


def split_list(text, conv=str):
    return [conv(x) for x in text.split(",") if x.strip()]


def launcher(args, ranks):
    """The command prefix that starts `ranks` processes on this host (no emulated cluster)."""
    if args.launcher == "srun":
        return ["srun", "-n", str(ranks), "--mpi=" + args.srun_mpi] + shlex.split(args.launcher_args)
    if args.launcher == "mpirun":
        return ["mpirun", "-n", str(ranks)] + shlex.split(args.launcher_args)
    if ranks != 1:
        raise SystemExit("--launcher none runs 1 rank only")
    return []


# ------------------------------------------------------------------------- the emulated cluster
EMULATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "cluster", "emulate")


def placement(args, ranks):
    """[(node, ranks on it)] for a run of `ranks` on the emulated cluster: all on the first node at
    link rate 'local' (and for 1 rank), else spread: one rank per node up to the node count, then
    the same number on each node."""
    nodes = args.emu_nodes
    if args.link_rate == "local" or ranks == 1:
        return [(nodes[0], ranks)]
    used = min(ranks, len(nodes))
    if ranks % used:
        raise SystemExit(f"{ranks} ranks do not spread evenly over {used} nodes")
    return [(n, ranks // used) for n in nodes[:used]]


def launch(args, ranks, cmd, hosts=None, mpi_args=()):
    """The full command line that runs `cmd` on `ranks` processes: through the launcher on this
    host, or (emulated cluster) mpirun started on the first node of `hosts` (default: placement)."""
    if not args.emu_nodes:
        return launcher(args, ranks) + list(mpi_args) + cmd
    hosts = hosts or placement(args, ranks)
    mpirun = ["mpirun", "--host", ",".join(f"{n}:{k}" for n, k in hosts), "-n", str(ranks)]
    line = shlex.join(mpirun + shlex.split(args.launcher_args) + list(mpi_args) + cmd)
    return [os.path.join(EMULATE, "on.sh"), hosts[0][0], line]


class EmulatedCluster:
    """cluster/emulate/start.sh on entry (exit 77 where it cannot run), stop.sh on exit, always."""

    def __init__(self, args):
        self.args, self.dir = args, os.path.abspath(args.emulate_dir or os.path.join(args.out, "emu"))

    def __enter__(self):
        os.environ["DTRAIN_EMU_DIR"] = self.dir
        rc = subprocess.run([os.path.join(EMULATE, "start.sh"), "--nodes", str(self.args.emulate_nodes),
                             self.dir]).returncode
        if rc == 77:
            print("SKIP: the emulated cluster cannot run here", file=sys.stderr)
            sys.exit(77)
        if rc != 0:
            self.__exit__()
            raise SystemExit(f"cluster/emulate/start.sh failed (status {rc})")
        with open(os.path.join(self.dir, "node-names")) as f:
            self.args.emu_nodes = f.read().split()
        return self

    def __exit__(self, *exc):
        subprocess.run([os.path.join(EMULATE, "stop.sh"), self.dir])
        return False


def set_link_rate(args, rate):
    """Every node's link at `rate` (tc token bucket); 'local' runs on one node, its link unlimited."""
    args.link_rate = rate
    for node in args.emu_nodes:
        subprocess.run([os.path.join(EMULATE, "link.sh"), node, "none" if rate == "local" else rate], check=True,
                       stderr=subprocess.DEVNULL, env={**os.environ, "DTRAIN_EMU_BURST_MS": str(args.link_burst_ms)})


def read_metrics(path):
    steps, summary = [], {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if "summary" in rec:
                summary = rec
            elif "step_time_s" in rec:
                steps.append(rec)
    return steps, summary


def train_cmd(args, model, batch_opt, compression, precision, metrics):
    return [args.dtrain, "train", "--synthetic", "--model", model, "--steps", str(args.steps), "--log-every",
            str(args.log_every), "--progress", "off", "--metrics", metrics, "--compression", compression,
            "--precision", precision, "--threads", str(args.threads), "--bucket-mb",
            str(args.bucket_mb)] + batch_opt + shlex.split(args.train_args)


def steady_means(metrics):
    """(per-step means of the steady state, summary record) of one run's metrics file."""
    steps, summary = read_metrics(metrics)
    # The first logged interval holds start-up (first allocations, thread pools): leave it out.
    steady = steps[1:] if len(steps) > 1 else steps
    if not steady:
        raise SystemExit(f"no step metrics in {metrics}")
    keys = ("step_time_s", "comm_wait_s", "data_wait_s", "forward_s", "backward_s", "optimizer_s", "compute_max_s",
            "bytes_sent_per_step", "samples_per_s")
    m = {k: float(np.mean([s.get(k, 0.0) for s in steady])) for k in keys}
    # What the split does not name: host work between the timed phases (batch hand-over, bookkeeping).
    m["other_s"] = max(m["step_time_s"] - m["forward_s"] - m["backward_s"] - m["optimizer_s"] - m["comm_wait_s"] -
                       m["data_wait_s"], 0.0)
    m["bucket_count"] = int(steps[-1].get("bucket_count", 0))
    m["train_accuracy"] = steps[-1].get("train_accuracy", 0)
    return m, summary


def run_alone(args, model, ranks, per_rank, compression, precision, index):
    """`ranks` independent 1-rank runs at once, as many processes as the multi-rank run but with no
    communication: the compute each rank gets when the node is shared that way (cores, memory
    bandwidth). The `contended` model variant predicts from these, not from the multi-rank run."""
    procs = []
    for j in range(ranks):
        metrics = os.path.join(args.out, "metrics",
                               f"run{index:03d}{rate_tag(args)}-alone{j}-{model}-b{per_rank}.jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)
        # Each mpirun its own session directory: several started at once on one node otherwise race
        # to create the same one (Open MPI: "Directory /tmp/ompi.<node>.<uid> ... File exists").
        session = os.path.join(args.out, "ompi-sessions", f"alone{j}")
        os.makedirs(session, exist_ok=True)
        by_mpirun = bool(args.emu_nodes) or args.launcher == "mpirun"
        cmd = launch(args, 1, train_cmd(args, model, ["--batch-size", str(per_rank)], compression, precision,
                                        metrics), mpi_args=("--mca", "orte_tmpdir_base", session) if by_mpirun else ())
        log = open(metrics + ".log", "w")
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True), metrics, log))
    print(f"+ {ranks} x 1-rank {model} b{per_rank} at once (no communication)", file=sys.stderr, flush=True)
    out = {"alone_forward_s": [], "alone_backward_s": [], "alone_optimizer_s": [], "alone_other_s": []}
    for proc, metrics, log in procs:
        rc = proc.wait(timeout=args.timeout)
        log.close()
        if rc != 0:
            raise SystemExit(f"1-rank run failed (status {rc}); see {metrics}.log")
        m, _ = steady_means(metrics)
        for k in ("forward_s", "backward_s", "optimizer_s", "other_s"):
            out["alone_" + k].append(m[k])
    # The slowest of them paces a synchronous step.
    slow = max(range(ranks), key=lambda j: out["alone_forward_s"][j] + out["alone_backward_s"][j])
    return {k: v[slow] for k, v in out.items()}


def rate_tag(args):
    return f"-{args.link_rate}" if args.emu_nodes else ""


def topology(args, ranks):
    """The nodes a run spans, its ranks per node and the nodes' link rate ('' on this host alone)."""
    hosts = placement(args, ranks) if args.emu_nodes else [("", ranks)]
    return {"nodes": len(hosts), "ranks_per_node": hosts[0][1], "link_rate": args.link_rate if args.emu_nodes else ""}


def run_one(args, mode, model, ranks, batch, compression, precision, index):
    """One training run; returns a result row (a dict of FIELDS)."""
    if mode == "strong":
        if batch % ranks:
            print(f"skip: global batch {batch} does not split over {ranks} ranks", file=sys.stderr)
            return None
        per_rank, batch_opt = batch // ranks, ["--global-batch-size", str(batch)]
    else:
        per_rank, batch_opt = batch, ["--batch-size", str(batch)]
    metrics = os.path.join(args.out, "metrics",
                           f"run{index:03d}{rate_tag(args)}-{mode}-{model}-n{ranks}-b{batch}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = launch(args, ranks, train_cmd(args, model, batch_opt, compression, precision, metrics))
    print("+ " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr, flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=args.timeout)
    wall = time.time() - t0
    with open(metrics + ".log", "w") as f:
        f.write(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"run failed (status {proc.returncode}):\n{proc.stdout[-3000:]}")
    m, summary = steady_means(metrics)
    params = re.search(r"\((\d+) parameters\)", proc.stdout)
    row = {"mode": mode, "model": model, "ranks": ranks, "batch_per_rank": per_rank, "global_batch": per_rank * ranks,
           "compression": compression, "precision": precision, "params": int(params.group(1)) if params else 0,
           "samples_per_s": summary.get("samples_per_s") or m["samples_per_s"], "step_time_s": m["step_time_s"],
           "compute_s": max(m["step_time_s"] - m["comm_wait_s"] - m["data_wait_s"], 0.0),
           "comm_wait_s": m["comm_wait_s"], "data_wait_s": m["data_wait_s"], "forward_s": m["forward_s"],
           "backward_s": m["backward_s"], "optimizer_s": m["optimizer_s"], "other_s": m["other_s"],
           "compute_max_s": m["compute_max_s"], "bucket_count": m["bucket_count"], "bucket_mb": args.bucket_mb,
           "bytes_sent_per_step": m["bytes_sent_per_step"], "final_train_accuracy": m["train_accuracy"],
           "wall_s": round(wall, 2)}
    row.update(topology(args, ranks))
    if ranks > 1 and not getattr(args, "no_alone", False):
        row.update(run_alone(args, model, ranks, per_rank, compression, precision, index))
    return row


def group_key(r):
    base = r["global_batch"] if r["mode"] == "strong" else r["batch_per_rank"]
    key = (r["mode"], r["model"], int(base), r["compression"], r["precision"])
    return key + (r["link_rate"],) if r.get("link_rate") else key


def add_speedup(rows):
    """Speedup and efficiency against the fewest ranks of each group (same mode, model, batch, ...)."""
    groups = {}
    for r in rows:
        groups.setdefault(group_key(r), []).append(r)
    for g in groups.values():
        base = min(g, key=lambda r: int(r["ranks"]))
        for r in g:
            speedup = float(r["samples_per_s"]) / float(base["samples_per_s"])
            r["speedup"] = round(speedup, 4)
            r["efficiency"] = round(speedup / (int(r["ranks"]) / int(base["ranks"])), 4)
    return groups


def write_csv(rows, path):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in FIELDS})


def read_csv(path):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k in FIELDS:
            if k in TEXT_FIELDS:
                continue
            r[k] = float(r[k]) if r.get(k, "") != "" else 0.0
        r["ranks"] = int(r["ranks"])
        r["nodes"], r["ranks_per_node"] = int(r["nodes"] or 1), int(r["ranks_per_node"] or r["ranks"])
        r["link_rate"] = r.get("link_rate") or ""
    return rows


def emulated(rows):
    return any(r.get("link_rate") for r in rows)


def where(r, rows):
    """The placement columns of a row: nodes x ranks per node and link rate (emulated cluster only)."""
    return [f"{int(r['nodes'])}x{int(r['ranks_per_node'])}", r["link_rate"]] if emulated(rows) else []


def markdown_table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" ---: " for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def results_markdown(rows):
    header = ["mode", "model", "ranks"] + (["nodes x ranks", "link"] if emulated(rows) else []) + [
        "batch/rank", "global batch", "compression", "precision", "samples/s", "step ms", "compute ms", "comm wait ms",
        "data wait ms", "speedup", "efficiency"]
    body = [[r["mode"], r["model"], r["ranks"]] + where(r, rows) + [int(r["batch_per_rank"]), int(r["global_batch"]),
             r["compression"],
             r["precision"], f"{float(r['samples_per_s']):.0f}", f"{1e3 * float(r['step_time_s']):.2f}",
             f"{1e3 * float(r['compute_s']):.2f}", f"{1e3 * float(r['comm_wait_s']):.2f}",
             f"{1e3 * float(r['data_wait_s']):.2f}", f"{float(r['speedup']):.2f}", f"{100 * float(r['efficiency']):.0f} %"]
            for r in rows]
    return markdown_table(header, body)


def plot(rows, groups, out, prefix=""):
    """speedup.png, efficiency.png, breakdown.png, batch.png (names after `prefix`); returns the files."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not found (apt-get install python3-matplotlib): no plots", file=sys.stderr)
        return []
    files = []
    for what, ylabel in (("speedup", "speedup over the fewest ranks"), ("efficiency", "parallel efficiency")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, g in sorted(groups.items()):
            g = sorted(g, key=lambda r: r["ranks"])
            ax.plot([r["ranks"] for r in g], [float(r[what]) for r in g], marker="o", label=" ".join(map(str, key)))
        ranks = sorted({r["ranks"] for r in rows})
        ideal = [n / ranks[0] for n in ranks] if what == "speedup" else [1.0] * len(ranks)
        ax.plot(ranks, ideal, "k--", linewidth=0.8, label="ideal")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = os.path.join(out, prefix + what + ".png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        files.append(path)
    # Time breakdown: one stacked bar per run.
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(rows)), 4))
    labels = [" ".join([f"{r['mode'][0]} {r['model']} n{r['ranks']}"] + where(r, rows) +
                       [f"b{int(r['global_batch'])} {r['compression']} {r['precision']}"]) for r in rows]
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for key, name in (("compute_s", "compute"), ("comm_wait_s", "communication wait"), ("data_wait_s", "data wait")):
        v = np.array([1e3 * float(r[key]) for r in rows])
        ax.bar(x, v, bottom=bottom, label=name)
        bottom += v
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=6)
    ax.set_ylabel("ms per step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, prefix + "breakdown.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    files.append(path)
    # Batch-size sweep: throughput against the global batch, one line per rank count.
    if len({r["global_batch"] for r in rows}) > 1 and not emulated(rows):
        fig, ax = plt.subplots(figsize=(6, 4))
        for n in sorted({r["ranks"] for r in rows}):
            g = sorted((r for r in rows if r["ranks"] == n), key=lambda r: float(r["global_batch"]))
            ax.plot([float(r["global_batch"]) for r in g], [float(r["samples_per_s"]) for r in g], marker="o",
                    label=f"{n} ranks")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global batch")
        ax.set_ylabel("samples/s")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = os.path.join(out, "batch.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        files.append(path)
    return files


def sweep_rows(args):
    """Every combination of the sweep (and the overlap model's runs) at the current placement."""
    rows = []
    combos = itertools.product(split_list(args.mode), split_list(args.models), split_list(args.batch_sizes, int),
                               split_list(args.compression), split_list(args.precision), split_list(args.ranks, int))
    for i, (mode, model, batch, comp, prec, ranks) in enumerate(combos):
        if mode not in ("strong", "weak"):
            raise SystemExit(f"--mode: '{mode}' is not strong or weak")
        rows.append(run_one(args, mode, model, ranks, batch, comp, prec, i))
    if args.overlap_model:
        # A model with many gradient buckets, weak scaling over the same ranks: the runs where
        # buckets go out while backward still runs, so the model's overlap is checked against them.
        o = argparse.Namespace(**vars(args))
        o.steps, o.bucket_mb, o.log_every = args.overlap_steps, args.overlap_bucket_mb, max(1, args.overlap_steps // 5)
        for j, ranks in enumerate(split_list(args.ranks, int)):
            rows.append(run_one(o, "weak", args.overlap_model, ranks, args.overlap_batch, "none", "fp32", 900 + j))
    return [r for r in rows if r]


def bench_cmd(args):
    # As many untimed iterations as timed ones: a rate-limited link (tc's token bucket) starts with
    # a burst's worth of tokens (10 ms of traffic), and two warm-up iterations of a 256 KiB
    # allreduce do not use it up, so the timed ones ran partly at the host's speed, not the link's.
    iters = str(args.bench_iters)
    return [args.dtrain, "bench", "allreduce", "-b", "4", "-e", args.bench_max_bytes, "-f", "4", "-n", iters,
            "--warmup", iters, "--no-baseline"]


def run_bench(args, name, ranks, hosts=None, mpi_args=()):
    """`dtrain bench allreduce` on `ranks` (on the emulated cluster: at `hosts`), saved as OUT/bench/NAME.txt."""
    cmd = launch(args, ranks, bench_cmd(args), hosts, mpi_args)
    print("+ " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr, flush=True)
    text = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=True,
                          timeout=args.timeout).stdout
    os.makedirs(os.path.join(args.out, "bench"), exist_ok=True)
    with open(os.path.join(args.out, "bench", name + ".txt"), "w") as f:
        f.write(text)
    return text


# Open MPI's coll/tuned allreduce algorithms forced by number (--mca coll_tuned_allreduce_algorithm).
FORCED = {"ring": 4, "rabenseifner": 6}


def run_level_benches(args, rate):
    """The benchmarks the two-level model is fitted to and checked against, at link rate `rate`:
    inter-RATE (1 rank on each of 2 nodes, over the link) and check-RATE (the sweep's most ranks,
    placed as the sweep places them; with --check-algorithms also with Open MPI's ring and
    Rabenseifner algorithms forced). The intra-node benchmark (2 ranks on one node) runs once."""
    if not os.path.exists(os.path.join(args.out, "bench", "intra.txt")):
        run_bench(args, "intra", 2, [(args.emu_nodes[0], 2)])
    if rate != "local":
        run_bench(args, f"inter-{rate}", 2, [(n, 1) for n in args.emu_nodes[:2]])
    most = max(split_list(args.ranks, int))
    if most > 2:
        run_bench(args, f"check-{rate}", most)
        for alg in split_list(args.check_algorithms):
            forced = ["--mca", "coll_tuned_use_dynamic_rules", "1", "--mca", "coll_tuned_allreduce_algorithm",
                      str(FORCED[alg])]
            run_bench(args, f"check-{rate}-{alg}", most, mpi_args=forced)


def run_sweep(args):
    """The sweep on this host, or on the emulated cluster at each link rate with its benchmarks."""
    shutil.rmtree(os.path.join(args.out, "bench"), ignore_errors=True)  # benchmarks belong to their sweep
    if not args.emulate_nodes:
        return sweep_rows(args)
    if args.launcher != "mpirun":
        raise SystemExit("--emulate-nodes runs through mpirun only")
    rows = []
    with EmulatedCluster(args):
        for rate in split_list(args.link_rates):
            set_link_rate(args, rate)
            rows += sweep_rows(args)
            run_level_benches(args, rate)
        set_link_rate(args, "none")  # the link without a limit: TCP through the host's cores
        run_bench(args, "inter-none", 2, [(n, 1) for n in args.emu_nodes[:2]])
    return rows


def sweep_intro(args):
    where_ = (f"an emulated cluster of {args.emulate_nodes} nodes (cluster/emulate: network namespaces on one "
              f"host, links limited by tc's token bucket) at link rates {args.link_rates} ('local': every rank on "
              "one node); runs spread one rank per node, then the same number on each node"
              if args.emulate_nodes else f"this host (launcher `{args.launcher}`)")
    return (f"Runs on {where_}, {args.steps} steps per run, synthetic data, {args.threads} thread(s) per rank. "
            "Step times leave out the first logged interval (start-up). Speedup and efficiency are throughput "
            "against the fewest ranks of the same mode, model, batch, compressor and precision"
            f"{' and link rate' if args.emulate_nodes else ''}; weak scaling keeps the per-rank batch, strong "
            "scaling the global batch.\n\n")


def cmd_sweep(args):
    os.makedirs(os.path.join(args.out, "metrics"), exist_ok=True)
    rows = run_sweep(args)
    if not rows:
        raise SystemExit("no run in the sweep")
    groups = add_speedup(rows)
    write_csv(rows, os.path.join(args.out, "results.csv"))
    plots = plot(rows, groups, args.out, args.plot_prefix)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write("# dtrain scaling study\n\n" + sweep_intro(args))
        f.write(results_markdown(rows))
        for p in plots:
            f.write(f"\n![{os.path.basename(p)}]({os.path.basename(p)})\n")
    print(f"wrote {args.out}/results.csv, report.md" + (", " + ", ".join(map(os.path.basename, plots)) if plots else ""))


# ----------------------------------------------------------------------------------- the model
def parse_bench(text):
    """(ranks, nodes, [(bytes, seconds)]) from `dtrain bench allreduce` output: dtrain rows (impl
    dtrain:ALGORITHM, the algorithm training's buckets take at that size), f32, sum."""
    m = re.search(r"bench allreduce: (\d+) ranks(?: on (\d+) node)?", text)
    if not m:
        raise SystemExit("not `dtrain bench allreduce` output (no '<n> ranks' header)")
    pts = []
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 6 and f[0].isdigit() and f[4].startswith("dtrain"):
            pts.append((int(f[0]), float(f[5]) * 1e-6))
    if len(pts) < 2:
        raise SystemExit("fewer than 2 allreduce rows to fit")
    return int(m.group(1)), int(m.group(2) or 1), pts


def fit_alpha_beta(n, pts, latency_max=1024, bandwidth_min=262144):
    """t = alpha + beta * S * 2(n-1)/n: alpha the mean time of the sizes up to latency_max bytes (the
    latency regime), beta the least-squares slope of t - alpha over the sizes from bandwidth_min (the
    bandwidth regime, past the MPI library's switch to its large-message protocol; the largest size
    where none is that large), which the largest sizes dominate: they are the least disturbed by
    latency, protocol switches and a link's token bucket (its burst carries a 256 KiB allreduce at
    up to twice a 1 Gbit/s link's rate). One line through all sizes cannot follow the protocol
    switch: weighted to the small sizes it overstated a 1 Gbit/s link's bandwidth 4x."""
    small = [t for s, t in pts if s <= latency_max] or [pts[0][1]]
    alpha = float(np.mean(small))
    large = [(s * 2 * (n - 1) / n, t) for s, t in pts if s >= min(bandwidth_min, pts[-1][0])]
    beta = sum(x * (t - alpha) for x, t in large) / sum(x * x for x, _ in large)
    return alpha, max(beta, 1e-15)


def measured_allreduce_s(pts, beta):
    """The benchmark's own curve: time at a size by log-log interpolation between the measured sizes
    (a line through the alpha-beta fit's two regimes does not bend where the MPI library switches
    protocol, the measured points do); the smallest size's time below it, and beyond the largest
    its time plus the fitted bandwidth term for the extra bytes."""
    xs = np.log([p[0] for p in pts])
    ys = np.log([p[1] for p in pts])
    big, t_big = pts[-1]

    def cost(nbytes):
        if nbytes <= 0:
            return 0.0
        if nbytes >= big:
            return t_big + beta * (nbytes - big)
        return float(np.exp(np.interp(np.log(nbytes), xs, ys)))
    return cost


class Level:
    """One level of the network: inside a node, or the link between nodes at one rate; fitted to a
    `dtrain bench allreduce` at that level (2 ranks: on one node, or one on each of two nodes).
    `fitted` and `measured` give the seconds of a 2-rank allreduce in which each rank sends (and
    receives) X bytes: the alpha-beta line and the benchmark's own curve."""

    def __init__(self, name, text):
        self.name = name
        self.ranks, self.nodes, self.pts = parse_bench(text)
        self.alpha, self.beta = fit_alpha_beta(self.ranks, self.pts)
        ring = 2 * (self.ranks - 1) / self.ranks  # bytes each rank sends per byte of the vector
        curve = measured_allreduce_s(self.pts, self.beta * ring)
        self.fitted = lambda x: self.alpha + self.beta * x
        self.measured = lambda x: curve(x / ring)


def exchange_s(cost, nbytes, flows=1):
    """One pairwise exchange of nbytes each way, with `flows` such exchanges sharing the link: half a
    2-rank allreduce (two exchanges) in which each rank sends flows * 2 * nbytes."""
    return 0.5 * cost(2 * flows * nbytes)


def allreduce_steps(algorithm, nbytes, ranks, nodes):
    """The exchanges of one allreduce of nbytes on `ranks` placed in blocks of ranks/nodes per node:
    [(level, bytes each way per rank, flows sharing the level's link)].
    ring: 2(P-1) exchanges of S/P between neighbours, each paced by the slowest link of the ring;
    rabenseifner: recursive halving then doubling (partner distance 1, 2, 4, ...: the first
    log2(ranks per node) steps stay inside a node; later ones cross with every rank of the node at
    once), exchanges of S/2, S/4, ... and back; recursive_doubling: log2(P) exchanges of all S.
    Rank counts that are not a power of two are costed as a ring."""
    if ranks <= 1:
        return []
    per_node = ranks // nodes
    if algorithm == "ring" or ranks & (ranks - 1):
        return [("inter" if nodes > 1 else "intra", nbytes / ranks, 1)] * (2 * (ranks - 1))
    steps = []
    for k in range(ranks.bit_length() - 1):
        level, flows = ("inter", per_node) if (1 << k) >= per_node else ("intra", 1)
        if algorithm == "recursive_doubling":
            steps.append((level, nbytes, flows))
        else:
            steps += [(level, nbytes / 2 ** (k + 1), flows)] * 2
    return steps


def ompi_algorithm(nbytes, ranks):
    """The algorithm Open MPI 4.1's coll/tuned fixed decision picks for a commutative MPI_Allreduce
    (its table for communicators under 16 ranks; Rabenseifner, its large-message choice, beyond)."""
    if ranks < 4:  # ring up to 64 KiB and segmented ring up to 256 KiB: the same bytes
        cuts = [(8, "ring"), (4096, "recursive_doubling"), (8192, "ring"), (16384, "recursive_doubling"),
                (262144, "ring")]
    elif ranks < 8:
        cuts = [(16, "ring"), (8192, "recursive_doubling")]
    else:
        cuts = [(8192, "recursive_doubling")]
    alg = next((alg for limit, alg in cuts if nbytes < limit), "rabenseifner")
    # Its ring falls back to recursive doubling below one element (f32) per rank.
    return "recursive_doubling" if alg == "ring" and nbytes < 4 * ranks else alg


ALGORITHMS = {
    "ring": "a flat ring over all ranks, paced by the slowest link",
    "rabenseifner": "recursive halving and doubling, the node's ranks crossing the link at once",
    "ompi": "what Open MPI 4.1's coll/tuned picks for the size and rank count (recursive doubling, ring or "
            "Rabenseifner)",
}


def allreduce_cost(costs, algorithm, ranks, nodes):
    """Seconds of one allreduce of a given size on `ranks` over `nodes`: the exchanges of
    `algorithm` ('ompi': Open MPI's pick for the size) at their level's cost (costs: level -> a
    Level's fitted or measured function)."""
    def cost(nbytes):
        alg = ompi_algorithm(nbytes, ranks) if algorithm == "ompi" else algorithm
        return sum(exchange_s(costs[level], b, f) for level, b, f in allreduce_steps(alg, nbytes, ranks, nodes))
    return cost


def bucket_sizes(r):
    """Gradient bucket sizes in bytes, in the order backward produces them. The trainer reports the
    bucket count and the gradient bytes each step (with the padding to a multiple of the ranks,
    which travels in a bucket of its own); the rest is split evenly (the last layers fill the first)."""
    total = r["bytes_sent_per_step"] or 4.0 * r["params"]
    count = int(r.get("bucket_count") or 0) or max(1, math.ceil(total / (float(r.get("bucket_mb") or 25) * 2**20)))
    pad = total - 4.0 * r["params"] if r["params"] else 0.0
    if count > 1 and 0 < pad < 4 * int(r["ranks"]):
        return [(total - pad) / (count - 1)] * (count - 1) + [pad]
    return [total / count] * count


def overlapped_step(fwd, bwd, opt, sizes, allreduce_s, overlap=True, link=None, idle=0.0):
    """Step time and exposed communication when bucket i (sizes in backward order) becomes ready once
    backward has produced its share of the gradient, and buckets go out one after another.
    With `link` (a LinkBucket; allreduce_s then maps (size, tokens) to (seconds, tokens left)) the
    link banks tokens in every gap between exchanges, the step's `idle` time (outside forward,
    backward and optimizer) included, and the step repeats 30 times so the bank at its start
    settles."""
    total = sum(sizes) or 1.0

    def one_step(tokens, link_free):
        """link_free: when the last step's final exchange ended, in this step's time."""
        done, end = 0.0, 0.0
        for size in sizes:
            done += size
            ready = fwd + (bwd * done / total if overlap else bwd)
            start = max(end, ready)
            if link:
                tokens = min(link.burst, tokens + link.rate * (start - link_free))
                secs, tokens = allreduce_s(size, tokens)
            else:
                secs = allreduce_s(size)
            end = link_free = start + secs
        exposed = max(0.0, end - (fwd + bwd))
        step = fwd + bwd + exposed + opt
        return step, exposed, tokens, end - (step + idle)

    # A fixed 30 steps from a full bank: the bank's level at a step's start settles within a few.
    step, exposed, tokens, link_free = one_step(link.burst if link else 0.0, -(opt + idle))
    for _ in range(30 if link else 0):
        step, exposed, tokens, link_free = one_step(tokens, link_free)
    return step, exposed


class LinkBucket:
    """The token bucket that limits an emulated node's link (tc's tbf, cluster/emulate): tokens
    (bytes) accrue at the link's rate up to `burst` bytes, and bytes covered by them cross as fast as
    the link without a limit. So a link that idles during compute banks up to the burst, and the
    exchange that follows crosses faster than the rate: over steps the link carries its rate on
    average, not per exchange. The per-level benchmarks run exchanges back to back and see only the
    rate. A real link is the case burst = 0."""

    def __init__(self, rate, burst_ms):
        m = re.fullmatch(r"([0-9.]+)([kmg]?)bit", rate.lower())
        if not m:
            raise SystemExit(f"link rate '{rate}' is not in tc units (e.g. 1gbit)")
        self.rate = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] / 8  # bytes/s
        self.burst = max(32768.0, self.rate * burst_ms / 1e3)  # as cluster/emulate/lib.sh sets it


def banked_allreduce_cost(costs, algorithm, ranks, nodes, unlimited):
    """As allreduce_cost, over a link with a token bucket: (bytes, tokens) -> (seconds, tokens left).
    Of each exchange over the link, the bytes crossing it that tokens cover go at `unlimited`'s cost
    (the link benchmarked with no limit), the rest at the limited link's."""
    def cost(nbytes, tokens):
        alg = ompi_algorithm(nbytes, ranks) if algorithm == "ompi" else algorithm
        secs = 0.0
        for level, b, flows in allreduce_steps(alg, nbytes, ranks, nodes):
            t = exchange_s(costs[level], b, flows)
            if level == "inter" and b > 0:
                covered = min(tokens, flows * b)  # the node's bytes crossing the link each way
                tokens -= covered
                share = covered / (flows * b)
                t = share * exchange_s(unlimited, b, flows) + (1 - share) * t
            secs += t
        return secs, tokens
    return cost


def single_rank_compute(r, base_rows):
    """(forward, backward, optimizer, other) per step of the 1-rank run of the same config (at the same
    link rate where there are several): the same per-rank batch where such a run exists, else the
    group's base run scaled by the per-rank batch."""
    same = [b for b in base_rows if b["model"] == r["model"] and b["compression"] == r["compression"] and
            b["precision"] == r["precision"]]
    same = [b for b in same if b.get("link_rate") == r.get("link_rate")] or same
    exact = [b for b in same if int(b["batch_per_rank"]) == int(r["batch_per_rank"])]
    if exact:
        b = exact[0]
        return b["forward_s"], b["backward_s"], b["optimizer_s"], b.get("other_s") or 0.0
    if not same:
        return None
    b = min(same, key=lambda b: abs(b["batch_per_rank"] - r["batch_per_rank"]))
    k = r["batch_per_rank"] / b["batch_per_rank"]
    return b["forward_s"] * k, b["backward_s"] * k, b["optimizer_s"], b.get("other_s") or 0.0


VARIANTS = {
    "serial": "1-rank compute, then every bucket's allreduce (alpha-beta fits) after backward: no overlap",
    "calibrated": "1-rank compute; buckets allreduced (alpha-beta fits) as backward produces them",
    "contended": "compute measured in as many independent 1-rank runs at once as the run has ranks (the node "
                 "shared the same way, no communication); buckets at the benchmarks' measured allreduce times, "
                 "overlapped with backward. Predicts from measurements that do not include the run itself",
    "placed": "diagnostic (emulated cluster): as contended, but each allreduce at the benchmark of the run's own "
              "placement (same ranks and nodes), not composed from the two levels: its difference to contended is "
              "the two-level composition's error",
    "slowest": "diagnostic: compute of the slowest rank of the multi-rank run itself, split into forward and "
               "backward as at 1 rank; allreduce and overlap as in contended, so its error is the "
               "communication model's alone",
}


def predict(r, base_rows, fitted_s, measured_s, placed_s=None, link=None):
    """{variant: predicted step seconds} for one measured multi-rank run. fitted_s and measured_s
    give an allreduce's seconds for a bucket size: from the alpha-beta lines and the benchmarks' curves
    (with `link`, its token bucket: (size, tokens) -> (seconds, tokens left)); placed_s (where known)
    from a benchmark at the run's own placement."""
    comp = single_rank_compute(r, base_rows)
    if comp is None:
        return {}
    fwd, bwd, opt, other = comp
    sizes = bucket_sizes(r)
    extra = other + r["data_wait_s"]
    out = {"serial": overlapped_step(fwd, bwd, opt, sizes, fitted_s, False, link, extra)[0] + extra,
           "calibrated": overlapped_step(fwd, bwd, opt, sizes, fitted_s, True, link, extra)[0] + extra}
    if r.get("alone_forward_s"):
        extra = r["alone_other_s"] + r["data_wait_s"]
        out["contended"] = overlapped_step(r["alone_forward_s"], r["alone_backward_s"], r["alone_optimizer_s"],
                                           sizes, measured_s, True, link, extra)[0] + extra
        other = r["alone_other_s"]
        if placed_s:
            out["placed"] = overlapped_step(r["alone_forward_s"], r["alone_backward_s"], r["alone_optimizer_s"],
                                            sizes, placed_s)[0] + other + r["data_wait_s"]
    slow = r.get("compute_max_s") or 0.0
    if slow > 0:
        share = fwd / max(fwd + bwd, 1e-12)
        extra = other + r["data_wait_s"]
        out["slowest"] = overlapped_step(slow * share, slow * (1 - share), r["optimizer_s"] or opt, sizes,
                                         measured_s, True, link, extra)[0] + extra
    return out


def load_levels(args):
    """{name: Level}: 'intra', one 'inter-RATE' per link rate and the 'check-RATE' benchmarks (the
    sweep's most ranks as placed there) from the emulated sweep's OUT/bench; else 'intra' alone from
    --bench, or from `dtrain bench allreduce` run now on this host."""
    bench_dir = os.path.join(args.out, "bench")
    names = sorted(n[:-4] for n in os.listdir(bench_dir) if n.endswith(".txt")) if os.path.isdir(bench_dir) else []
    if not args.bench and any(n.startswith("inter-") for n in names):
        return {n: Level(n, open(os.path.join(bench_dir, n + ".txt")).read()) for n in names
                if n == "intra" or re.fullmatch(r"(inter|check)-[^-]+", n)}
    text = open(args.bench).read() if args.bench else run_bench(args, "intra", args.bench_ranks)
    return {"intra": Level("intra", text)}


def fit_report(levels):
    """The fits of the two levels, and the measured against the fitted time at every benchmarked size."""
    levels = {n: lv for n, lv in levels.items() if not n.startswith("check-")}
    out = ["\n## Performance model\n\nAlpha-beta fits to `dtrain bench allreduce`, t(S) = alpha + beta * S * "
           "2(n-1)/n on n ranks (S: bytes per rank):\n\n"]
    for lv in levels.values():
        where_ = "1 rank on each of 2 nodes, over the link" if lv.nodes > 1 else f"{lv.ranks} ranks on one node"
        out.append(f"- {lv.name} ({where_}; {len(lv.pts)} sizes, {lv.pts[0][0]} B to {lv.pts[-1][0]} B): "
                   f"alpha = {1e6 * lv.alpha:.2f} us, 1/beta = {1e-9 / lv.beta:.3f} GB/s\n")
    header, cols = ["bytes"], []
    for lv in levels.values():
        header += [f"{lv.name} measured us", f"{lv.name} model us"]
        ring = 2 * (lv.ranks - 1) / lv.ranks
        cols.append({s: (f"{1e6 * t:.1f}", f"{1e6 * lv.fitted(s * ring):.1f}") for s, t in lv.pts})
    sizes = sorted({s for c in cols for s in c})
    body = [[s] + [x for c in cols for x in c.get(s, ("", ""))] for s in sizes]
    out.append("\n" + markdown_table(header, body))
    return out


def check_benches(args):
    """[(link rate, bench text, {forced algorithm: its bench text})] of the sweep's check benchmarks."""
    bench_dir = os.path.join(args.out, "bench")
    names = sorted(os.listdir(bench_dir)) if os.path.isdir(bench_dir) and not args.bench else []
    read = lambda n: open(os.path.join(bench_dir, n)).read()
    return [(n[6:-4], read(n), {a: read(f"{n[:-4]}-{a}.txt") for a in FORCED if f"{n[:-4]}-{a}.txt" in names})
            for n in names if re.fullmatch(r"check-[^-]+\.txt", n)]


def check_algorithms(args, levels):
    """The allreduce alone: the two-level model (the levels' measured curves, composed by each
    algorithm) against the check benchmarks, which run the sweep's most ranks placed as in the
    sweep. Returns (markdown, {algorithm: mean absolute error at sizes >= --check-min-bytes},
    {forced algorithm: mean absolute difference of its benchmark to Open MPI's pick at those sizes})."""
    errs, table, pick_diff = {a: [] for a in ALGORITHMS}, [], {a: [] for a in FORCED}
    for rate, text, forced in check_benches(args):
        n, nodes, pts = parse_bench(text)
        costs = {k: lv.measured for k, lv in (("intra", levels["intra"]), ("inter", levels.get(f"inter-{rate}")))
                 if lv}
        models = {a: allreduce_cost(costs, a, n, nodes) for a in ALGORITHMS}
        forced_t = {a: dict(parse_bench(t)[2]) for a, t in forced.items()}
        for size, t in pts:
            line = [rate, f"{nodes}x{n // nodes}", size, f"{1e6 * t:.0f}"]
            line += [f"{1e6 * forced_t[a][size]:.0f}" if size in forced_t.get(a, {}) else "" for a in FORCED]
            for a in FORCED:
                if size >= args.check_min_bytes and size in forced_t.get(a, {}):
                    pick_diff[a].append(abs(forced_t[a][size] - t) / t)
            for a, cost in models.items():
                e = (cost(size) - t) / t
                if size >= args.check_min_bytes:
                    errs[a].append(abs(e))
                line.append(f"{1e6 * cost(size):.0f} ({100 * e:+.0f} %)")
            table.append(line)
    if not table:
        return [], {}, {}
    mean = {a: float(np.mean(v)) for a, v in errs.items() if v}
    pick = {a: float(np.mean(v)) for a, v in pick_diff.items() if v}
    header = ["link", "nodes x ranks", "bytes", "measured us (Open MPI's pick)"] + [
        f"{a} forced us" for a in FORCED] + [f"model {a} us (error)" for a in ALGORITHMS]
    out = ["\n### The allreduce across nodes\n\nThe two-level model of one allreduce (each exchange of an algorithm "
           "costed at its level's measured curve: inside a node, or over the link at its rate, shared by the "
           "flows crossing at once) against `dtrain bench allreduce` on the sweep's most ranks placed as in the "
           "sweep; beside it the same benchmark with Open MPI's algorithm forced "
           "(`--mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm N`). Algorithms:\n\n"]
    out += [f"- **{a}**: {d}\n" for a, d in ALGORITHMS.items()]
    out.append("\n" + markdown_table(header, table))
    out.append(f"\nMean absolute error at sizes from {args.check_min_bytes} B: " +
               ", ".join(f"{a} {100 * e:.1f} %" for a, e in mean.items()) + ".\n")
    if pick:
        out.append("Open MPI's pick against the forced algorithms at those sizes (mean absolute difference): " +
                   ", ".join(f"{a} {100 * d:.1f} %" for a, d in pick.items()) + ".\n")
    return out, mean, pick


def choose_algorithm(args, check_err, pick_diff):
    """--allreduce-model; or (auto) the forced algorithm whose benchmark matches Open MPI's pick, as
    Open MPI's own rule where that rule's model is as good; without forced benchmarks the algorithm
    whose model fits the check benchmarks best; a ring without them. Which algorithm ran is read
    from measurements, not from the model's errors: those are where a composition misses."""
    if args.allreduce_model != "auto":
        return args.allreduce_model
    if pick_diff:
        ran = min(pick_diff, key=pick_diff.get)
        return "ompi" if check_err.get("ompi", 1e9) <= check_err[ran] + 1e-4 else ran
    # A tie (Open MPI picks Rabenseifner at every checked size) goes to Open MPI's own choice.
    return min(check_err, key=lambda a: (round(check_err[a], 4), a != "ompi")) if check_err else "ring"


def run_costs(levels, r, algorithm, burst_ms):
    """(fitted, measured, link): seconds of one allreduce of a size in run r, its placement's levels
    (inside a node; the link at the run's rate) composed by `algorithm`. Across nodes with a limited
    link of a token bucket of burst_ms (and the link benchmarked without a limit) link is its
    LinkBucket and the costs are banked_allreduce_cost's; else link is None."""
    use = {"intra": levels["intra"]}
    link = None
    if r["nodes"] > 1:
        name = f"inter-{r['link_rate']}"
        if name not in levels:
            raise SystemExit(f"no benchmark '{name}' for a run on {r['nodes']} nodes (run the sweep with the cluster)")
        use["inter"] = levels[name]
        if burst_ms > 0 and r["link_rate"] not in ("none", "local") and "inter-none" in levels:
            link = LinkBucket(r["link_rate"], burst_ms)
    costs = []
    for kind in ("fitted", "measured"):
        per_level = {k: getattr(lv, kind) for k, lv in use.items()}
        costs.append(banked_allreduce_cost(per_level, algorithm, r["ranks"], r["nodes"],
                                           getattr(levels["inter-none"], kind)) if link else
                     allreduce_cost(per_level, algorithm, r["ranks"], r["nodes"]))
    return costs[0], costs[1], link


def placed_cost(levels, r):
    """Seconds of one allreduce in run r from the benchmark at its own placement, where there is one
    (emulated cluster: 2 ranks on one node, 1 per node over the link, the check benchmarks)."""
    if not r["link_rate"]:
        return None
    if r["ranks"] == 2:
        name = "intra" if r["nodes"] == 1 else f"inter-{r['link_rate']}"
    else:
        name = f"check-{r['link_rate']}"
    lv = levels.get(name)
    if not lv or (lv.ranks, lv.nodes) != (r["ranks"], r["nodes"]):
        return None
    return lambda nbytes: lv.measured(nbytes * 2 * (lv.ranks - 1) / lv.ranks)


def predict_rows(rows, levels, algorithm, burst_ms):
    """Every multi-rank run against its predictions: (variants predicted, table rows, records, errors)."""
    base_rows = [r for r in rows if r["ranks"] == 1]
    runs = []
    for r in (r for r in rows if r["ranks"] > 1):
        fitted_s, measured_s, link = run_costs(levels, r, algorithm, burst_ms)
        runs.append((r, predict(r, base_rows, fitted_s, measured_s, placed_cost(levels, r), link)))
    runs = [(r, preds) for r, preds in runs if preds]
    variants = [v for v in VARIANTS if any(v in preds for _, preds in runs)]
    table, recs, errors = [], [], []
    for r, preds in runs:
        # Efficiency as measured: throughput against the 1-rank run of the group, per rank.
        base = [b for b in base_rows if group_key(b) == group_key(r)]
        line = [r["mode"], r["model"], r["ranks"]] + where(r, rows) + [
            int(r["batch_per_rank"]), r["compression"], r["precision"], f"{1e3 * r['step_time_s']:.2f}",
            f"{100 * r['efficiency']:.0f} %"]
        rec = {k: r[k] for k in ("mode", "model", "ranks", "nodes", "ranks_per_node", "link_rate", "compression",
                                 "precision")}
        rec.update(batch_per_rank=int(r["batch_per_rank"]), measured_step_s=r["step_time_s"],
                   measured_efficiency=r["efficiency"])
        for v in variants:
            if v not in preds:
                line += ["", ""]
                continue
            t = preds[v]
            err = (t - r["step_time_s"]) / r["step_time_s"]
            eff = (r["global_batch"] / t) / (base[0]["samples_per_s"] * r["ranks"]) if base else ""
            errors.append({"variant": v, "link": r["link_rate"], "step": abs(err),
                           "eff": abs(eff - r["efficiency"]) / max(r["efficiency"], 1e-9) if base else None})
            rec[v + "_step_s"], rec[v + "_step_error"], rec[v + "_efficiency"] = t, err, eff
            line += [f"{1e3 * t:.2f} ({100 * err:+.0f} %)", f"{100 * eff:.0f} %" if eff != "" else ""]
        table.append(line)
        recs.append(rec)
    return variants, table, recs, errors


def error_stats(errs):
    step, eff = [e["step"] for e in errs], [e["eff"] for e in errs if e["eff"] is not None]
    return {"step_mean": float(np.mean(step)), "step_max": float(np.max(step)),
            "eff_mean": float(np.mean(eff)) if eff else None, "eff_max": float(np.max(eff)) if eff else None,
            "points": len(step)}


def error_cells(s_):
    pct = lambda x: f"{100 * x:.1f} %" if x is not None else ""
    return [s_["points"], pct(s_["step_mean"]), pct(s_["step_max"]), pct(s_["eff_mean"]), pct(s_["eff_max"])]


def error_tables(errors, by_link):
    """(markdown, {variant: stats}): the errors per variant over every point, and per link rate."""
    summary = {v: error_stats([e for e in errors if e["variant"] == v]) for v in VARIANTS
               if any(e["variant"] == v for e in errors)}
    cols = ["points", "step time mean", "step time max", "efficiency mean", "efficiency max"]
    out = ["\n### Model error\n\nRelative error against the measured multi-rank points (absolute values):\n\n",
           markdown_table(["variant"] + cols, [[v] + error_cells(s_) for v, s_ in summary.items()])]
    if by_link:
        links = sorted({e["link"] for e in errors})
        body = [[v, link] + error_cells(error_stats(sel)) for v in summary for link in links
                if (sel := [e for e in errors if e["variant"] == v and e["link"] == link])]
        out += ["\nBy link rate:\n\n", markdown_table(["variant", "link"] + cols, body)]
    return out, summary


def write_model_csvs(args, recs, summary):
    with open(os.path.join(args.out, "model.csv"), "w", newline="") as f:
        keys = list(recs[0].keys())
        for rec in recs[1:]:
            keys += [k for k in rec if k not in keys]
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(recs)
    with open(os.path.join(args.out, "model_errors.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "points", "step_error_mean", "step_error_max", "efficiency_error_mean",
                    "efficiency_error_max"])
        for v, s_ in summary.items():
            w.writerow([v, s_["points"], s_["step_mean"], s_["step_max"], s_["eff_mean"], s_["eff_max"]])


def plot_model(recs, out, prefix):
    """model.png: predicted against measured step time per variant, with the +-15 % band."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, ax = plt.subplots(figsize=(6, 5))
    ms = [1e3 * r["measured_step_s"] for r in recs]
    for v, marker in zip(VARIANTS, "soDv^"):
        pts = [(1e3 * r["measured_step_s"], 1e3 * r[v + "_step_s"]) for r in recs if v + "_step_s" in r]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, label=v, alpha=0.8)
    lo, hi = 0.8 * min(ms), 1.25 * max(ms)
    ax.plot([lo, hi], [lo, hi], "k-", linewidth=0.8)
    ax.fill_between([lo, hi], [0.85 * lo, 0.85 * hi], [1.15 * lo, 1.15 * hi], color="grey", alpha=0.2,
                    label="within 15 %")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step ms")
    ax.set_ylabel("predicted step ms")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = os.path.join(out, prefix + "model.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def variants_text(variants, algorithm, two_level, burst_ms):
    how = (f"Across nodes the allreduce is costed as {algorithm} ({ALGORITHMS[algorithm]}): each of its exchanges "
           "at the cost of its level, inside a node or over the link at the run's rate (two-level). "
           if two_level else "")
    if two_level and burst_ms > 0:
        how += (f"The link's token bucket ({burst_ms:g} ms of traffic at its rate, as cluster/emulate sets tc's tbf) "
                "is part of the link: it banks tokens while the link idles between exchanges (compute, "
                "optimizer), and the bytes they cover cross at the cost of the link benchmarked without a "
                "limit; the step repeats 30 times so the bank at its start settles (serial, calibrated, "
                "contended, slowest; `--link-burst-ms 0` models a link without one). ")
    return ["\nModel variants. Each predicts step time = compute (forward + backward) + the part of the gradient "
            "allreduce not hidden behind backward + optimizer step + the host work the split does not name "
            "(measured where the compute comes from) + measured data wait. The gradient travels in buckets (count "
            "from the run's metrics); bucket i is ready once backward has produced its share of the gradient "
            "(ready times spread in proportion through backward), buckets go out one after another, each costing "
            f"the allreduce time of its size. {how}\n\n"] + [f"- **{v}**: {VARIANTS[v]}\n" for v in variants]


def projection(args, rows):
    """The calibrated model on a larger cluster of the given links: flat ring against hierarchical."""
    base_rows = [r for r in rows if r["ranks"] == 1]
    out = []
    # Projection with the calibrated model: compute measured at 1 rank (or given), gradient in buckets
    # overlapped with backward, allreduce over links of the given bandwidth and latency, flat ring
    # against hierarchical (reduce-scatter in the node, ring between nodes, all-gather in the node).
    params = args.params or (int(rows[0]["params"]) if rows else 25_000_000)
    if args.compute_s:
        fwd, bwd, opt = args.compute_s / 3, 2 * args.compute_s / 3, 0.0
    elif base_rows:
        b = max(base_rows, key=lambda b: b["batch_per_rank"])
        fwd, bwd, opt = b["forward_s"], b["backward_s"], b["optimizer_s"]
    else:
        fwd, bwd, opt = 0.033, 0.067, 0.0
    link_beta = 8 / (args.link_gbps * 1e9)
    intra_beta = 8 / (args.intra_gbps * 1e9)
    lat = args.latency_us * 1e-6
    g = args.gpus_per_node
    nbytes = 4 * params
    count = max(1, math.ceil(nbytes / (args.bucket_mb * 2**20)))
    sizes = [nbytes / count] * count

    def ring_s(size, total):
        # Flat ring over every rank: 2(N-1) steps, each paced by the slowest (inter-node) link.
        nodes = max(1, total // g)
        b_ = link_beta if nodes > 1 else intra_beta
        return 2 * (total - 1) * lat + 2 * (total - 1) / total * size * b_ if total > 1 else 0.0

    def hier_s(size, total):
        nodes, local = max(1, total // g), min(g, total)
        t = 2 * (local - 1) / local * size * intra_beta if local > 1 else 0.0
        if nodes > 1:
            t += 2 * (nodes - 1) * lat + 2 * (nodes - 1) / nodes * (size / local) * link_beta
        return t

    proj = []
    for total in split_list(args.project_ranks, int):
        row = [total, max(1, total // g)]
        for cost in (ring_s, hier_s):
            t_all = sum(cost(s_, total) for s_ in sizes)
            step, exposed = overlapped_step(fwd, bwd, opt, sizes, lambda s_: cost(s_, total))
            serial = overlapped_step(fwd, bwd, opt, sizes, lambda s_: cost(s_, total), overlap=False)[0]
            row += [f"{1e3 * t_all:.2f}", f"{1e3 * exposed:.2f}", f"{100 * (fwd + bwd + opt) / step:.0f} %",
                    f"{100 * (fwd + bwd + opt) / serial:.0f} %"]
        proj.append(row)
    out.append(f"\n### Projection\n\n{params} parameters (fp32 gradients, {nbytes / 2**20:.1f} MiB in {count} "
               f"bucket(s) of {args.bucket_mb:g} MiB), forward {1e3 * fwd:.2f} ms, backward {1e3 * bwd:.2f} ms, "
               f"optimizer {1e3 * opt:.2f} ms per step, {g} GPUs per node at {args.intra_gbps:g} Gb/s inside a "
               f"node, {args.link_gbps:g} Gb/s and {args.latency_us:g} us between nodes. Efficiency is compute "
               "over predicted step time (calibrated model, with and without overlap):\n\n")
    out.append(markdown_table(["ranks", "nodes", "ring allreduce ms", "ring exposed ms", "ring eff (overlap)",
                               "ring eff (serial)", "hier. allreduce ms", "hier. exposed ms", "hier. eff (overlap)",
                               "hier. eff (serial)"], proj))
    return out


def cmd_model(args):
    levels = load_levels(args)
    out = fit_report(levels)
    check_md, check_err, pick_diff = check_algorithms(args, levels)
    algorithm = choose_algorithm(args, check_err, pick_diff)
    out += check_md
    rows = read_csv(args.results) if args.results else []
    variants, table, recs, errors = predict_rows(rows, levels, algorithm, args.link_burst_ms)
    summary = {}
    if table:
        banked = args.link_burst_ms if "inter-none" in levels else 0  # run_costs needs the unlimited link
        out += variants_text(variants, algorithm, any(r["nodes"] > 1 for r in rows), banked)
        header = ["mode", "model", "ranks"] + (["nodes x ranks", "link"] if emulated(rows) else []) + [
            "batch/rank", "compression", "precision", "measured ms", "measured eff"]
        for v in variants:
            header += [f"{v} ms (error)", f"{v} eff"]
        out.append("\n" + markdown_table(header, table))
        err_md, summary = error_tables(errors, emulated(rows))
        out += err_md
        write_model_csvs(args, recs, summary)
        out += [f"\n![{os.path.basename(p)}]({os.path.basename(p)})\n" for p in plot_model(recs, args.out,
                                                                                           args.plot_prefix)]
    out += projection(args, rows)
    report = os.path.join(args.out, "report.md")
    with open(report, "a") as f:
        f.writelines(out)
    intra = levels["intra"]
    with open(os.path.join(args.out, "model.json"), "w") as f:
        json.dump({"ranks": intra.ranks, "alpha_s": intra.alpha, "beta_s_per_byte": intra.beta,
                   "bandwidth_GBps": 1e-9 / intra.beta, "algorithm": algorithm, "algorithm_errors": check_err,
                   "levels": {n: {"ranks": lv.ranks, "nodes": lv.nodes, "alpha_s": lv.alpha, "beta_s_per_byte": lv.beta,
                                  "bandwidth_GBps": 1e-9 / lv.beta} for n, lv in levels.items()},
                   "link_burst_ms": args.link_burst_ms, "variants": summary}, f, indent=1)
    print("; ".join(f"{n}: alpha {1e6 * lv.alpha:.2f} us, bandwidth {1e-9 / lv.beta:.3f} GB/s"
                    for n, lv in levels.items()) + f"; allreduce model {algorithm}; " +
          "; ".join(f"{v} step error mean {100 * s_['step_mean']:.1f} % max {100 * s_['step_max']:.1f} %"
                    for v, s_ in summary.items()) + f"; appended to {report}")
    return summary


# --------------------------------------------------------------------------- the batch-size sweep
def write_idx(path, array, labels):
    """An idx file (the MNIST format): big-endian magic, dims, then u8 data."""
    import struct
    with open(path, "wb") as f:
        if labels:
            f.write(struct.pack(">II", 0x801, len(array)))
        else:
            f.write(struct.pack(">IIII", 0x803, *array.shape))
        f.write(np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def read_idx_gz(path):
    import gzip
    with gzip.open(path, "rb") as f:
        raw = f.read()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def make_dataset(args, out):
    """OUT/train and OUT/test shards: a subset of Fashion-MNIST, or (--dataset blobs) a small learnable
    synthetic set of noisy class prototypes, written as idx files and converted by `dtrain convert idx`."""
    rng = np.random.default_rng(7)
    splits = {}
    if args.dataset == "fashion-mnist":
        src = args.fashion_dir
        for name, prefix, count in (("train", "train", args.train_samples), ("test", "t10k", args.test_samples)):
            x = read_idx_gz(os.path.join(src, f"{prefix}-images-idx3-ubyte.gz"))[:count]
            y = read_idx_gz(os.path.join(src, f"{prefix}-labels-idx1-ubyte.gz"))[:count]
            splits[name] = (x, y)
    else:
        protos = rng.uniform(0, 255, size=(10, 28, 28))
        for name, count in (("train", args.train_samples), ("test", args.test_samples)):
            y = rng.integers(0, 10, size=count)
            x = np.clip(protos[y] + rng.normal(0, 160, size=(count, 28, 28)), 0, 255)
            splits[name] = (x.astype(np.uint8), y.astype(np.uint8))
    for name, (x, y) in splits.items():
        raw = os.path.join(out, f"{name}-raw")
        os.makedirs(raw, exist_ok=True)
        write_idx(os.path.join(raw, "images"), x, False)
        write_idx(os.path.join(raw, "labels"), y, True)
        cmd = [args.dtrain, "convert", "idx", "--images", os.path.join(raw, "images"), "--labels",
               os.path.join(raw, "labels"), "--num-classes", "10", "--out", os.path.join(out, name)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return os.path.join(out, "train"), os.path.join(out, "test")


def cmd_batch(args):
    """Throughput and time to the target TEST accuracy against the global batch."""
    data_dir = os.path.join(args.out, "batch-data")
    train, test = make_dataset(args, data_dir)
    os.makedirs(os.path.join(args.out, "metrics"), exist_ok=True)
    # One job: dtrain's trainer groups train every batch size one after another on the same ranks
    # (--trainers 1, so each has the machine to itself as its throughput needs), the learning rate
    # scaled linearly from --base-lr at --base-batch by dtrain itself.
    batches = split_list(args.batch_sizes, int)
    sweep_dir = os.path.join(args.out, "metrics", f"batch-n{args.batch_ranks}")
    shutil.rmtree(sweep_dir, ignore_errors=True)
    cmd = launcher(args, args.batch_ranks) + [
        args.dtrain, "train", "--model", args.batch_model, "--data", train, "--test-data", test, "--epochs",
        str(args.epochs), "--sweep", "global-batch-size=" + ",".join(str(b) for b in batches), "--trainers", "1",
        "--lr", f"{args.base_lr:g}", "--lr-scaling", "linear", "--base-batch-size", str(args.base_batch),
        "--target-accuracy", f"{100 * args.target_accuracy:g}", "--sweep-dir", sweep_dir, "--threads",
        str(args.threads), "--progress", "off", "--log-every", "1000000"] + shlex.split(args.train_args)
    print("+ " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=args.timeout * len(batches))
    os.makedirs(sweep_dir, exist_ok=True)
    with open(os.path.join(sweep_dir, "log.txt"), "w") as f:
        f.write(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"sweep failed (status {proc.returncode}):\n{proc.stdout[-3000:]}")
    rows = []
    for i, batch in enumerate(batches):
        evals, summary = [], {}
        with open(os.path.join(sweep_dir, f"trainer-{i}", "metrics.jsonl")) as f:
            for line in f:
                rec = json.loads(line)
                if "summary" in rec:
                    summary = rec
                elif "test_accuracy" in rec:
                    evals.append(rec)
        # Training seconds (evaluation left out) until the first evaluation at or above the target.
        hit = next((e for e in evals if e["test_accuracy"] >= args.target_accuracy), None)
        rows.append({"ranks": args.batch_ranks, "global_batch": batch, "lr": args.base_lr * batch / args.base_batch,
                     "epochs": len(evals), "samples_per_s": summary.get("samples_per_s", 0.0),
                     "best_test_accuracy": max((e["test_accuracy"] for e in evals), default=0.0),
                     "final_test_accuracy": evals[-1]["test_accuracy"] if evals else 0.0,
                     "target_accuracy": args.target_accuracy,
                     "time_to_target_s": round(hit["train_time_s"], 3) if hit else "not reached",
                     "epochs_to_target": hit["epoch"] if hit else "not reached",
                     "train_time_s": evals[-1].get("train_time_s", 0.0) if evals else 0.0})
    with open(os.path.join(args.out, "batch.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    md = [f"\n## Batch-size sweep\n\n`{args.batch_model}` on {args.batch_ranks} rank(s), {args.dataset} "
          f"({args.train_samples} training, {args.test_samples} held-out test samples), {args.epochs} epochs, "
          f"learning rate {args.base_lr:g} x batch / {args.base_batch}. Time to target is training wall time "
          f"(evaluation left out) until the held-out TEST accuracy, evaluated after each epoch, first reaches "
          f"{100 * args.target_accuracy:.0f} %.\n\n"]
    md.append(markdown_table(["global batch", "lr", "samples/s", "best test acc", "final test acc",
                              "time to target s", "epochs to target"],
                             [[r["global_batch"], f"{r['lr']:g}", f"{r['samples_per_s']:.0f}",
                               f"{100 * r['best_test_accuracy']:.1f} %", f"{100 * r['final_test_accuracy']:.1f} %",
                               r["time_to_target_s"], r["epochs_to_target"]] for r in rows]))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax1 = plt.subplots(figsize=(6, 4))
        xs = [r["global_batch"] for r in rows]
        ax1.plot(xs, [r["samples_per_s"] for r in rows], "o-", color="tab:blue")
        ax1.set_xscale("log", base=2)
        ax1.set_xlabel("global batch")
        ax1.set_ylabel("samples/s", color="tab:blue")
        ax2 = ax1.twinx()
        reached = [(r["global_batch"], r["time_to_target_s"]) for r in rows if r["time_to_target_s"] != "not reached"]
        if reached:
            ax2.plot(*zip(*reached), "s--", color="tab:red")
        ax2.set_ylabel(f"s to {100 * args.target_accuracy:.0f} % test accuracy", color="tab:red")
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "batch_tta.png"), dpi=100)
        plt.close(fig)
        md.append("\n![batch_tta.png](batch_tta.png)\n")
    except ImportError:
        pass
    with open(os.path.join(args.out, "report.md"), "a") as f:
        f.writelines(md)
    print("batch sweep: " + ", ".join(f"b{r['global_batch']}: {r['time_to_target_s']}" for r in rows))
    return rows


def cmd_all(args):
    """The whole study: rank sweep, performance model, batch-size sweep; report.md copied to RESULTS.md."""
    t0 = time.time()
    cmd_sweep(args)
    args.results = os.path.join(args.out, "results.csv")
    cmd_model(args)
    args.batch_sizes = args.batch_batch_sizes
    if args.batch_sizes and not args.emulate_nodes:  # the batch-size sweep runs on this host only
        cmd_batch(args)
    with open(os.path.join(args.out, "report.md")) as f:
        text = f.read()
    cmdline = " ".join(shlex.quote(a) for a in sys.argv)
    with open(os.path.join(args.out, "RESULTS.md"), "w") as f:
        f.write(text + f"\n---\nProduced by `{cmdline}` in {time.time() - t0:.0f} s.\n")
    print(f"wrote {args.out}/RESULTS.md")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dtrain", default=os.environ.get("DTRAIN_BIN", "build/dtrain"), help="the dtrain executable")
    common.add_argument("--out", default="runs/scaling", help="output folder")
    common.add_argument("--launcher", choices=["mpirun", "srun", "none"], default="mpirun")
    common.add_argument("--launcher-args", default=os.environ.get("DTRAIN_LAUNCHER_ARGS", "--bind-to none"),
                        help="extra mpirun/srun options (e.g. '--oversubscribe --bind-to none')")
    common.add_argument("--srun-mpi", default="pmix", help="srun --mpi plugin")
    common.add_argument("--emulate-nodes", type=int, default=0,
                        help="run the sweep and its benchmarks on an emulated cluster of this many nodes "
                             "(cluster/emulate, root; started and stopped here)")
    common.add_argument("--link-rates", default="1gbit,10gbit",
                        help="with --emulate-nodes: the nodes' link rates to sweep (tc units; 'local': every rank "
                             "on one node)")
    common.add_argument("--link-burst-ms", type=int, default=10,
                        help="the emulated links' token bucket, in ms of traffic at the rate (tc tbf's burst: set on "
                             "the cluster and used by the model)")
    common.add_argument("--emulate-dir", default="", help="the emulated cluster's state folder (default OUT/emu)")
    common.add_argument("--plot-prefix", default="", help="prefix of the plot files' names")
    bench_opts = argparse.ArgumentParser(add_help=False)
    bench_opts.add_argument("--bench-ranks", type=int, default=2)
    bench_opts.add_argument("--bench-max-bytes", default="64M")
    bench_opts.add_argument("--bench-iters", type=int, default=30, help="timed iterations per size")
    bench_opts.add_argument("--check-algorithms", default="ring,rabenseifner",
                            help="emulated cluster: also benchmark the most ranks with these Open MPI allreduce "
                                 "algorithms forced (ring, rabenseifner; '' for none)")
    sweep_opts = argparse.ArgumentParser(add_help=False)
    sweep_opts.add_argument("--ranks", default="1,2,4")
    sweep_opts.add_argument("--mode", default="strong", help="strong, weak or both (comma list)")
    sweep_opts.add_argument("--models", default="mlp")
    sweep_opts.add_argument("--batch-sizes", default="256", help="global (strong) or per-rank (weak) batches, comma list")
    sweep_opts.add_argument("--compression", default="none", help="comma list of --compression values")
    sweep_opts.add_argument("--precision", default="fp32", help="comma list of fp32, bf16, fp16")
    sweep_opts.add_argument("--steps", type=int, default=200)
    sweep_opts.add_argument("--log-every", type=int, default=20)
    sweep_opts.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    sweep_opts.add_argument("--bucket-mb", type=float, default=0.25, help="data-parallel gradient bucket size (MiB)")
    sweep_opts.add_argument("--train-args", default="", help="more `dtrain train` options")
    sweep_opts.add_argument("--overlap-model", default="",
                            help="also weak-scale this model (e.g. resnet20) in small buckets, to check the model's overlap")
    sweep_opts.add_argument("--overlap-batch", type=int, default=32, help="per-rank batch of the --overlap-model runs")
    sweep_opts.add_argument("--overlap-steps", type=int, default=100)
    sweep_opts.add_argument("--overlap-bucket-mb", type=float, default=0.125)
    sweep_opts.add_argument("--no-alone", action="store_true",
                            help="skip the independent 1-rank runs beside each multi-rank run (no 'contended' model)")
    sweep_opts.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    model_opts = argparse.ArgumentParser(add_help=False)
    model_opts.add_argument("--bench", help="saved `dtrain bench allreduce` output (else it is run)")
    model_opts.add_argument("--allreduce-model", choices=["auto"] + list(ALGORITHMS), default="auto",
                            help="how an allreduce across nodes is costed (auto: what the check benchmarks fit "
                                 "best; a ring without them)")
    model_opts.add_argument("--check-min-bytes", type=int, default=65536,
                            help="smallest size the algorithm check counts (gradient buckets are larger)")
    model_opts.add_argument("--params", type=int, default=0, help="parameters of the projected model (default: measured)")
    model_opts.add_argument("--compute-s", type=float, default=0.0, help="forward+backward per step for the projection")
    model_opts.add_argument("--project-ranks", default="8,64,256,1024")
    model_opts.add_argument("--gpus-per-node", type=int, default=8)
    model_opts.add_argument("--link-gbps", type=float, default=200.0, help="bandwidth between nodes, Gb/s")
    model_opts.add_argument("--intra-gbps", type=float, default=2400.0, help="bandwidth inside a node, Gb/s")
    model_opts.add_argument("--latency-us", type=float, default=5.0)
    batch_opts = argparse.ArgumentParser(add_help=False)
    batch_opts.add_argument("--dataset", choices=["fashion-mnist", "blobs"], default="fashion-mnist")
    batch_opts.add_argument("--fashion-dir", default="/usr/share/datasets/fashion-mnist")
    batch_opts.add_argument("--train-samples", type=int, default=8192)
    batch_opts.add_argument("--test-samples", type=int, default=2000)
    batch_opts.add_argument("--batch-model", default="mlp")
    batch_opts.add_argument("--batch-ranks", type=int, default=2)
    batch_opts.add_argument("--epochs", type=int, default=4)
    batch_opts.add_argument("--base-lr", type=float, default=0.05)
    batch_opts.add_argument("--base-batch", type=int, default=64)
    batch_opts.add_argument("--target-accuracy", type=float, default=0.80, help="held-out test accuracy to reach")
    s = sub.add_parser("sweep", parents=[common, sweep_opts, bench_opts], help="run the rank sweep and write the report")
    m = sub.add_parser("model", parents=[common, model_opts, bench_opts], help="fit the alpha-beta model, predict, project")
    m.add_argument("--results", help="results.csv of a sweep (else only the fit and the projection)")
    m.add_argument("--bucket-mb", type=float, default=0.25, help="bucket size for the projection (MiB)")
    b = sub.add_parser("batch", parents=[common, batch_opts], help="batch-size sweep: throughput, time to test accuracy")
    b.add_argument("--batch-sizes", default="32,128,512")
    b.add_argument("--threads", type=int, default=1)
    b.add_argument("--train-args", default="")
    b.add_argument("--timeout", type=float, default=1800)
    a = sub.add_parser("all", parents=[common, sweep_opts, model_opts, bench_opts, batch_opts],
                       help="the complete study (sweep, model, batch sweep) into OUT/RESULTS.md")
    a.add_argument("--batch-batch-sizes", default="32,128,512", help="global batches of the batch-size sweep")
    a.set_defaults(ranks="1,2", mode="strong,weak", batch_sizes="64,256", steps=600, log_every=50, bench_max_bytes="4M",
                   overlap_model="resnet20")
    args = p.parse_args()
    args.dtrain = os.path.abspath(args.dtrain)
    args.out = os.path.abspath(args.out)
    args.emu_nodes, args.link_rate = [], ""
    os.makedirs(args.out, exist_ok=True)
    {"sweep": cmd_sweep, "model": cmd_model, "batch": cmd_batch, "all": cmd_all}[args.cmd](args)


if __name__ == "__main__":
    main()
