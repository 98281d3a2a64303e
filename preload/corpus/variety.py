#!/usr/bin/env python3
"""A conformance sweep: many kinds of GPU work one process does, each checked bitwise against plain libcuda.

Where the other corpus programs time one kind of loop, this one runs a little of everything real programs reach
(each part seeded, deterministic without PyTorch's deterministic-algorithms mode, results hashed per part):

- `attention`: `scaled_dot_product_attention` in fp16 and bf16 through each backend PyTorch offers for it (flash,
  memory-efficient, math), causal and not
- `matmul`: fp32/fp16/bf16 GEMMs of odd shapes, batched, with bias epilogues (cuBLASLt), `torch._int_mm` (int8)
- `conv`: conv1d, conv3d, depthwise and transposed convolutions, channels-last fp16 under autocast (cuDNN)
- `rnn`: LSTM and GRU forward (cuDNN's RNN)
- `fft`: `rfft2`/`irfftn`/`fft` of power-of-two, odd and prime sizes (cuFFT)
- `linalg`: batched `inv`, `cholesky`, `qr`, `eigh`, `svd`, `solve` (cuSOLVER)
- `random`: `randn`, `rand`, `bernoulli`, `multinomial`, `randperm` from a seeded device generator
- `sorting`: `sort` (stable), `topk`, `unique`, `nonzero`, `masked_select`, `searchsorted`, `bincount`, `kthvalue`,
  `median`, `cumsum` of integers (host syncs in the middle of the work)
- `indexing`: embedding, `gather`, `index_select`, `index_put_`, boolean masks, `scatter` without accumulation,
  `take_along_dim` (kernels that carry device asserts)
- `reductions`: `var_mean`, `norm`, `logsumexp`, `softmax` over long rows, `layer_norm`, `group_norm`
- `graph`: a small MLP captured with `torch.cuda.graph` and replayed with new inputs
- `streams`: two streams ordered by events and `wait_stream`, non-blocking copies from and to pinned memory
- `triton`: kernels written with `triton.jit` (masked elementwise, a row reduction)
- `dtypes`: integer and bitwise ops, complex numbers, float8 and bfloat16 conversions
- `cupy`: a `cupy.RawKernel` compiled by NVRTC and CuPy's own elementwise and reduction kernels
- `threads`: four threads launching at once, each on a stream of its own
- `compiled`: `torch.compile(mode="reduce-overhead")`: Triton kernels replayed from CUDA graphs, eager work between

Allocator variants come from the environment, as for any program: `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`
(memory mapped with `cuMemCreate`/`cuMemMap`) or `backend:cudaMallocAsync` (`pairs.py --extra-env ...`).

`--only a,b` runs some of them. stdout: `result <part> <sha256>` per part (a part that raises prints `result
<part> error <exception type>`, so a part that fails only under the preload is a mismatch, not a crash), then
`steps <parts run>`, `step_us <µs of the whole sweep>` and `mean_us`. Diagnostics go to stderr.
"""

import argparse
import hashlib
import sys
import time
import traceback

import common  # first: sets what must be set before torch loads (common.py)
from common import deterministic, pick_device, sync, tensor_bytes
import torch
import torch.nn.functional as F


def digest(*tensors):
    h = hashlib.sha256()
    for t in tensors:
        if isinstance(t, torch.Tensor):
            h.update(str(t.dtype).encode())
            h.update(str(tuple(t.shape)).encode())
            if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                t = t.view(torch.uint8)
            elif t.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits
                t = t.view(torch.int16)
            h.update(tensor_bytes(t))
        else:
            h.update(repr(t).encode())
    return h.hexdigest()


def attention(dev):
    out = []
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = (torch.randn(2, 4, 77, 64, device=dev, dtype=dtype) for _ in range(3))
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
            for causal in (False, True):
                try:
                    with sdpa_kernel(backend):
                        out.append(F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                except RuntimeError as e:  # a backend this build or shape does not offer: the same on both sides
                    out.append(f"unavailable {backend} {type(e).__name__}")
    return out


def matmul(dev):
    out = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        a = torch.randn(129, 257, device=dev, dtype=dtype)
        b = torch.randn(257, 63, device=dev, dtype=dtype)
        bias = torch.randn(63, device=dev, dtype=dtype)
        out += [a @ b, torch.addmm(bias, a, b), F.linear(a, b.t().contiguous(), bias)]
        x = torch.randn(7, 33, 65, device=dev, dtype=dtype)
        y = torch.randn(7, 65, 31, device=dev, dtype=dtype)
        out.append(torch.bmm(x, y))
    a8 = torch.randint(-128, 127, (64, 128), device=dev, dtype=torch.int8)
    b8 = torch.randint(-128, 127, (128, 64), device=dev, dtype=torch.int8)
    try:
        out.append(torch._int_mm(a8, b8))
    except RuntimeError as e:
        out.append(f"int_mm unavailable {type(e).__name__}")
    return out


def conv(dev):
    out = []
    x1 = torch.randn(4, 8, 301, device=dev)
    out.append(torch.nn.Conv1d(8, 16, 5, padding=2, dilation=1).to(dev)(x1))
    x3 = torch.randn(2, 3, 9, 17, 17, device=dev)
    out.append(torch.nn.Conv3d(3, 6, 3, stride=(1, 2, 2)).to(dev)(x3))
    x2 = torch.randn(4, 32, 28, 28, device=dev)
    out.append(torch.nn.Conv2d(32, 32, 3, padding=1, groups=32).to(dev)(x2))
    out.append(torch.nn.ConvTranspose2d(32, 8, 4, stride=2, padding=1).to(dev)(x2))
    m = torch.nn.Conv2d(32, 64, 3, padding=1).to(dev).to(memory_format=torch.channels_last)
    with torch.autocast("cuda", dtype=torch.float16):
        out.append(m(x2.to(memory_format=torch.channels_last)))
    return out


def rnn(dev):
    out = []
    x = torch.randn(12, 5, 24, device=dev)
    lstm = torch.nn.LSTM(24, 48, num_layers=2, bidirectional=True).to(dev)
    y, (h, c) = lstm(x)
    out += [y, h, c]
    gru = torch.nn.GRU(24, 32, batch_first=True).to(dev)
    y, h = gru(x.transpose(0, 1).contiguous())
    out += [y, h]
    return out


def fft(dev):
    out = []
    for n in (64, 97, 250, 1009):
        x = torch.randn(3, n, device=dev)
        out.append(torch.fft.fft(x))
        out.append(torch.fft.irfft(torch.fft.rfft(x), n=n))
    img = torch.randn(2, 48, 80, device=dev)
    out.append(torch.fft.rfft2(img))
    out.append(torch.fft.irfftn(torch.fft.rfftn(img), s=img.shape[-2:]))
    return out


def linalg(dev):
    out = []
    a = torch.randn(6, 24, 24, device=dev, dtype=torch.float64)
    spd = a @ a.mT + 24 * torch.eye(24, device=dev, dtype=torch.float64)
    b = torch.randn(6, 24, 3, device=dev, dtype=torch.float64)
    out.append(torch.linalg.inv(spd))
    out.append(torch.linalg.cholesky(spd))
    out += list(torch.linalg.qr(a))
    out += list(torch.linalg.eigh(spd))
    out.append(torch.linalg.svdvals(a))
    out.append(torch.linalg.solve(spd, b))
    return out


def random(dev):
    g = torch.Generator(device=dev)
    g.manual_seed(1234)
    p = torch.rand(8, 50, device=dev, generator=g)
    return [
        torch.randn(1000, device=dev, generator=g),
        torch.rand(3, 333, device=dev, generator=g, dtype=torch.float16),
        torch.bernoulli(p, generator=g),
        torch.multinomial(p, 5, replacement=False, generator=g),
        torch.multinomial(p, 20, replacement=True, generator=g),
        torch.randperm(4099, device=dev, generator=g),
        torch.randint(0, 1000, (500,), device=dev, generator=g),
    ]


def sorting(dev):
    x = torch.randn(5, 1000, device=dev)
    ints = torch.randint(0, 50, (4000,), device=dev)
    vals, idx = torch.sort(x, dim=1, stable=True)
    tv, ti = torch.topk(x, 17, dim=1)
    uq, counts = torch.unique(ints, return_counts=True)
    nz = torch.nonzero(x > 1.0)
    ms = torch.masked_select(x, x < -1.5)
    edges = torch.linspace(-3, 3, 40, device=dev)
    ss = torch.searchsorted(edges, x.flatten())
    kv, ki = torch.kthvalue(x, 100, dim=1)
    med = torch.median(x, dim=1).values
    return [vals, idx, tv, ti, uq, counts, nz, ms, ss, torch.bincount(ints, minlength=60), kv, ki, med,
            torch.cumsum(ints, 0), int(nz.shape[0])]


def indexing(dev):
    emb = torch.nn.Embedding(1000, 32).to(dev)
    tok = torch.randint(0, 1000, (8, 40), device=dev)
    src = torch.randn(64, 128, device=dev)
    idx = torch.randint(0, 128, (64, 16), device=dev)
    rows = torch.randperm(64, device=dev)[:20]
    dst = torch.zeros(64, 128, device=dev)
    dst.index_put_((rows,), torch.ones(20, 128, device=dev))
    mask = src > 0.5
    masked = src.clone()
    masked[mask] = -1.0
    scattered = torch.zeros(64, 128, device=dev).scatter(1, torch.argsort(torch.rand(64, 128, device=dev), 1),
                                                          src)
    return [emb(tok), torch.gather(src, 1, idx), torch.index_select(src, 0, rows), dst, masked, scattered,
            torch.take_along_dim(src, idx, dim=1), src[rows][:, idx[0]]]


def reductions(dev):
    x = torch.randn(16, 4097, device=dev)
    v, m = torch.var_mean(x, dim=1)
    y = torch.randn(8, 32, 14, 14, device=dev)
    return [v, m, torch.linalg.vector_norm(x, dim=1), torch.logsumexp(x, 1), torch.softmax(x, 1),
            torch.log_softmax(x * 3, 0), F.layer_norm(x, (4097,)), F.group_norm(y, 8), x.amax(1), x.argmin(1),
            x.prod(1), x.sum()]


def graph(dev):
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).to(dev)
    static_in = torch.randn(32, 64, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm up on a side stream, as PyTorch asks before a capture
            model(static_in)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        static_out = model(static_in)
    outs = []
    for i in range(10):
        static_in.copy_(torch.randn(32, 64, device=dev) * (i + 1))
        g.replay()
        outs.append(static_out.clone())
    with torch.no_grad():
        outs.append(model(static_in))  # the same work eagerly, after the replays
    return outs


def streams(dev):
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    host = torch.arange(1 << 16, dtype=torch.float32).pin_memory()
    back = torch.empty_like(host).pin_memory()
    with torch.cuda.stream(s1):
        a = host.to(dev, non_blocking=True)
        a = torch.sin(a) * 2
        ev = torch.cuda.Event()
        ev.record(s1)
    with torch.cuda.stream(s2):
        s2.wait_event(ev)
        b = torch.cumsum(a.view(256, 256), 1)
        a.record_stream(s2)
    torch.cuda.current_stream().wait_stream(s2)
    c = b * 0.5 + 1
    back.copy_(c.flatten(), non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    q = s1.query() and s2.query()
    return [back, c, q]


def triton_part(dev):
    import triton
    import triton.language as tl

    @triton.jit
    def axpy(x_ptr, y_ptr, out_ptr, a, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m)
        y = tl.load(y_ptr + offs, mask=m)
        tl.store(out_ptr + offs, a * x + y, mask=m)

    @triton.jit
    def row_max(x_ptr, out_ptr, cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * cols + offs, mask=offs < cols, other=-float("inf"))
        tl.store(out_ptr + row, tl.max(x, axis=0))

    n = 10007
    x, y = torch.randn(n, device=dev), torch.randn(n, device=dev)
    o = torch.empty_like(x)
    axpy[(triton.cdiv(n, 1024),)](x, y, o, 2.5, n, BLOCK=1024)
    m = torch.randn(37, 300, device=dev)
    r = torch.empty(37, device=dev)
    row_max[(37,)](m, r, 300, BLOCK=512)
    return [o, r]


def dtypes(dev):
    i = torch.randint(-(1 << 30), 1 << 30, (4096,), device=dev, dtype=torch.int64)
    f = torch.randn(4096, device=dev)
    z = torch.complex(f, f.flip(0))
    out = [(i ^ (i >> 3)) & 0xFFFF, i.to(torch.int16), i % 97, torch.bitwise_not(i.to(torch.int32)),
           z * z.conj() + z.exp(), torch.angle(z), f.to(torch.bfloat16), f.to(torch.float16).to(torch.float64)]
    for f8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        out.append(f.to(f8))
    return out


def threads(dev):
    import threading
    results = [None] * 4
    start = threading.Barrier(4)

    def work(i):
        # Each thread its own stream, launching while the others do; every thread's result is its own.
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            start.wait()
            x = torch.full((4096,), float(i + 1), device=dev)
            for k in range(200):
                x = torch.sin(x) * 1.5 + k * 1e-3
            results[i] = x.sum()
        s.synchronize()

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return results


def compiled(dev):
    # torch.compile's "reduce-overhead" mode: Triton kernels replayed from CUDA graphs (cudagraph trees), with eager
    # work between the calls.
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(96, 192), torch.nn.GELU(), torch.nn.LayerNorm(192),
                                torch.nn.Linear(192, 96)).to(dev)
    fn = torch.compile(model, mode="reduce-overhead")
    out = []
    with torch.no_grad():
        for i in range(6):
            x = torch.randn(48, 96, device=dev) * (i + 1)
            y = fn(x)
            out.append(y.clone() + torch.cos(x))
    return out


def cupy_part(dev):
    import cupy as cp
    kernel = cp.RawKernel(r"""
    extern "C" __global__ void mix(const float* x, float* y, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i < n) y[i] = x[i] * x[i] - 0.5f * x[(i * 7) % n];
    }""", "mix")
    with cp.cuda.Device(dev.index or 0):
        rng = cp.random.RandomState(seed=7)
        x = rng.standard_normal(5000, dtype=cp.float32)
        y = cp.empty_like(x)
        kernel(((5000 + 255) // 256,), (256,), (x, y, cp.int32(5000)))
        z = cp.cumsum(cp.sort(y)) + cp.tanh(x).sum()
        return [torch.as_tensor(cp.asnumpy(y)), torch.as_tensor(cp.asnumpy(z))]


PARTS = {
    "attention": attention, "matmul": matmul, "conv": conv, "rnn": rnn, "fft": fft, "linalg": linalg,
    "random": random, "sorting": sorting, "indexing": indexing, "reductions": reductions, "graph": graph,
    "streams": streams, "triton": triton_part, "dtypes": dtypes, "cupy": cupy_part, "threads": threads,
    "compiled": compiled,
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", default="", help="comma-separated parts (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="each part runs this many times; every round must agree")
    ap.add_argument("--steps", type=int, default=None, help="ignored (the runner's common argument)")
    ap.add_argument("--warmup", type=int, default=None, help="ignored (the runner's common argument)")
    ap.add_argument("--deterministic-algorithms", action="store_true")
    args = ap.parse_args()
    dev = pick_device(args.device)
    names = [n for n in args.only.split(",") if n] or list(PARTS)
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        print(f"variety.py: unknown parts {unknown}; known: {', '.join(PARTS)}", file=sys.stderr)
        sys.exit(2)
    start = time.perf_counter()
    for name in names:
        seen = set()
        for r in range(args.rounds):
            deterministic(args.seed)
            try:
                d = digest(*PARTS[name](dev))
                sync(dev)
            except Exception as e:  # reported as the part's result, so both sides are compared
                traceback.print_exc(file=sys.stderr)
                d = f"error {type(e).__name__}"
            seen.add(d)
        print(f"result {name} {' '.join(sorted(seen))}")
        sys.stdout.flush()
    took = time.perf_counter() - start
    print(f"steps {len(names)}")
    print(f"step_us {took * 1e6:.3f}")
    print(f"mean_us {took * 1e6 / max(1, len(names)):.3f}")


if __name__ == "__main__":
    main()
