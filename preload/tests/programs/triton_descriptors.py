"""Triton kernels on Hopper's tensor memory accelerator: tensor descriptors made on the host (a CUtensorMap passed by
value as a __grid_constant__ parameter, whose address the kernel takes) for a copy and a wgmma matmul, and on the
device (tl.make_tensor_descriptor, with the global scratch buffer Triton allocates per launch). Prints `result`
lines (hashes of every output) for the runs with and without the preload to be compared."""
import hashlib
import sys

try:
    import torch
    import triton
    import triton.language as tl
except Exception as e:  # the machine has no PyTorch or Triton
    print(f"SKIP cannot import torch and triton: {e}")
    sys.exit(0)
if not torch.cuda.is_available():
    print("SKIP torch.cuda.is_available() is False")
    sys.exit(0)
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception as e:
    print(f"SKIP this Triton ({triton.__version__}) has no host tensor descriptors: {e}")
    sys.exit(0)


def digest(t):
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


@triton.jit
def desc_copy(in_desc, out_desc, BM: tl.constexpr, BN: tl.constexpr):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    x = in_desc.load([pm * BM, pn * BN])
    out_desc.store([pm * BM, pn * BN], x * 2 + 1)


@triton.jit
def desc_matmul(a_desc, b_desc, c_desc, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = a_desc.load([pm * BM, k])
        b = b_desc.load([k, pn * BN])
        acc = tl.dot(a, b, acc)
    c_desc.store([pm * BM, pn * BN], acc.to(tl.float16))


@triton.jit
def device_desc(x_ptr, y_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
    xd = tl.make_tensor_descriptor(x_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    yd = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    v = xd.load([pm * BM, pn * BN])
    yd.store([pm * BM, pn * BN], v * v - 3)


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    torch.manual_seed(0)
    dev = "cuda"
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    M, N, K = 256, 256, 512
    for it in range(rounds):
        x = torch.randn(M, N, device=dev)
        y = torch.empty_like(x)
        desc_copy[(M // 64, N // 64)](TensorDescriptor.from_tensor(x, [64, 64]),
                                      TensorDescriptor.from_tensor(y, [64, 64]), BM=64, BN=64)
        torch.cuda.synchronize()
        print("result desc_copy", it, digest(y), bool(torch.equal(y, x * 2 + 1)))
        a = torch.randn(M, K, device=dev, dtype=torch.float16)
        b = torch.randn(K, N, device=dev, dtype=torch.float16)
        c = torch.empty(M, N, device=dev, dtype=torch.float16)
        desc_matmul[(M // 128, N // 128)](TensorDescriptor.from_tensor(a, [128, 64]),
                                          TensorDescriptor.from_tensor(b, [64, 128]),
                                          TensorDescriptor.from_tensor(c, [128, 128]), K, BM=128, BN=128, BK=64)
        torch.cuda.synchronize()
        err = float((c.float() - a.float() @ b.float()).abs().max())
        print("result desc_matmul", it, digest(c), err < 0.5)
        x = torch.randn(M, N, device=dev)
        y = torch.empty_like(x)
        device_desc[(M // 32, N // 64)](x, y, M, N, BM=32, BN=64)
        torch.cuda.synchronize()
        close = bool(torch.allclose(y, x * x - 3, rtol=1e-5, atol=1e-5))
        print("result device_desc", it, digest(y), close)
    print("result error", torch.cuda.get_device_name(), "ok")


main()
