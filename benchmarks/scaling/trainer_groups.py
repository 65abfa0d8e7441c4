#!/usr/bin/python3
"""Trainer groups (dtrain train --trainers K --sweep ...) measured on Fashion-MNIST.

  throughput  K configurations as one job of K trainer groups, against K jobs one after another
              (each job the whole machine: one rank with --threads = cores, or --alone-ranks ranks
              running the batch data parallel), wall time from launch to exit; reports
              configurations per hour of both and their ratio.
  pbt         population-based training (--pbt-every) against the same K configurations trained
              fixed (--fixed-steps, default the same steps; more steps match the wall time PBT's
              tournament evaluations take), for each seed: the best PBT trainer's test accuracy
              against the median of the fixed ones; reports both per seed and their means.

  benchmarks/scaling/trainer_groups.py throughput --dtrain build/dtrain --data build/data/fashion-mnist
  benchmarks/scaling/trainer_groups.py pbt --dtrain build/dtrain --data build/data/fashion-mnist --seeds 1,2
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def mpirun(n, args, log):
    cmd = ["mpiexec", "-n", str(n), "--oversubscribe", "--bind-to", "none"] + args
    t0 = time.monotonic()
    r = subprocess.run(cmd, env={**os.environ, **MPI_ENV}, stdout=log, stderr=subprocess.STDOUT)
    return time.monotonic() - t0, r.returncode


def summary(folder):
    with open(os.path.join(folder, "summary.json")) as f:
        return json.load(f)["trainers"]


def throughput(a, work, log):
    values = a.lrs.split(",")
    k = len(values)
    base = [a.dtrain, "train", "--model", a.model, "--data", f"{a.data}/train", "--test-data", f"{a.data}/test",
            "--steps", str(a.steps), "--progress", "off", "--checkpoint-every", str(a.steps)]
    together, rc = mpirun(k, base + ["--batch-size", str(a.batch_size), "--threads", "1", "--trainers", str(k),
                                     "--sweep", "lr=" + a.lrs, "--sweep-dir", f"{work}/groups"], log)
    assert rc == 0, f"the trainer groups job failed ({rc}); see {log.name}"
    # Each separate job: the same samples per step, on --alone-ranks ranks (the job's allocation
    # running data parallel) with the cores shared among them.
    n = a.alone_ranks
    assert a.batch_size % n == 0, "--batch-size must divide over --alone-ranks"
    alone = 0.0
    for i, v in enumerate(values):
        s, rc = mpirun(n, base + ["--threads", str(max(1, os.cpu_count() // n)), "--batch-size", str(a.batch_size // n),
                                  "--lr", v, "--seed", str(42 + i), "--checkpoint-dir", f"{work}/alone-{i}"], log)
        assert rc == 0, f"job {i} failed ({rc}); see {log.name}"
        alone += s
    print(f"{k} configurations of {a.model}, {a.steps} steps of {a.batch_size} samples each, {os.cpu_count()} cores")
    print(f"  one job, {k} trainer groups of 1 rank:  {together:7.1f} s  {3600 * k / together:8.0f} configurations/h")
    print(f"  {k} jobs of {n} rank(s) one after another: {alone:7.1f} s  {3600 * k / alone:8.0f} configurations/h")
    print(f"  ratio: {alone / together:.2f}x")


def pbt(a, work, log):
    values = a.lrs.split(",")
    k = len(values)
    rows = []
    for seed in a.seeds.split(","):
        base = [a.dtrain, "train", "--model", a.model, "--data", f"{a.data}/train", "--test-data", f"{a.data}/test",
                "--epochs", "100", "--progress", "off", "--threads", "1", "--trainers", str(k), "--sweep", "lr=" + a.lrs,
                "--momentum",
                str(a.momentum), "--seed", seed, "--log-every", "100"]
        fixed_steps = str(a.fixed_steps or a.steps)
        fixed_s, rc = mpirun(k, base + ["--steps", fixed_steps, "--checkpoint-every", fixed_steps, "--sweep-dir",
                                        f"{work}/fixed-{seed}"], log)
        assert rc == 0, f"fixed sweep failed ({rc}); see {log.name}"
        pbt_s, rc = mpirun(k, base + ["--steps", str(a.steps), "--checkpoint-every", str(a.steps), "--pbt-every",
                                      str(a.pbt_every), "--sweep-dir", f"{work}/pbt-{seed}"], log)
        assert rc == 0, f"pbt sweep failed ({rc}); see {log.name}"
        fixed = [100 * float(t["accuracy"]) for t in summary(f"{work}/fixed-{seed}")]
        best = max(100 * float(t["accuracy"]) for t in summary(f"{work}/pbt-{seed}"))
        rows.append((seed, statistics.median(fixed), max(fixed), best, fixed_s, pbt_s))
    print(f"{k} trainers of {a.model} (lr {a.lrs}, momentum {a.momentum}), PBT {a.steps} steps, every {a.pbt_every}; "
          f"fixed {a.fixed_steps or a.steps} steps")
    print(f"{'seed':>4}  {'fixed median':>12}  {'fixed best':>10}  {'PBT best':>8}  {'fixed s':>7}  {'PBT s':>6}")
    for seed, med, top, best, fs, ps in rows:
        print(f"{seed:>4}  {med:11.2f}%  {top:9.2f}%  {best:7.2f}%  {fs:7.1f}  {ps:6.1f}")
    print(f"mean  {statistics.mean(r[1] for r in rows):11.2f}%  {statistics.mean(r[2] for r in rows):9.2f}%  "
          f"{statistics.mean(r[3] for r in rows):7.2f}%")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["throughput", "pbt"])
    ap.add_argument("--dtrain", default="build/dtrain")
    ap.add_argument("--data", default="build/data/fashion-mnist", help="folder with train/ and test/ shards")
    ap.add_argument("--model", default="simple_cnn")
    ap.add_argument("--lrs", default="0.003,0.01,0.03,0.3", help="the configurations: one learning rate each")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=64, help="samples per step of each configuration")
    ap.add_argument("--alone-ranks", type=int, default=1,
                    help="throughput: ranks of each separate job (data parallel over the batch; 1: one rank "
                         "with every core's thread)")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--pbt-every", type=int, default=100)
    ap.add_argument("--fixed-steps", type=int, default=0, help="steps of the fixed trainers (0: --steps)")
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--work", default=None, help="run folders (default: a new temporary folder)")
    a = ap.parse_args()
    work = a.work or tempfile.mkdtemp(prefix="trainer_groups-")
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "log.txt"), "w") as log:
        (throughput if a.what == "throughput" else pbt)(a, work, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
