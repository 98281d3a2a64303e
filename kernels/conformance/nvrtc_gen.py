#!/usr/bin/env python3
"""Compiles CUDA C to PTX with NVRTC (libnvrtc, loaded through ctypes), as a runtime or a kernel crate would.

Used by tests/gpu_conformance.rs at test time on the GPU machine:
    python3 nvrtc_gen.py SOURCE.cu OUT.ptx [ARCH, default compute_90]
Host-only lines (#include) are dropped: NVRTC compiles device code without the toolkit's include path.
"""
import ctypes
import ctypes.util
import glob
import os
import sys


def load_nvrtc():
    names = []
    found = ctypes.util.find_library("nvrtc")
    if found:
        names.append(found)
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            names += sorted(glob.glob(os.path.join(root, "lib64", "libnvrtc.so*")), reverse=True)
    names += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    for n in names:
        try:
            return ctypes.CDLL(n)
        except OSError:
            continue
    sys.exit("libnvrtc not found (set CUDA_HOME)")


def main():
    src_path, out_path = sys.argv[1], sys.argv[2]
    arch = sys.argv[3] if len(sys.argv) > 3 else "compute_90"
    src = "".join(l for l in open(src_path) if not l.lstrip().startswith("#include"))
    nvrtc = load_nvrtc()
    prog = ctypes.c_void_p()
    check = lambda what, r: r == 0 or sys.exit(f"{what} failed: {r}")
    check("nvrtcCreateProgram", nvrtc.nvrtcCreateProgram(
        ctypes.byref(prog), src.encode(), os.path.basename(src_path).encode(), 0, None, None))
    opts = [f"--gpu-architecture={arch}".encode(), b"-default-device"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    r = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if r != 0:
        sys.exit(f"nvrtcCompileProgram failed ({r}):\n{log.value.decode(errors='replace')}")
    check("nvrtcGetPTXSize", nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size)))
    ptx = ctypes.create_string_buffer(size.value)
    check("nvrtcGetPTX", nvrtc.nvrtcGetPTX(prog, ptx))
    with open(out_path, "wb") as f:
        f.write(ptx.value + b"\0")
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    print(f"NVRTC {major.value}.{minor.value}: {len(ptx.value)} bytes of PTX for {arch}")


if __name__ == "__main__":
    main()
