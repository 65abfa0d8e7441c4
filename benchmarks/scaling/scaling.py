#!/usr/bin/python3
"""Scaling study for dtrain: sweeps, a report, and an alpha-beta performance model.

  scaling.py sweep --dtrain build/dtrain --ranks 1,2,4 --mode strong,weak --out runs/scaling
  scaling.py model --dtrain build/dtrain --results runs/scaling/results.csv --out runs/scaling

`sweep` runs `dtrain train --synthetic` for every combination of ranks, mode, model, batch size,
compressor and precision, through mpirun or srun, reads each run's JSON-lines metrics and writes
results.csv, report.md and (with matplotlib) speedup.png, efficiency.png, breakdown.png and
batch.png. Strong scaling keeps the global batch (--batch-sizes are global); weak scaling keeps the
per-rank batch (--batch-sizes are per rank).

`model` fits t(S) = alpha + beta * S * 2(n-1)/n to `dtrain bench allreduce` (ring allreduce of S
bytes on n ranks), predicts every measured step time as compute + data wait + allreduce of the
gradient bytes, reports its error, and projects efficiency to larger clusters for a given link
bandwidth, latency and GPUs per node. It appends its tables to report.md.

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
          "bytes_sent_per_step", "final_train_accuracy", "time_to_target_s", "speedup", "efficiency", "wall_s"]


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
    cmd = launcher(args, ranks) + [args.dtrain, "train", "--synthetic", "--model", model, "--steps", str(args.steps),
                                   "--log-every", str(args.log_every), "--progress", "off", "--metrics", metrics,
                                   "--compression", compression, "--precision", precision, "--threads",
                                   str(args.threads)] + batch_opt + shlex.split(args.train_args)
    print("+ " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr, flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=args.timeout)
    wall = time.time() - t0
    with open(metrics + ".log", "w") as f:
        f.write(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"run failed (status {proc.returncode}):\n{proc.stdout[-3000:]}")
    steps, summary = read_metrics(metrics)
    # The first logged interval holds start-up (first allocations, thread pools): leave it out.
    steady = steps[1:] if len(steps) > 1 else steps
    if not steady:
        raise SystemExit(f"no step metrics in {metrics}")

    def mean(key):
        return float(np.mean([s.get(key, 0.0) for s in steady]))

    m = re.search(r"\((\d+) parameters\)", proc.stdout)
    step_time = mean("step_time_s")
    comm, data = mean("comm_wait_s"), mean("data_wait_s")
    # Time to the target training accuracy: the summed step time up to the first logged step at it.
    to_target, elapsed, last_step = "", 0.0, 0
    for s in steps:
        elapsed += s["step_time_s"] * (s["step"] - last_step)
        last_step = s["step"]
        if args.target_accuracy > 0 and s.get("train_accuracy", 0) >= args.target_accuracy:
            to_target = round(elapsed, 4)
            break
    return {"mode": mode, "model": model, "ranks": ranks, "batch_per_rank": per_rank, "global_batch": per_rank * ranks,
            "compression": compression, "precision": precision, "params": int(m.group(1)) if m else 0,
            "samples_per_s": summary.get("samples_per_s") or mean("samples_per_s"), "step_time_s": step_time,
            "compute_s": max(step_time - comm - data, 0.0), "comm_wait_s": comm, "data_wait_s": data,
            "bytes_sent_per_step": mean("bytes_sent_per_step"), "final_train_accuracy": steps[-1].get("train_accuracy", 0),
            "time_to_target_s": to_target, "wall_s": round(wall, 2)}


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
            if k in ("mode", "model", "compression", "precision", "time_to_target_s"):
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
        if args.target_accuracy > 0:
            f.write(f"\nTime to {100 * args.target_accuracy:.0f} % training accuracy (s): " +
                    ", ".join(f"n{r['ranks']} b{r['global_batch']}: {r['time_to_target_s'] or 'not reached'}"
                              for r in rows) + "\n")
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


def cmd_model(args):
    if args.bench:
        text = open(args.bench).read()
    else:
        cmd = launcher(args, args.bench_ranks) + [args.dtrain, "bench", "allreduce", "-b", "4", "-e", args.bench_max_bytes,
                                                  "-f", "4", "-n", "10", "--no-baseline"]
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
        text = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=True).stdout
        with open(os.path.join(args.out, "allreduce.txt"), "w") as f:
            f.write(text)
    n, pts = parse_bench(text)
    alpha, beta = fit_alpha_beta(n, pts)
    out = [f"\n## Performance model\n\nAlpha-beta fit to `dtrain bench allreduce` on {n} ranks "
           f"({len(pts)} sizes, {pts[0][0]} B to {pts[-1][0]} B): t(S) = {1e6 * alpha:.2f} us + S * 2(n-1)/n / "
           f"{1e-9 / beta:.2f} GB/s.\n\n"]
    fit_rows = [[p[0], f"{1e6 * p[1]:.1f}", f"{1e6 * (alpha + beta * p[0] * 2 * (n - 1) / n):.1f}"] for p in pts]
    out.append(markdown_table(["bytes", "measured us", "model us"], fit_rows))

    rows = read_csv(args.results) if args.results else []
    errors = []
    if rows:
        # Compute per step at one rank for the same per-rank batch; a step is predicted as that plus
        # the measured data wait plus the allreduce of the gradient (no overlap: an upper bound).
        compute = {}
        for r in rows:
            key = (r["model"], int(r["batch_per_rank"]), r["compression"], r["precision"])
            if r["ranks"] == min(x["ranks"] for x in rows) and key not in compute:
                compute[key] = r["compute_s"]
        table = []
        for r in rows:
            key = (r["model"], int(r["batch_per_rank"]), r["compression"], r["precision"])
            if key not in compute:
                continue
            n_r = r["ranks"]
            ring = 2 * (n_r - 1) / n_r if n_r > 1 else 1
            nbytes = r["bytes_sent_per_step"] / ring if r["bytes_sent_per_step"] > 0 else 4 * r["params"]
            pred = compute[key] + r["data_wait_s"] + ring_allreduce_s(nbytes, n_r, alpha, beta)
            err = (pred - r["step_time_s"]) / r["step_time_s"]
            errors.append(abs(err))
            table.append([r["mode"], r["model"], n_r, int(r["batch_per_rank"]), r["compression"], r["precision"],
                          f"{1e3 * r['step_time_s']:.2f}", f"{1e3 * pred:.2f}", f"{100 * err:+.0f} %"])
        out.append("\nPredicted step time = compute at the fewest ranks + data wait + allreduce of the gradient "
                   "bytes (no overlap), against the measured runs:\n\n")
        out.append(markdown_table(["mode", "model", "ranks", "batch/rank", "compression", "precision", "measured ms",
                                   "model ms", "error"], table))
        if errors:
            out.append(f"\nModel error on the measured points: mean {100 * np.mean(errors):.0f} %, "
                       f"max {100 * np.max(errors):.0f} %.\n")

    # Projection: a hierarchical allreduce (reduce-scatter in the node, ring over nodes, all-gather in
    # the node) on links of the given bandwidth and latency; compute per step as given or measured.
    params = args.params or (int(rows[0]["params"]) if rows else 25_000_000)
    step_compute = args.compute_s or (float(np.median([r["compute_s"] for r in rows])) if rows else 0.1)
    link_beta = 8 / (args.link_gbps * 1e9)
    intra_beta = 8 / (args.intra_gbps * 1e9)
    lat = args.latency_us * 1e-6
    g = args.gpus_per_node
    nbytes = 4 * params
    proj = []
    for total in split_list(args.project_ranks, int):
        nodes = max(1, total // g)
        local = min(g, total)
        t_intra = 2 * (local - 1) / local * nbytes * intra_beta if local > 1 else 0.0
        t_inter = (2 * (nodes - 1) * lat + 2 * (nodes - 1) / nodes * (nbytes / local) * link_beta) if nodes > 1 else 0.0
        comm = t_intra + t_inter
        proj.append([total, nodes, f"{1e3 * comm:.2f}", f"{100 * step_compute / (step_compute + comm):.0f} %",
                     f"{100 * step_compute / max(step_compute, comm):.0f} %"])
    out.append(f"\nProjection for {params} parameters (fp32 gradients, {nbytes / 2**20:.1f} MiB), "
               f"{1e3 * step_compute:.2f} ms compute per step, {g} GPUs per node at {args.intra_gbps:g} Gb/s inside "
               f"a node, {args.link_gbps:g} Gb/s and {args.latency_us:g} us between nodes:\n\n")
    out.append(markdown_table(["ranks", "nodes", "allreduce ms", "efficiency (no overlap)", "efficiency (full overlap)"],
                              proj))
    report = os.path.join(args.out, "report.md")
    with open(report, "a") as f:
        f.writelines(out)
    with open(os.path.join(args.out, "model.json"), "w") as f:
        json.dump({"ranks": n, "alpha_s": alpha, "beta_s_per_byte": beta, "bandwidth_GBps": 1e-9 / beta,
                   "mean_abs_error": float(np.mean(errors)) if errors else None,
                   "max_abs_error": float(np.max(errors)) if errors else None}, f, indent=1)
    print(f"alpha {1e6 * alpha:.2f} us, bandwidth {1e-9 / beta:.2f} GB/s" +
          (f", model error mean {100 * np.mean(errors):.0f} % max {100 * np.max(errors):.0f} %" if errors else "") +
          f"; appended to {report}")


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
    s = sub.add_parser("sweep", parents=[common], help="run the sweep and write the report")
    s.add_argument("--ranks", default="1,2,4")
    s.add_argument("--mode", default="strong", help="strong, weak or both (comma list)")
    s.add_argument("--models", default="mlp")
    s.add_argument("--batch-sizes", default="256", help="global (strong) or per-rank (weak) batches, comma list")
    s.add_argument("--compression", default="none", help="comma list of --compression values")
    s.add_argument("--precision", default="fp32", help="comma list of fp32, bf16, fp16")
    s.add_argument("--steps", type=int, default=200)
    s.add_argument("--log-every", type=int, default=20)
    s.add_argument("--threads", type=int, default=1, help="compute threads per rank")
    s.add_argument("--target-accuracy", type=float, default=0.0, help="report time to this training accuracy")
    s.add_argument("--train-args", default="", help="more `dtrain train` options")
    s.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    m = sub.add_parser("model", parents=[common], help="fit the alpha-beta model, predict, project")
    m.add_argument("--results", help="results.csv of a sweep (else only the fit and the projection)")
    m.add_argument("--bench", help="saved `dtrain bench allreduce` output (else it is run)")
    m.add_argument("--bench-ranks", type=int, default=2)
    m.add_argument("--bench-max-bytes", default="64M")
    m.add_argument("--params", type=int, default=0, help="parameters of the projected model (default: measured)")
    m.add_argument("--compute-s", type=float, default=0.0, help="compute per step for the projection")
    m.add_argument("--project-ranks", default="8,64,256,1024")
    m.add_argument("--gpus-per-node", type=int, default=8)
    m.add_argument("--link-gbps", type=float, default=200.0, help="bandwidth between nodes, Gb/s")
    m.add_argument("--intra-gbps", type=float, default=2400.0, help="bandwidth inside a node, Gb/s")
    m.add_argument("--latency-us", type=float, default=5.0)
    args = p.parse_args()
    args.dtrain = os.path.abspath(args.dtrain)
    os.makedirs(args.out, exist_ok=True)
    cmd_sweep(args) if args.cmd == "sweep" else cmd_model(args)


if __name__ == "__main__":
    main()
