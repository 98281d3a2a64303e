#!/usr/bin/env python3
"""torch.compile'd MLP, forward only, with a synchronize after every step (unmodified-style PyTorch).

Four nn.Linear(1024, 1024) layers with GELU and a LayerNorm, compiled with torch.compile in its default mode
(Inductor: Triton kernels plus cuBLAS), run on a batch of 64 under torch.no_grad(), with
torch.cuda.synchronize() after each step. Compilation happens in the warmup steps. A step is one forward and
its synchronize.

Exit status 3, with a message on stderr, when torch.compile cannot be used here (no C compiler for Inductor
and Triton, no Triton for the GPU, or the compilation itself failing).

stdout: `result <key> <sha256>` lines, then `steps`, `step_us` (median per step), `mean_us`.
Everything else goes to stderr.
"""

import argparse
import os
import shutil
import statistics
import sys
import time
import traceback

import common  # first: sets what must be set before torch loads (common.py)
from common import deterministic, pick_device, sha256, sync, tensor_bytes
import torch
from torch import nn


UNUSABLE = 3







def unusable(why):
    print(f"compile.py: torch.compile is unusable on this machine: {why}", file=sys.stderr)
    sys.exit(UNUSABLE)


def check_toolchain(device):
    cc = os.environ.get("CC")
    found = shutil.which(cc) if cc else None
    found = found or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not found:
        unusable("no C compiler (cc, gcc, clang or $CC) on PATH; Inductor and Triton need one")
    print(f"compile.py: C compiler {found}", file=sys.stderr)
    if device.type == "cuda":
        try:
            from torch.utils._triton import has_triton
        except ImportError:  # pragma: no cover - very old torch
            has_triton = None
        if has_triton is not None and not has_triton():
            unusable("Triton is not usable for this GPU (torch.utils._triton.has_triton() is False)")


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.fc3 = nn.Linear(d, d)
        self.fc4 = nn.Linear(d, d)
        self.act = nn.GELU()

    def forward(self, x):
        x = self.act(self.fc1(x))
        x = self.act(self.fc2(x))
        x = self.norm(x)
        x = self.act(self.fc3(x))
        return self.fc4(x)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=200, help="timed steps")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps first (compilation happens here)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--deterministic-algorithms", action="store_true",
                    help="torch.use_deterministic_algorithms(True) with CUBLAS_WORKSPACE_CONFIG=:4096:8 (read before argparse)")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 1:
        ap.error("need --steps >= 1 and --warmup >= 1 (the first warmup step compiles)")

    deterministic(args.seed)
    device = pick_device(args.device)
    check_toolchain(device)

    model = MLP(args.width).to(device).eval()
    gen = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.batch, args.width, generator=gen).to(device)
    compiled = torch.compile(model)

    times = []
    out = None
    with torch.no_grad():
        t0 = time.perf_counter()
        try:
            out = compiled(x)
            sync(device)
        except Exception as e:  # the first call compiles: a failure here means torch.compile is unusable
            traceback.print_exc(file=sys.stderr)
            unusable(f"the first compiled call failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        print(f"compile.py: first call (compilation) took {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        for i in range(1, args.warmup + args.steps):
            t0 = time.perf_counter()
            out = compiled(x)
            sync(device)
            t1 = time.perf_counter()
            if i >= args.warmup:
                times.append((t1 - t0) * 1e6)

    print(f"result output {sha256(tensor_bytes(out))}")
    print(f"steps {len(times)}")
    print(f"step_us {statistics.median(times):.3f}")
    print(f"mean_us {statistics.fmean(times):.3f}")


if __name__ == "__main__":
    main()
