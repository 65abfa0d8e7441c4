#!/usr/bin/python3
"""The int8 peer: a dtrain SimpleCNN checkpoint loaded into the same model in PyTorch (Debian's
python3-torch 1.13) and quantized by PyTorch's eager-mode static post-training quantization, for
side-by-side runs with `dtrain eval --int8` (compare_int8.py).

What it does, as dtrain does it: the weights come from the checkpoint (dtrain names its
parameters as nn.Sequential does: 0.weight, 3.weight, 7.weight; a shrunk checkpoint's widths come
from its "channels" list), inputs are normalised with the checkpoint's mean and std, calibration
runs on the first --calibration-batches batches of the training shards in order, and the test set
is evaluated in batches of --batch-size with only the forward timed (no warm-up pass: dtrain's
timing includes its first batch too). Conv2d + ReLU pairs are fused
(fuse_modules) before prepare/convert, as dtrain fuses them. Each quantized engine of
--engines that this torch build supports (Debian's has no fbgemm, so no x86/fbgemm engine) gets its
default qconfig (onednn: per-channel weights, histogram-calibrated activations; qnnpack:
per-tensor weights). Prints one JSON line per model: fp32, then int8 per engine.

usage: /usr/bin/python3 benchmarks/peers/torch_int8_simple_cnn.py --checkpoint CKPT
           [--data data/fashion-mnist] [--threads 1] [--engines onednn qnnpack]
"""
import argparse
import copy
import glob
import json
import os
import sys
import time

from torch_simple_cnn import load_split


def newest_checkpoint(path):
    if os.path.isfile(path):
        return path
    files = sorted(f for f in glob.glob(os.path.join(path, "ckpt-step*.h5")) if not f.endswith(".tmp"))
    if not files:
        sys.exit(f"no checkpoint in {path}")
    return files[-1]


def load_model(torch, h5py, path):
    """The checkpoint's SimpleCNN (nn.Sequential, eval mode) and its input mean and std."""
    nn = torch.nn
    with h5py.File(path, "r") as h:
        name = h.attrs.get("model", b"")
        name = name.decode() if isinstance(name, bytes) else str(name)
        if name not in ("simple_cnn", "simplecnn"):
            sys.exit(f"{path} holds a {name or 'model of no name'}, not a simple_cnn")
        if "int8" in h.attrs:
            sys.exit(f"{path} is an int8 checkpoint: give the fp32 one")
        c1, c2 = (int(v) for v in h.attrs.get("list:channels", [16, 32]))
        cin, hgt, wid = (int(v) for v in h.attrs["list:input_shape"])
        classes = int(h.attrs["classes"])
        state = {name: torch.from_numpy(h["param"][name][...]) for name in h["param"]}
        mean, std = h["meta/norm_mean"][...], h["meta/norm_std"][...]
    m = nn.Sequential(nn.Conv2d(cin, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                      nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                      nn.Flatten(), nn.Linear(c2 * (hgt // 4) * (wid // 4), classes))
    m.load_state_dict(state)
    return m.eval(), mean, std


def quantized(torch, fp32, engine, calibration):
    """fp32 quantized by eager-mode static PTQ on `engine`, calibrated on the `calibration` batches."""
    q = torch.ao.quantization
    torch.backends.quantized.engine = engine
    m = torch.nn.Sequential(q.QuantStub(), copy.deepcopy(fp32), q.DeQuantStub()).eval()
    q.fuse_modules(m[1], [["0", "1"], ["3", "4"]], inplace=True)
    m.qconfig = q.get_default_qconfig(engine)
    q.prepare(m, inplace=True)
    with torch.no_grad():
        for x in calibration:
            m(x)
    return q.convert(m, inplace=True)


def evaluate(torch, m, x, y, batch):
    """(accuracy, forward seconds) over the test set: only the forward is timed."""
    correct, spent = 0, 0.0
    with torch.inference_mode():
        for i in range(0, len(x), batch):
            xb = x[i:i + batch].contiguous()
            t0 = time.perf_counter()
            logits = m(xb)
            spent += time.perf_counter() - t0
            correct += (logits.argmax(1) == y[i:i + batch]).sum().item()
    return correct / len(x), spent


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="dtrain SimpleCNN checkpoint (file, or directory: its newest)")
    p.add_argument("--data", default="data/fashion-mnist")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--calibration-batches", type=int, default=10)
    p.add_argument("--engines", nargs="+", default=["onednn", "qnnpack"])
    args = p.parse_args()
    import h5py
    import numpy as np
    import torch
    torch.set_num_threads(args.threads)
    fp32, mean, std = load_model(torch, h5py, newest_checkpoint(args.checkpoint))
    norm = lambda a: ((torch.from_numpy(a).float() / 255.0) - float(mean[0])) / float(std[0])
    xtr, _, _, _ = load_split(h5py, np, os.path.join(args.data, "train"))
    n_cal = args.calibration_batches * args.batch_size
    calibration = list(norm(xtr[:n_cal]).split(args.batch_size))
    xte, yte, _, _ = load_split(h5py, np, os.path.join(args.data, "test"))
    xte, yte = norm(xte), torch.from_numpy(yte)
    common = {"framework": "pytorch", "torch": torch.__version__, "threads": torch.get_num_threads(),
              "batch": args.batch_size, "samples": len(xte)}

    def report(precision, engine, m):
        acc, spent = evaluate(torch, m, xte, yte, args.batch_size)
        print(json.dumps(dict(common, precision=precision, engine=engine, test_accuracy=acc, forward_s=spent,
                              samples_per_s=len(xte) / spent)), flush=True)

    report("fp32", "-", fp32)
    for engine in args.engines:
        if engine not in torch.backends.quantized.supported_engines:
            print(json.dumps(dict(common, precision="int8", engine=engine, error="not in this torch build")))
            continue
        report("int8", engine, quantized(torch, fp32, engine, calibration))


if __name__ == "__main__":
    sys.exit(main())
