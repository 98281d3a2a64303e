#!/usr/bin/env python3
"""CNN training steps with convolutions, batch norm and AdamW (unmodified-style PyTorch).

Conv2d, BatchNorm2d, ReLU, MaxPool2d, Conv2d, BatchNorm2d, ReLU, AdaptiveAvgPool2d(1), Flatten, then an MLP
head (Linear, ReLU, Dropout(p=0.0), Linear), CrossEntropyLoss on synthetic data generated once on the device
from a fixed seed (several batches, cycled), torch.optim.AdamW. A step is zero_grad, forward, loss, backward,
optimizer.step; loss.item() is called every 10th step only (as training loops do for logging), so most steps
have no host sync: step_us (the median) then mostly measures the host's enqueue time, and mean_us carries the
waits at the logged steps too.

stdout: `result <key> <sha256>` lines, then `steps`, `step_us` (median per step), `mean_us`.
Everything else goes to stderr.
"""

import argparse
import statistics
import sys
import time

import common  # first: sets what must be set before torch loads (common.py)
from common import deterministic, pick_device, sha256, sync, tensor_bytes
import torch
from torch import nn


def make_model(classes):
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
        nn.Linear(64, 128),
        nn.ReLU(),
        nn.Dropout(p=0.0),
        nn.Linear(128, classes),
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=50, help="timed training steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed training steps first")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=4, help="distinct synthetic batches, cycled")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--log-every", type=int, default=10, help="loss.item() every this many steps")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--deterministic-algorithms", action="store_true",
                    help="torch.use_deterministic_algorithms(True) with CUBLAS_WORKSPACE_CONFIG=:4096:8 (read before argparse)")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.batches < 1 or args.log_every < 1:
        ap.error("need --steps >= 1, --warmup >= 0, --batches >= 1, --log-every >= 1")

    deterministic(args.seed)
    device = pick_device(args.device)

    # Weights are initialised on the CPU from the seed, then moved; the data is generated on the device.
    model = make_model(args.classes).to(device).train()
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    xs = torch.randn(args.batches, args.batch, 3, 32, 32, generator=gen, device=device)
    ys = torch.randint(args.classes, (args.batches, args.batch), generator=gen, device=device)
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)

    losses = []
    times = []
    for i in range(args.warmup + args.steps):
        b = i % args.batches
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out = model(xs[b])
        loss = criterion(out, ys[b])
        loss.backward()
        opt.step()
        if (i + 1) % args.log_every == 0:
            losses.append(loss.item())
        t1 = time.perf_counter()
        if i >= args.warmup:
            times.append((t1 - t0) * 1e6)
    sync(device)

    print(f"train.py: logged losses {losses}", file=sys.stderr)
    print(f"result losses {sha256(','.join(float(x).hex() for x in losses).encode())}")
    print(f"result params {sha256(b''.join(tensor_bytes(p) for p in model.parameters()))}")
    print(f"result buffers {sha256(b''.join(tensor_bytes(b) for b in model.buffers()))}")
    print(f"steps {len(times)}")
    print(f"step_us {statistics.median(times):.3f}")
    print(f"mean_us {statistics.fmean(times):.3f}")


if __name__ == "__main__":
    main()
