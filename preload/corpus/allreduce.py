#!/usr/bin/env python3
"""All-reduce latency over small messages with torch.distributed and NCCL, one process per GPU.

`python3 allreduce.py --world N --bytes B` (or under `torchrun --nproc_per_node=N`): each rank fills a float32
tensor of B bytes from its rank, then times `--iters` back-to-back `dist.all_reduce` calls (sum) followed by one
synchronize, `--rounds` times; a step is one all-reduce (the round's time divided by its calls), so launch and
enqueue cost show where the message is small. The reduced tensor of every rank is hashed (rank 0 prints them).

stdout (rank 0 only): `result rank<r>-sum <sha256>` per rank, `steps`, `step_us` (median over rounds, per
all-reduce), `mean_us`; on stderr `sync_us`, the median of one all-reduce followed by a synchronize, timed alone.
"""

import argparse
import statistics
import sys
import time

import common  # first: sets what must be set before torch loads (common.py)
from common import report_ranks, run_ranks, sha256, tensor_bytes
import torch
import torch.distributed as dist


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--world", type=int, default=2, help="ranks to start when not run by torchrun")
    ap.add_argument("--bytes", type=int, default=4096, help="message size (a multiple of 4)")
    ap.add_argument("--iters", type=int, default=100, help="all-reduces per timed round")
    ap.add_argument("--rounds", type=int, default=20, help="timed rounds")
    ap.add_argument("--warmup", type=int, default=50, help="untimed all-reduces first")
    ap.add_argument("--port", type=int, default=29512, help="rendezvous port when not run by torchrun")
    ap.add_argument("--deterministic-algorithms", action="store_true", help="accepted for the runner; unused")
    args = ap.parse_args(argv)
    if args.bytes < 4 or args.bytes % 4 or args.iters < 1 or args.rounds < 1 or args.world < 1:
        ap.error("need --bytes a positive multiple of 4, --iters >= 1, --rounds >= 1, --world >= 1")
    return args


def run(rank, world, local_rank, args):
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    n = args.bytes // 4
    # Small integers in float32: sums are exact whatever order NCCL adds in.
    t = (torch.arange(n, device=device, dtype=torch.float32) % 7 + rank)
    for _ in range(args.warmup):
        dist.all_reduce(t)
    torch.cuda.synchronize(device)
    # Zeros from here: repeated sums stay exact (and finite) however many calls a round makes.
    t.zero_()
    per_call = []
    for _ in range(args.rounds):
        dist.barrier()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(t)
        torch.cuda.synchronize(device)
        per_call.append((time.perf_counter() - t0) / args.iters)
    alone = []
    for _ in range(args.rounds):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        torch.cuda.synchronize(device)
        alone.append(time.perf_counter() - t0)
    final = torch.arange(n, device=device, dtype=torch.float32) % 7 + rank
    dist.all_reduce(final)
    torch.cuda.synchronize(device)
    mine = {"sum": sha256(tensor_bytes(final)), "last": sha256(tensor_bytes(t))}
    report_ranks(rank, world, mine, args.rounds * args.iters, per_call)
    if rank == 0:
        print(f"sync_us {statistics.median(alone) * 1e6:.3f}", file=sys.stderr)
    dist.barrier()
    dist.destroy_process_group()


def main():
    run_ranks(run, parse_args(sys.argv[1:]), "allreduce.py")


if __name__ == "__main__":
    main()
