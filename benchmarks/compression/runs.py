"""Shared by the compression benchmarks: one `dtrain train` run of the reference recipe
(examples/fashion_cnn.ini on Fashion-MNIST, 2 ranks, global batch 64) with extra options, and its
summary line. With DTRAIN_BENCH_LOCK=FILE each run holds that lock (flock), so benchmarks sharing
a machine take turns run by run."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def add_common_args(p, out):
    p.add_argument("--dtrain", default=os.path.join(ROOT, "build", "dtrain"))
    p.add_argument("--data", default=os.path.join(ROOT, "data", "fashion-mnist"))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", out))


def train(args, tag, options, epochs=None):
    """Trains with the reference recipe plus `options`; returns the run's summary (a dict with
    test_accuracy, samples_per_s, ...) and keeps its checkpoints in OUT/ckpt-TAG."""
    metrics = os.path.join(args.out, tag + ".jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    lock = ["flock", os.environ["DTRAIN_BENCH_LOCK"]] if os.environ.get("DTRAIN_BENCH_LOCK") else []
    cmd = lock + ["mpirun", "-n", str(args.ranks), "--bind-to", "none", args.dtrain, "train", "--config",
           os.path.join(ROOT, "examples", "fashion_cnn.ini"), "--data", os.path.join(args.data, "train"),
           "--test-data", os.path.join(args.data, "test"), "--global-batch-size", "64", "--epochs",
           str(epochs or args.epochs), "--progress", "off", "--metrics", metrics, "--checkpoint-dir",
           os.path.join(args.out, "ckpt-" + tag)] + [str(o) for o in options]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    print("running:", " ".join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return [json.loads(l) for l in open(metrics) if '"summary"' in l][-1]


def write_table(out, name, lines):
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(out, name), "w") as f:
        f.write(table + "\n")
