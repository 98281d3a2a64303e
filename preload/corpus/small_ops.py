#!/usr/bin/env python3
"""A launch-bound eager loop: tiny tensors through ~30 elementwise and reduction ops per step.

A 256-element fp32 state goes each step through add, mul, sin, exp, comparisons, where, clamp, sum, max, an
integer cumsum (a floating-point cumsum on CUDA has no deterministic implementation), torch.gather with a fixed
index tensor, softmax and tanh, with no host sync inside the loop. The timed loop is bracketed by
synchronizes; step_us = mean_us = total time / steps.

stdout: `result <key> <sha256>` lines, then `steps`, `step_us`, `mean_us`. Everything else goes to stderr.
"""

import argparse
import sys
import time

import common  # first: sets what must be set before torch loads (common.py)
from common import deterministic, pick_device, sha256, sync, tensor_bytes
import torch


def step(state, idx):
    # A bounded map that keeps mixing (it neither settles nor blows up), so the final state depends on every step.
    n = state.numel()
    a = state * 2.9 + 0.1  # mul, add
    b = torch.sin(a)  # sin
    c = torch.exp(b * 0.5)  # mul, exp
    d = torch.where(c > 1.0, c - 1.0, 1.0 - c)  # gt, sub, rsub, where
    e = torch.clamp(d, -2.0, 2.0)  # clamp
    s = e.sum()  # sum
    m = e.max()  # max
    cnt = torch.cumsum((e > 0.3).to(torch.int32), 0)  # gt, cast, cumsum
    g = torch.gather(e, 0, idx)  # gather
    sm = torch.softmax(g, 0)  # softmax
    mix = 0.6 * b + 0.5 * g  # mul, mul, add
    mix = mix - 0.5 * cnt.to(e.dtype) / n + 0.25 * n * sm  # cast, mul, div, sub, mul, add
    mix = mix + 0.1 * (m - s / n)  # div, sub, mul, add
    return torch.tanh(mix * 1.5)  # mul, tanh


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=2000, help="timed steps")
    ap.add_argument("--warmup", type=int, default=50, help="untimed steps first")
    ap.add_argument("--size", type=int, default=256, help="elements in the state")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--deterministic-algorithms", action="store_true",
                    help="torch.use_deterministic_algorithms(True) with CUBLAS_WORKSPACE_CONFIG=:4096:8 (read before argparse)")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.size < 1:
        ap.error("need --steps >= 1, --warmup >= 0, --size >= 1")

    deterministic(args.seed)
    device = pick_device(args.device)

    gen = torch.Generator().manual_seed(args.seed + 1)
    state = torch.randn(args.size, generator=gen).to(device)
    idx = torch.randperm(args.size, generator=gen).to(device)

    with torch.no_grad():
        for _ in range(args.warmup):
            state = step(state, idx)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            state = step(state, idx)
        sync(device)
        t1 = time.perf_counter()

    per_step = (t1 - t0) * 1e6 / args.steps
    print(f"small_ops.py: state[:4] {state[:4].tolist()}", file=sys.stderr)
    print(f"result state {sha256(tensor_bytes(state))}")
    print(f"steps {args.steps}")
    print(f"step_us {per_step:.3f}")
    print(f"mean_us {per_step:.3f}")


if __name__ == "__main__":
    main()
