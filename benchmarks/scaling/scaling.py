#!/usr/bin/python3
"""Scaling study for dtrain: sweeps, a report, and an overlap-aware performance model.

  scaling.py all   --dtrain build/dtrain --out runs/scaling      # the whole study, ~10 min, RESULTS.md
  scaling.py sweep --dtrain build/dtrain --ranks 1,2,4 --mode strong,weak --out runs/scaling
  scaling.py model --dtrain build/dtrain --results runs/scaling/results.csv --out runs/scaling
  scaling.py batch --dtrain build/dtrain --batch-sizes 32,128,512 --out runs/scaling

`sweep` runs `dtrain train --synthetic` for every combination of ranks, mode, model, batch size,
compressor and precision, through mpirun or srun, reads each run's JSON-lines metrics (step time and
its split into forward, backward, optimizer, communication wait, data wait; the slowest rank's
compute; the gradient bucket count) and writes results.csv, report.md and (with matplotlib)
speedup.png, efficiency.png, breakdown.png. Strong scaling keeps the global batch (--batch-sizes are
global); weak scaling keeps the per-rank batch (--batch-sizes are per rank).

Beside each multi-rank run the sweep starts as many independent 1-rank runs at once (no
communication), which measures the compute a rank gets when the node is shared that way.

`model` fits t(S) = alpha + beta * S * 2(n-1)/n to `dtrain bench allreduce` and keeps the measured
curve too, and predicts every multi-rank step as compute + the allreduce time of the gradient
buckets not hidden behind backward (bucket i can start once backward has produced its share) +
optimizer + unnamed host work + data wait, in variants (serial, calibrated, contended, slowest;
see VARIANTS), reports each variant's error on step time and
efficiency (report.md, model.csv, model.json), and projects to larger clusters (flat ring against
hierarchical allreduce) for a given link bandwidth, latency and GPUs per node.

`batch` trains on a held-out split (a Fashion-MNIST subset, or --dataset blobs) for each global
batch and reports throughput and the training time (evaluation left out) until the TEST accuracy
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
import subprocess
import sys
import time

import numpy as np

FIELDS = ["mode", "model", "ranks", "batch_per_rank", "global_batch", "compression", "precision",
          "params", "samples_per_s", "step_time_s", "compute_s", "comm_wait_s", "data_wait_s",
          "forward_s", "backward_s", "optimizer_s", "other_s", "compute_max_s", "bucket_count", "bucket_mb",
          "bytes_sent_per_step", "alone_forward_s", "alone_backward_s", "alone_optimizer_s", "alone_other_s",
          "final_train_accuracy", "speedup", "efficiency", "wall_s"]
TEXT_FIELDS = ("mode", "model", "compression", "precision")


def split_list(text, conv=str):
    return [conv(x) for x in text.split(",") if x.strip()]


def launcher(args, ranks):
    """The command prefix that starts `ranks` processes."""
    if args.launcher == "srun":
        return ["srun", "-n", str(ranks), "--mpi=" + args.srun_mpi] + shlex.split(args.launcher_args)
    if args.launcher == "mpirun":
        return ["mpirun", "-n", str(ranks)] + shlex.split(args.launcher_args)
    if ranks != 1:
        raise SystemExit("--launcher none runs 1 rank only")
    return []


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
        metrics = os.path.join(args.out, "metrics", f"run{index:03d}-alone{j}-{model}-b{per_rank}.jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)
        cmd = launcher(args, 1) + train_cmd(args, model, ["--batch-size", str(per_rank)], compression, precision,
                                            metrics)
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


def run_one(args, mode, model, ranks, batch, compression, precision, index):
    """One training run; returns a result row (a dict of FIELDS)."""
    if mode == "strong":
        if batch % ranks:
            print(f"skip: global batch {batch} does not split over {ranks} ranks", file=sys.stderr)
            return None
        per_rank, batch_opt = batch // ranks, ["--global-batch-size", str(batch)]
    else:
        per_rank, batch_opt = batch, ["--batch-size", str(batch)]
    metrics = os.path.join(args.out, "metrics", f"run{index:03d}-{mode}-{model}-n{ranks}-b{batch}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = launcher(args, ranks) + train_cmd(args, model, batch_opt, compression, precision, metrics)
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
    if ranks > 1 and not getattr(args, "no_alone", False):
        row.update(run_alone(args, model, ranks, per_rank, compression, precision, index))
    return row


def group_key(r):
    base = r["global_batch"] if r["mode"] == "strong" else r["batch_per_rank"]
    return (r["mode"], r["model"], int(base), r["compression"], r["precision"])


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
    return rows


def markdown_table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" ---: " for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def results_markdown(rows):
    header = ["mode", "model", "ranks", "batch/rank", "global batch", "compression", "precision", "samples/s",
              "step ms", "compute ms", "comm wait ms", "data wait ms", "speedup", "efficiency"]
    body = [[r["mode"], r["model"], r["ranks"], int(r["batch_per_rank"]), int(r["global_batch"]), r["compression"],
             r["precision"], f"{float(r['samples_per_s']):.0f}", f"{1e3 * float(r['step_time_s']):.2f}",
             f"{1e3 * float(r['compute_s']):.2f}", f"{1e3 * float(r['comm_wait_s']):.2f}",
             f"{1e3 * float(r['data_wait_s']):.2f}", f"{float(r['speedup']):.2f}", f"{100 * float(r['efficiency']):.0f} %"]
            for r in rows]
    return markdown_table(header, body)


def plot(rows, groups, out):
    """speedup.png, efficiency.png, breakdown.png, batch.png; returns the files written."""
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
        path = os.path.join(out, what + ".png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        files.append(path)
    # Time breakdown: one stacked bar per run.
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(rows)), 4))
    labels = [f"{r['mode'][0]} {r['model']} n{r['ranks']} b{int(r['global_batch'])} {r['compression']} {r['precision']}"
              for r in rows]
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
    path = os.path.join(out, "breakdown.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    files.append(path)
    # Batch-size sweep: throughput against the global batch, one line per rank count.
    if len({r["global_batch"] for r in rows}) > 1:
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


def cmd_sweep(args):
    os.makedirs(os.path.join(args.out, "metrics"), exist_ok=True)
    rows = []
    combos = itertools.product(split_list(args.mode), split_list(args.models), split_list(args.batch_sizes, int),
                               split_list(args.compression), split_list(args.precision), split_list(args.ranks, int))
    for i, (mode, model, batch, comp, prec, ranks) in enumerate(combos):
        if mode not in ("strong", "weak"):
            raise SystemExit(f"--mode: '{mode}' is not strong or weak")
        row = run_one(args, mode, model, ranks, batch, comp, prec, i)
        if row:
            rows.append(row)
    if args.overlap_model:
        # A model with many gradient buckets, weak scaling over the same ranks: the runs where
        # buckets go out while backward still runs, so the model's overlap is checked against them.
        o = argparse.Namespace(**vars(args))
        o.steps, o.bucket_mb, o.log_every = args.overlap_steps, args.overlap_bucket_mb, max(1, args.overlap_steps // 5)
        for j, ranks in enumerate(split_list(args.ranks, int)):
            row = run_one(o, "weak", args.overlap_model, ranks, args.overlap_batch, "none", "fp32", 900 + j)
            if row:
                rows.append(row)
    if not rows:
        raise SystemExit("no run in the sweep")
    groups = add_speedup(rows)
    write_csv(rows, os.path.join(args.out, "results.csv"))
    plots = plot(rows, groups, args.out)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write("# dtrain scaling study\n\n")
        f.write(f"Launcher `{args.launcher}`, {args.steps} steps per run, synthetic data, {args.threads} thread(s) "
                "per rank. Step times leave out the first logged interval (start-up). Speedup and efficiency "
                "are throughput against the fewest ranks of the same mode, model, batch, compressor and "
                "precision; weak scaling keeps the per-rank batch, strong scaling the global batch.\n\n")
        f.write(results_markdown(rows))
        for p in plots:
            f.write(f"\n![{os.path.basename(p)}]({os.path.basename(p)})\n")
    print(f"wrote {args.out}/results.csv, report.md" + (", " + ", ".join(map(os.path.basename, plots)) if plots else ""))


# ----------------------------------------------------------------------------------- the model
def parse_bench(text):
    """(ranks, [(bytes, seconds)]) from `dtrain bench allreduce` output: dtrain rows, f32, sum."""
    m = re.search(r"bench allreduce: (\d+) ranks", text)
    if not m:
        raise SystemExit("not `dtrain bench allreduce` output (no '<n> ranks' header)")
    pts = []
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 6 and f[0].isdigit() and f[4] == "dtrain":
            pts.append((int(f[0]), float(f[5]) * 1e-6))
    if len(pts) < 2:
        raise SystemExit("fewer than 2 allreduce rows to fit")
    return int(m.group(1)), pts


def fit_alpha_beta(n, pts):
    """Least squares t = alpha + beta * S * 2(n-1)/n, with weights 1/t so small messages count too."""
    s = np.array([p[0] for p in pts], dtype=float) * 2 * (n - 1) / n
    t = np.array([p[1] for p in pts])
    w = 1.0 / t
    a = np.stack([np.ones_like(s), s], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(a, t * w, rcond=None)
    return max(alpha, 0.0), max(beta, 1e-15)


def ring_allreduce_s(nbytes, n, alpha, beta):
    """The fitted model at n ranks (alpha as measured: on one node it hardly depends on n)."""
    return 0.0 if n <= 1 else alpha + beta * nbytes * 2 * (n - 1) / n


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


def bucket_sizes(r):
    """Gradient bucket sizes in bytes, in the order backward produces them. The trainer reports the
    bucket count; the gradient is split evenly into that many (the last layers fill the first)."""
    ranks = int(r["ranks"])
    ring = 2 * (ranks - 1) / ranks if ranks > 1 else 1.0
    total = r["bytes_sent_per_step"] / ring if r["bytes_sent_per_step"] > 0 else 4.0 * r["params"]
    count = int(r.get("bucket_count") or 0) or max(1, math.ceil(total / (float(r.get("bucket_mb") or 25) * 2**20)))
    return [total / count] * count


def overlapped_step(fwd, bwd, opt, sizes, allreduce_s, overlap=True):
    """Step time and exposed communication when bucket i (sizes in backward order) becomes ready once
    backward has produced its share of the gradient, and buckets go out one after another."""
    total = sum(sizes) or 1.0
    done, end = 0.0, 0.0
    for size in sizes:
        done += size
        ready = fwd + (bwd * done / total if overlap else bwd)
        end = max(end, ready) + allreduce_s(size)
    exposed = max(0.0, end - (fwd + bwd))
    return fwd + bwd + exposed + opt, exposed


def single_rank_compute(r, base_rows):
    """(forward, backward, optimizer, other) per step of the 1-rank run of the same config: the same
    per-rank batch where such a run exists, else the group's base run scaled by the per-rank batch."""
    same = [b for b in base_rows if b["model"] == r["model"] and b["compression"] == r["compression"] and
            b["precision"] == r["precision"]]
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
    "serial": "1-rank compute, then every bucket's allreduce (alpha-beta fit) after backward: no overlap",
    "calibrated": "1-rank compute; buckets allreduced (alpha-beta fit) as backward produces them",
    "contended": "compute measured in as many independent 1-rank runs at once as the run has ranks (the node "
                 "shared the same way, no communication); buckets at the benchmark's measured allreduce time, "
                 "overlapped with backward. Predicts from measurements that do not include the run itself",
    "slowest": "diagnostic: compute of the slowest rank of the multi-rank run itself, split into forward and "
               "backward as at 1 rank; allreduce and overlap as in contended, so its error is the "
               "communication model's alone",
}


def predict(r, base_rows, fitted_s, measured_s):
    """{variant: predicted step seconds} for one measured multi-rank run. fitted_s and measured_s
    give an allreduce's seconds for a bucket size: the alpha-beta line and the benchmark's curve."""
    comp = single_rank_compute(r, base_rows)
    if comp is None:
        return {}
    fwd, bwd, opt, other = comp
    sizes = bucket_sizes(r)
    extra = other + r["data_wait_s"]
    out = {"serial": overlapped_step(fwd, bwd, opt, sizes, fitted_s, overlap=False)[0] + extra,
           "calibrated": overlapped_step(fwd, bwd, opt, sizes, fitted_s)[0] + extra}
    if r.get("alone_forward_s"):
        out["contended"] = overlapped_step(r["alone_forward_s"], r["alone_backward_s"], r["alone_optimizer_s"],
                                           sizes, measured_s)[0] + r["alone_other_s"] + r["data_wait_s"]
        other = r["alone_other_s"]
    slow = r.get("compute_max_s") or 0.0
    if slow > 0:
        share = fwd / max(fwd + bwd, 1e-12)
        out["slowest"] = overlapped_step(slow * share, slow * (1 - share), r["optimizer_s"] or opt, sizes,
                                         measured_s)[0] + other + r["data_wait_s"]
    return out


def cmd_model(args):
    if args.bench:
        text = open(args.bench).read()
    else:
        cmd = launcher(args, args.bench_ranks) + [args.dtrain, "bench", "allreduce", "-b", "4", "-e", args.bench_max_bytes,
                                                  "-f", "4", "-n", "30", "--no-baseline"]
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
        text = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=True).stdout
        with open(os.path.join(args.out, "allreduce.txt"), "w") as f:
            f.write(text)
    n, pts = parse_bench(text)
    alpha, beta = fit_alpha_beta(n, pts)
    out = [f"\n## Performance model\n\nAlpha-beta fit to `dtrain bench allreduce` on {n} ranks "
           f"({len(pts)} sizes, {pts[0][0]} B to {pts[-1][0]} B): t(S) = alpha + beta * S * 2(n-1)/n with "
           f"alpha = {1e6 * alpha:.2f} us, 1/beta = {1e-9 / beta:.3f} GB/s.\n\n"]
    fit_rows = [[p[0], f"{1e6 * p[1]:.1f}", f"{1e6 * (alpha + beta * p[0] * 2 * (n - 1) / n):.1f}"] for p in pts]
    out.append(markdown_table(["bytes", "measured us", "model us"], fit_rows))

    rows = read_csv(args.results) if args.results else []
    errors = {v: {"step": [], "eff": []} for v in VARIANTS}
    pred_rows = []
    base_rows = [r for r in rows if r["ranks"] == 1]
    table = []
    for r in rows:
        if r["ranks"] <= 1:
            continue
        ranks = r["ranks"]
        # The measured curve is at the benchmark's rank count; other counts scale it by the ring's
        # bytes per rank, 2(N-1)/N.
        ring_ratio = ((ranks - 1) / ranks) / ((n - 1) / n)
        preds = predict(r, base_rows, lambda size: ring_allreduce_s(size, ranks, alpha, beta),
                        lambda size, c=measured_allreduce_s(pts, beta * 2 * (n - 1) / n): ring_ratio * c(size))
        if not preds:
            continue
        # Efficiency as measured: throughput against the 1-rank run of the group, per rank.
        base = [b for b in base_rows if group_key(b) == group_key(r)]
        line = [r["mode"], r["model"], ranks, int(r["batch_per_rank"]), r["compression"], r["precision"],
                f"{1e3 * r['step_time_s']:.2f}", f"{100 * r['efficiency']:.0f} %"]
        rec = {"mode": r["mode"], "model": r["model"], "ranks": ranks, "batch_per_rank": int(r["batch_per_rank"]),
               "compression": r["compression"], "precision": r["precision"], "measured_step_s": r["step_time_s"],
               "measured_efficiency": r["efficiency"]}
        for v in VARIANTS:
            if v not in preds:
                line += ["", ""]
                continue
            t = preds[v]
            err = (t - r["step_time_s"]) / r["step_time_s"]
            errors[v]["step"].append(abs(err))
            eff = ""
            if base:
                eff = (r["global_batch"] / t) / (base[0]["samples_per_s"] * ranks)
                errors[v]["eff"].append(abs(eff - r["efficiency"]) / max(r["efficiency"], 1e-9))
            rec[v + "_step_s"], rec[v + "_step_error"], rec[v + "_efficiency"] = t, err, eff
            line += [f"{1e3 * t:.2f} ({100 * err:+.0f} %)", f"{100 * eff:.0f} %" if eff != "" else ""]
        table.append(line)
        pred_rows.append(rec)
    summary = {}
    if table:
        out.append("\nModel variants. Each predicts step time = compute (forward + backward) + the part of the "
                   "gradient allreduce not hidden behind backward + optimizer step + the host work the split "
                   "does not name (measured where the compute comes from) + measured data wait. The gradient "
                   "travels in buckets (count from the run's metrics); bucket i is ready once backward has "
                   "produced its share of the gradient (ready times spread in proportion through backward), "
                   "buckets go out one after another, each costing the allreduce time of its size.\n\n")
        out += [f"- **{v}**: {d}\n" for v, d in VARIANTS.items()]
        header = ["mode", "model", "ranks", "batch/rank", "compression", "precision", "measured ms", "measured eff"]
        for v in VARIANTS:
            header += [f"{v} ms (error)", f"{v} eff"]
        out.append("\n" + markdown_table(header, table))
        out.append("\n### Model error\n\nRelative error against the measured multi-rank points (absolute values):\n\n")
        err_rows = []
        for v in VARIANTS:
            e = errors[v]
            if not e["step"]:
                continue
            summary[v] = {"step_mean": float(np.mean(e["step"])), "step_max": float(np.max(e["step"])),
                          "eff_mean": float(np.mean(e["eff"])) if e["eff"] else None,
                          "eff_max": float(np.max(e["eff"])) if e["eff"] else None, "points": len(e["step"])}
            s_ = summary[v]
            err_rows.append([v, s_["points"], f"{100 * s_['step_mean']:.1f} %", f"{100 * s_['step_max']:.1f} %",
                             f"{100 * s_['eff_mean']:.1f} %" if s_["eff_mean"] is not None else "",
                             f"{100 * s_['eff_max']:.1f} %" if s_["eff_max"] is not None else ""])
        out.append(markdown_table(["variant", "points", "step time mean", "step time max", "efficiency mean",
                                   "efficiency max"], err_rows))
        with open(os.path.join(args.out, "model.csv"), "w", newline="") as f:
            keys = list(pred_rows[0].keys())
            for rec in pred_rows[1:]:
                keys += [k for k in rec if k not in keys]
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(pred_rows)
        with open(os.path.join(args.out, "model_errors.csv"), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["variant", "points", "step_error_mean", "step_error_max", "efficiency_error_mean",
                        "efficiency_error_max"])
            for v, s_ in summary.items():
                w.writerow([v, s_["points"], s_["step_mean"], s_["step_max"], s_["eff_mean"], s_["eff_max"]])

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
    report = os.path.join(args.out, "report.md")
    with open(report, "a") as f:
        f.writelines(out)
    with open(os.path.join(args.out, "model.json"), "w") as f:
        json.dump({"ranks": n, "alpha_s": alpha, "beta_s_per_byte": beta, "bandwidth_GBps": 1e-9 / beta,
                   "variants": summary}, f, indent=1)
    print(f"alpha {1e6 * alpha:.2f} us, bandwidth {1e-9 / beta:.3f} GB/s; " +
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
    rows = []
    for batch in split_list(args.batch_sizes, int):
        metrics = os.path.join(args.out, "metrics", f"batch-n{args.batch_ranks}-b{batch}.jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)
        # The learning rate grows with the batch (linear scaling from --base-lr at --base-batch).
        lr = args.base_lr * batch / args.base_batch
        cmd = launcher(args, args.batch_ranks) + [
            args.dtrain, "train", "--model", args.batch_model, "--data", train, "--test-data", test, "--epochs",
            str(args.epochs), "--global-batch-size", str(batch), "--lr", f"{lr:g}", "--threads", str(args.threads),
            "--progress", "off", "--log-every", "1000000", "--metrics", metrics] + shlex.split(args.train_args)
        print("+ " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=args.timeout)
        with open(metrics + ".log", "w") as f:
            f.write(proc.stdout)
        if proc.returncode != 0:
            raise SystemExit(f"run failed (status {proc.returncode}):\n{proc.stdout[-3000:]}")
        evals, summary = [], {}
        with open(metrics) as f:
            for line in f:
                rec = json.loads(line)
                if "summary" in rec:
                    summary = rec
                elif "test_accuracy" in rec:
                    evals.append(rec)
        # Training seconds (evaluation left out) until the first evaluation at or above the target.
        hit = next((e for e in evals if e["test_accuracy"] >= args.target_accuracy), None)
        rows.append({"ranks": args.batch_ranks, "global_batch": batch, "lr": lr, "epochs": len(evals),
                     "samples_per_s": summary.get("samples_per_s", 0.0),
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
    model_opts.add_argument("--bench-ranks", type=int, default=2)
    model_opts.add_argument("--bench-max-bytes", default="64M")
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
    s = sub.add_parser("sweep", parents=[common, sweep_opts], help="run the rank sweep and write the report")
    m = sub.add_parser("model", parents=[common, model_opts], help="fit the alpha-beta model, predict, project")
    m.add_argument("--results", help="results.csv of a sweep (else only the fit and the projection)")
    m.add_argument("--bucket-mb", type=float, default=0.25, help="bucket size for the projection (MiB)")
    b = sub.add_parser("batch", parents=[common, batch_opts], help="batch-size sweep: throughput, time to test accuracy")
    b.add_argument("--batch-sizes", default="32,128,512")
    b.add_argument("--threads", type=int, default=1)
    b.add_argument("--train-args", default="")
    b.add_argument("--timeout", type=float, default=1800)
    a = sub.add_parser("all", parents=[common, sweep_opts, model_opts, batch_opts],
                       help="the complete study (sweep, model, batch sweep) into OUT/RESULTS.md")
    a.add_argument("--batch-batch-sizes", default="32,128,512", help="global batches of the batch-size sweep")
    a.set_defaults(ranks="1,2", mode="strong,weak", batch_sizes="64,256", steps=600, log_every=50, bench_max_bytes="4M",
                   overlap_model="resnet20")
    args = p.parse_args()
    args.dtrain = os.path.abspath(args.dtrain)
    os.makedirs(args.out, exist_ok=True)
    {"sweep": cmd_sweep, "model": cmd_model, "batch": cmd_batch, "all": cmd_all}[args.cmd](args)


if __name__ == "__main__":
    main()
