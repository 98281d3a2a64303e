"""Triton kernels for APEX's conformance test (run on the GPU machine at test time by tests/gpu_conformance.rs).

Compiles and runs each kernel with Triton itself, then writes what APEX needs to run the same cubin and compare:
OUT/manifest.txt, one block per kernel:
    kernel NAME cubin=FILE warps=N shared=BYTES grid=X,Y,Z scratch=GLOBAL,PROFILE
    arg ptr FILE          (an input buffer's bytes)
    arg out FILE EXPECT   (an output buffer: its initial bytes, and Triton's result)
    arg i32 VALUE | arg f32 VALUE
    end
Arguments are the kernel's non-constexpr parameters in order; Triton appends scratch pointers after them.
"""
import os
import sys

import torch
import triton
import triton.language as tl

OUT = sys.argv[1]
os.makedirs(OUT, exist_ok=True)
torch.manual_seed(1234)
manifest = []


def save(name, t):
    path = os.path.join(OUT, name)
    t.detach().cpu().contiguous().view(torch.uint8).numpy().tofile(path)
    return name


def record(tag, compiled, grid, args):
    """args: list of ('ptr', tensor) | ('out', tensor_before, tensor_after) | ('i32', v) | ('f32', v)."""
    cubin = f"{tag}.cubin"
    with open(os.path.join(OUT, cubin), "wb") as f:
        f.write(compiled.asm["cubin"])
    md = compiled.metadata
    g = list(grid) + [1] * (3 - len(grid))
    scratch = (getattr(md, "global_scratch_size", 0), getattr(md, "profile_scratch_size", 0))
    lines = [f"kernel {md.name} cubin={cubin} warps={md.num_warps} shared={md.shared} "
             f"grid={g[0]},{g[1]},{g[2]} scratch={scratch[0]},{scratch[1]}"]
    for i, a in enumerate(args):
        if a[0] == "ptr":
            lines.append(f"arg ptr {save(f'{tag}.in{i}', a[1])}")
        elif a[0] == "out":
            lines.append(f"arg out {save(f'{tag}.init{i}', a[1])} {save(f'{tag}.expect{i}', a[2])}")
        else:
            lines.append(f"arg {a[0]} {a[1]}")
    lines.append("end")
    manifest.extend(lines)


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 1.5 + tl.load(y_ptr + offs, mask=mask), mask=mask)


@triton.jit
def softmax_kernel(out_ptr, in_ptr, stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(in_ptr + row * stride + cols, mask=mask, other=-float("inf"))
    x = x - tl.max(x, axis=0)
    e = tl.exp(x)
    tl.store(out_ptr + row * stride + cols, e / tl.sum(e, axis=0), mask=mask)


@triton.jit
def matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn, scm, scn,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * sam + (k + rk)[None, :] * sak)
        b = tl.load(b_ptr + (k + rk)[:, None] * sbk + rn[None, :] * sbn)
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * scm + rn[None, :] * scn, acc)


@triton.jit
def histogram_kernel(x_ptr, hist_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask, other=0)
    tl.atomic_add(hist_ptr + (v % 64), 1, mask=mask)


dev = "cuda"
# elementwise, two warp counts
for warps in (4, 8):
    n = 98_432 + 13
    x = torch.randn(n, device=dev)
    y = torch.randn(n, device=dev)
    out = torch.zeros(n, device=dev)
    before = out.clone()
    grid = (triton.cdiv(n, 1024),)
    k = add_kernel[grid](x, y, out, n, BLOCK=1024, num_warps=warps)
    torch.cuda.synchronize()
    record(f"add_w{warps}", k, grid, [("ptr", x), ("ptr", y), ("out", before, out), ("i32", n)])

# row reductions
rows, cols = 128, 781
inp = torch.randn(rows, cols, device=dev)
out = torch.zeros_like(inp)
before = out.clone()
k = softmax_kernel[(rows,)](out, inp, inp.stride(0), cols, BLOCK=1024, num_warps=8)
torch.cuda.synchronize()
record("softmax", k, (rows,), [("out", before, out), ("ptr", inp), ("i32", inp.stride(0)), ("i32", cols)])

# tl.dot matmuls (wgmma on Hopper), several tile shapes, warps and pipeline depths
for (bm, bn, bk, warps, stages) in ((128, 128, 64, 8, 3), (64, 64, 32, 4, 2), (128, 64, 64, 4, 4)):
    M = N = K = 256
    a = torch.randn(M, K, device=dev, dtype=torch.float16)
    b = torch.randn(K, N, device=dev, dtype=torch.float16)
    c = torch.zeros(M, N, device=dev, dtype=torch.float32)
    before = c.clone()
    grid = (M // bm, N // bn)
    k = matmul_kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                            c.stride(0), c.stride(1), BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    torch.cuda.synchronize()
    ref = (a.float() @ b.float())
    assert torch.allclose(c, ref, atol=1e-1, rtol=1e-2), "Triton's own matmul is off"
    record(f"matmul_{bm}x{bn}x{bk}_w{warps}_s{stages}", k, grid,
           [("ptr", a), ("ptr", b), ("out", before, c), ("i32", M), ("i32", N), ("i32", K),
            ("i32", a.stride(0)), ("i32", a.stride(1)), ("i32", b.stride(0)), ("i32", b.stride(1)),
            ("i32", c.stride(0)), ("i32", c.stride(1))])

# atomics
n = 100_000 + 7
x = torch.randint(0, 1 << 20, (n,), device=dev, dtype=torch.int32)
hist = torch.zeros(64, device=dev, dtype=torch.int32)
before = hist.clone()
grid = (triton.cdiv(n, 512),)
k = histogram_kernel[grid](x, hist, n, BLOCK=512, num_warps=4)
torch.cuda.synchronize()
record("histogram", k, grid, [("ptr", x), ("out", before, hist), ("i32", n)])

with open(os.path.join(OUT, "manifest.txt"), "w") as f:
    f.write("\n".join(manifest) + "\n")
print(f"triton {triton.__version__}: {sum(1 for l in manifest if l.startswith('kernel'))} kernels in {OUT}")
