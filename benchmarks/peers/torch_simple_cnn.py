#!/usr/bin/python3
"""The peer: the same SimpleCNN and recipe in PyTorch (Debian's python3-torch 1.13), for side-by-side
runs with dtrain. Two modes:

  bench  synthetic 1x28x28 batches, SGD momentum, prints training samples/s as JSON
  train  the reference recipe on the HDF5 shards written by `dtrain convert fashion-mnist`
         (reads them with h5py), prints test accuracy per epoch as JSON lines

Run with /usr/bin/python3 (the python3 first on PATH may lack torch).
"""
import argparse
import glob
import json
import math
import os
import sys
import time


def model(torch, classes=10, in_ch=1, hw=28):
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(in_ch, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * (hw // 4) * (hw // 4), classes))


def bench(args, torch):
    import contextlib
    torch.manual_seed(0)
    dev = torch.device(args.device)
    if dev.type == "cuda":  # fp32 means TF32 off, as dtrain's --precision fp32
        torch.backends.cuda.matmul.allow_tf32 = args.precision == "tf32"
        torch.backends.cudnn.allow_tf32 = args.precision == "tf32"
    autocast = (torch.autocast(dev.type, dtype=torch.bfloat16) if args.precision == "bf16"
                else contextlib.nullcontext())
    m = model(torch).to(dev)
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    batches = [(torch.randn(args.batch_size, 1, 28, 28).to(dev), torch.randint(0, 10, (args.batch_size,)).to(dev))
               for _ in range(4)]
    def step(i):
        x, y = batches[i % 4]
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = loss_fn(m(x), y)
        loss.backward()
        opt.step()
        if args.read_loss:
            loss.item()  # as dtrain, which reads every step's loss back
    for i in range(args.warmup):
        step(i)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(args.steps):
        step(i)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    print(json.dumps({"framework": "pytorch", "torch": torch.__version__, "batch": args.batch_size,
                      "threads": torch.get_num_threads(), "steps": args.steps,
                      "samples_per_s": args.steps * args.batch_size / dt,
                      "samples_per_cpu_s": args.steps * args.batch_size / dc}))


def load_split(h5py, np, d):
    xs, ys, mean, std = [], [], None, None
    for f in sorted(glob.glob(os.path.join(d, "*.h5"))):
        with h5py.File(f, "r") as h:
            xs.append(h["inputs"][...])
            ys.append(h["labels"][...])
            mean, std = h.attrs["mean"], h.attrs["std"]
    return np.concatenate(xs), np.concatenate(ys).astype(np.int64), mean, std


def train(args, torch):
    import h5py
    import numpy as np
    torch.manual_seed(args.seed)
    xtr, ytr, mean, std = load_split(h5py, np, os.path.join(args.data, "train"))
    xte, yte, _, _ = load_split(h5py, np, os.path.join(args.data, "test"))
    norm = lambda x: (torch.from_numpy(x).float() / 255.0 - float(mean[0])) / float(std[0])  # train statistics
    xtr, xte = norm(xtr), norm(xte)
    ytr, yte = torch.from_numpy(ytr), torch.from_numpy(yte)
    m = model(torch)
    steps_per_epoch = math.ceil(len(xtr) / args.batch_size)
    opt = torch.optim.SGD(m.parameters(), lr=args.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * steps_per_epoch)
    loss_fn = torch.nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        m.train()
        t0 = time.perf_counter()
        perm = torch.randperm(len(xtr))
        for i in range(steps_per_epoch):
            idx = perm[i * args.batch_size:(i + 1) * args.batch_size]
            opt.zero_grad(set_to_none=True)
            loss_fn(m(xtr[idx]), ytr[idx]).backward()
            opt.step()
            sched.step()
        m.eval()
        with torch.no_grad():
            correct = sum((m(xte[j:j + 1000]).argmax(1) == yte[j:j + 1000]).sum().item() for j in range(0, len(xte), 1000))
        print(json.dumps({"framework": "pytorch", "epoch": epoch + 1, "test_accuracy": correct / len(xte),
                          "epoch_s": time.perf_counter() - t0}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["bench", "train"])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="bench: cpu or cuda")
    p.add_argument("--precision", choices=["fp32", "tf32", "bf16"], default="fp32", help="bench: on cuda, tf32 or bf16 autocast")
    p.add_argument("--read-loss", action="store_true", help="bench: read the loss back every step (as dtrain does)")
    p.add_argument("--data", default="data/fashion-mnist")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    bench(args, torch) if args.mode == "bench" else train(args, torch)


if __name__ == "__main__":
    sys.exit(main())
