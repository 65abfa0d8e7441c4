#!/usr/bin/env python3
"""Soak: long trainings with every rank's resident memory sampled, to show that nothing grows.

Runs the MLP on Fashion-MNIST (20,000 steps, test-set evaluation every epoch, a checkpoint every
2,000 steps) and the GPT example on the fortunes (5,000 steps, its validation and checkpoints), each
under mpirun on --ranks ranks. Every --interval seconds it reads VmRSS of each rank from
/proc/PID/status and the newest step from the run's metrics file. Growth is measured after the
warm-up (the first --warmup-fraction of the steps: allocator pools, oneDNN's primitive cache, the
loader's buffers, the first checkpoint): the median resident set of the last 5 % of the steps
against that of the 5 % right after the warm-up, per rank; the run passes when every rank grew by
less than --max-growth (1 %). Writes OUT/soak.md, OUT/samples.csv and, with matplotlib, OUT/soak.png.

  benchmarks/soak/soak.py --dtrain build/dtrain --out runs/soak              # both runs
  benchmarks/soak/soak.py --dtrain build/dtrain --out runs/soak --runs mlp --mlp-steps 2000
Exit status 0 when every run stays within the bound, 1 otherwise.
"""
import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def descendants(pid):
    """PIDs of every process below `pid` (mpirun's ranks and anything they start)."""
    children = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(p))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def rank_rss_mib(pid):
    """{pid: resident MiB} of the dtrain processes below `pid`."""
    out = {}
    for p in descendants(pid):
        try:
            with open(f"/proc/{p}/comm") as f:
                if f.read().strip() != "dtrain":
                    continue
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        out[p] = int(line.split()[1]) / 1024.0
        except OSError:
            pass
    return out


def newest_step(metrics):
    """The step of the metrics file's last complete step line (0 before the first)."""
    try:
        with open(metrics, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "step" in rec and "summary" not in rec:
            return int(rec["step"])
    return 0


def prepare_data(args):
    """Converts what the runs read into OUT/data (once): Fashion-MNIST shards and the fortunes' tokens."""
    data = os.path.join(args.out, "data")
    if "mlp" in args.runs and not os.path.isdir(os.path.join(data, "fashion-mnist", "train")):
        subprocess.run([args.dtrain, "convert", "fashion-mnist", "--out", os.path.join(data, "fashion-mnist")],
                       check=True, stdout=subprocess.DEVNULL)
    if "gpt" in args.runs and not os.path.isfile(os.path.join(data, "fortunes", "train.h5")):
        subprocess.run([args.dtrain, "convert", "text", "--inputs", "/usr/share/games/fortunes", "--out",
                        os.path.join(data, "fortunes")], check=True, stdout=subprocess.DEVNULL)
    return data


def log_every(steps):
    """A metrics line every 0.5 % of the steps: the 5 % windows hold ten steps' worth of samples."""
    return max(1, steps // 200)


def train_args(args, run, data):
    out = os.path.join(args.out, run)
    common = ["--progress", "off", "--metrics", os.path.join(out, "metrics.jsonl"), "--checkpoint-dir",
              os.path.join(out, "ckpt")]
    if run == "mlp":
        fm = os.path.join(data, "fashion-mnist")
        return args.mlp_steps, ["--model", "mlp", "--data", os.path.join(fm, "train"), "--test-data",
                                os.path.join(fm, "test"), "--epochs", "100000", "--steps", str(args.mlp_steps), "--log-every", str(log_every(args.mlp_steps)),
                                "--checkpoint-every", str(max(1, args.mlp_steps // 10))] + common
    return args.gpt_steps, ["--config", os.path.join(ROOT, "examples", "gpt_fortunes.ini"), "--data",
                            os.path.join(data, "fortunes"), "--steps", str(args.gpt_steps), "--log-every", str(log_every(args.gpt_steps)),
                            "--checkpoint-every", str(max(1, args.gpt_steps // 5))] + common


def soak(args, run, data):
    """Runs one training, sampling; returns [(seconds, step, {pid: MiB})]."""
    steps, targs = train_args(args, run, data)
    out = os.path.join(args.out, run)
    os.makedirs(out, exist_ok=True)
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = ["mpirun", "-n", str(args.ranks), "--bind-to", "none"] + args.launcher_args.split() + \
          [args.dtrain, "train"] + targs + ["--threads", str(args.threads)]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    with open(os.path.join(out, "train.log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        t0, samples = time.time(), []
        while proc.poll() is None:
            rss = rank_rss_mib(proc.pid)
            if rss:
                samples.append((time.time() - t0, newest_step(metrics), rss))
            time.sleep(args.interval)
    if proc.returncode != 0:
        raise SystemExit(f"{run}: the training failed (status {proc.returncode}); see {out}/train.log")
    return steps, samples


def growth(steps, samples, warmup_fraction):
    """{pid: (MiB after warm-up, MiB at the end, relative growth, peak MiB)} over ranks, by step."""
    w, span = warmup_fraction * steps, 0.05 * steps
    out = {}
    for pid in sorted({p for _, _, r in samples for p in r}):
        early = [r[pid] for _, s, r in samples if pid in r and w <= s <= w + span]
        late = [r[pid] for _, s, r in samples if pid in r and s >= steps - span]
        if not early or not late:
            raise SystemExit(f"too few samples of rank pid {pid} after the warm-up or at the end: "
                             "lower --interval or raise the step count")
        a, b = statistics.median(early), statistics.median(late)
        peak = max(r[pid] for _, s, r in samples if pid in r and s >= w)
        out[pid] = (a, b, (b - a) / a, peak)
    return out


def report(args, results):
    lines = ["# Soak: resident memory over long trainings\n",
             f"{args.ranks} ranks under mpirun, {args.threads} thread(s) each, resident set (VmRSS) of every "
             f"rank sampled every {args.interval} s. Warm-up: the first {100 * args.warmup_fraction:.0f} % of "
             "the steps; growth: median of the last 5 % of the steps against the median of the 5 % right "
             f"after the warm-up. Bound: {100 * args.max_growth:.1f} %.\n",
             "| run | steps | rank | MiB after warm-up | MiB at the end | growth | peak MiB after warm-up | samples |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    ok = True
    for run, (steps, samples, g) in results.items():
        for i, (pid, (a, b, rel, peak)) in enumerate(g.items()):
            ok &= abs(rel) < args.max_growth
            lines.append(f"| {run} | {steps} | {i} | {a:.1f} | {b:.1f} | {100 * rel:+.2f} % | {peak:.1f} | "
                         f"{len(samples)} |")
    lines.append("\nVerdict: " + ("every rank within the bound" if ok else "a rank grew past the bound") + ".\n")
    with open(os.path.join(args.out, "soak.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return ok


def write_samples(args, results):
    with open(os.path.join(args.out, "samples.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "seconds", "step", "pid", "rss_mib"])
        for run, (_, samples, _) in results.items():
            for t, s, rss in samples:
                for pid, mib in rss.items():
                    w.writerow([run, f"{t:.2f}", s, pid, f"{mib:.2f}"])
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (run, (steps, samples, g)) in zip(axes[0], results.items()):
        for i, pid in enumerate(g):
            pts = [(s, r[pid]) for _, s, r in samples if pid in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"rank {i}")
        ax.axvline(args.warmup_fraction * steps, color="grey", linestyle=":", label="end of warm-up")
        ax.set(title=f"{run}: resident memory", xlabel="step", ylabel="MiB")
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "soak.png"), dpi=100)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtrain", default=os.path.join(ROOT, "build", "dtrain"))
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "soak"))
    p.add_argument("--runs", default="mlp,gpt", help="comma-separated: mlp, gpt")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="threads per rank")
    p.add_argument("--mlp-steps", type=int, default=20000)
    p.add_argument("--gpt-steps", type=int, default=5000)
    p.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    p.add_argument("--warmup-fraction", type=float, default=0.1)
    p.add_argument("--max-growth", type=float, default=0.01, help="bound on the relative growth per rank")
    p.add_argument("--launcher-args", default="--oversubscribe", help="more mpirun arguments")
    args = p.parse_args()
    args.runs = [r for r in args.runs.split(",") if r]
    bad = [r for r in args.runs if r not in ("mlp", "gpt")]
    if bad:
        raise SystemExit(f"--runs: unknown run '{bad[0]}' (mlp, gpt)")
    args.dtrain = os.path.abspath(args.dtrain)
    os.makedirs(args.out, exist_ok=True)
    data = prepare_data(args)
    results = {}
    for run in args.runs:
        steps, samples = soak(args, run, data)
        results[run] = (steps, samples, growth(steps, samples, args.warmup_fraction))
    write_samples(args, results)
    sys.exit(0 if report(args, results) else 1)


if __name__ == "__main__":
    main()
