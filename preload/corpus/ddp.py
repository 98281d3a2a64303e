#!/usr/bin/env python3
"""Data-parallel training with torch.distributed and NCCL, one process per GPU (unmodified-style PyTorch).

Run it the usual way, `torchrun --nproc_per_node=N ddp.py`, or plainly, `python3 ddp.py --world N`, which starts
the N ranks itself (torch.multiprocessing, spawn) with the same environment. Each rank takes `cuda:<local rank>`,
wraps the train.py-style CNN + MLP in DistributedDataParallel (gradients all-reduced by NCCL in buckets during
backward), and trains with AdamW on its own synthetic batches; `loss.item()` every 10th step.

stdout (rank 0 only): `result rank<r>-<key> <sha256>` for every rank (its logged losses, its parameters after
training, its BatchNorm buffers; gathered to rank 0), then `steps`, `step_us` (rank 0's median per step),
`mean_us`. Everything else goes to stderr.
"""

import argparse
import sys
import time

import common  # first: sets what must be set before torch loads (common.py)
from common import deterministic, report_ranks, run_ranks, sha256, tensor_bytes
import torch
import torch.distributed as dist
from torch import nn


def make_model(classes, width):
    return nn.Sequential(
        nn.Conv2d(3, 32, kernel_size=3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, kernel_size=3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, classes),
    )


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--world", type=int, default=2, help="ranks to start when not run by torchrun")
    ap.add_argument("--steps", type=int, default=50, help="timed training steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed training steps first")
    ap.add_argument("--batch", type=int, default=32, help="per rank")
    ap.add_argument("--batches", type=int, default=4, help="distinct synthetic batches per rank, cycled")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--width", type=int, default=256, help="hidden width of the MLP head")
    ap.add_argument("--bucket-mb", type=float, default=1.0, help="DDP's gradient bucket size (MiB)")
    ap.add_argument("--log-every", type=int, default=10, help="loss.item() every this many steps")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--port", type=int, default=29511, help="rendezvous port when not run by torchrun")
    ap.add_argument("--deterministic-algorithms", action="store_true",
                    help="torch.use_deterministic_algorithms(True) with CUBLAS_WORKSPACE_CONFIG=:4096:8")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.batches < 1 or args.log_every < 1 or args.world < 1:
        ap.error("need --steps >= 1, --warmup >= 0, --batches >= 1, --log-every >= 1, --world >= 1")
    return args


def train(rank, world, local_rank, args):
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    # The same initial model on every rank (DDP also broadcasts rank 0's), different data per rank.
    deterministic(args.seed)
    model = make_model(args.classes, args.width).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank], bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    g = torch.Generator(device=device)
    g.manual_seed(args.seed + 1000 * (rank + 1))
    data = [
        (torch.randn(args.batch, 3, 32, 32, device=device, generator=g),
         torch.randint(0, args.classes, (args.batch,), device=device, generator=g))
        for _ in range(args.batches)
    ]
    losses = []
    times = []
    for step in range(args.warmup + args.steps):
        x, y = data[step % args.batches]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        loss.backward()
        opt.step()
        if step % args.log_every == 0:
            losses.append(loss.item())
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    torch.cuda.synchronize(device)
    mine = {
        "losses": sha256("".join(float(v).hex() for v in losses).encode()),
        "params": sha256(b"".join(tensor_bytes(p) for p in model.parameters())),
        "buffers": sha256(b"".join(tensor_bytes(b) for b in model.buffers())),
    }
    report_ranks(rank, world, mine, len(times), times)
    dist.barrier()
    dist.destroy_process_group()


def main():
    run_ranks(train, parse_args(sys.argv[1:]), "ddp.py")


if __name__ == "__main__":
    main()
