#!/usr/bin/python3
"""The peer for data-parallel scaling: SimpleCNN under PyTorch DistributedDataParallel (gloo),
launched by mpirun like dtrain (rank and size from Open MPI's environment). Synthetic 1x28x28
batches per rank, SGD with momentum, 1 thread per rank. Rank 0 prints global samples/s as JSON.

usage: mpirun -n 2 --bind-to none /usr/bin/python3 benchmarks/peers/torch_ddp_simple_cnn.py [--batch-size 64]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_simple_cnn import model  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--port", type=int, default=29533)
    args = p.parse_args()
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=size)
    torch.manual_seed(0)
    m = torch.nn.parallel.DistributedDataParallel(model(torch))
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(args.batch_size, 1, 28, 28, generator=g), torch.randint(0, 10, (args.batch_size,), generator=g))
               for _ in range(4)]

    def step(i):
        x, y = batches[i % 4]
        opt.zero_grad(set_to_none=True)
        loss_fn(m(x), y).backward()
        opt.step()

    for i in range(args.warmup):
        step(i)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(args.steps):
        step(i)
    dist.barrier()
    dt = time.perf_counter() - t0
    if rank == 0:
        print(json.dumps({"framework": "pytorch-ddp", "ranks": size, "batch_per_rank": args.batch_size,
                          "samples_per_s": args.steps * args.batch_size * size / dt}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
