//! APEX attached to a CUDA context (issue 12; run with `--include-ignored` on an NVIDIA GPU with libcuda, and
//! libcublas on the loader's path for the cuBLAS test): APEX kernels on `cuMemAlloc` memory, CUDA still working
//! beside APEX's channel, and ordering with CUDA streams both ways without the CPU.

use std::ffi::c_void;
use std::process::Command;
use std::time::{Duration, Instant};

use apex::{Arg, Backend, Gpu, LaunchConfig};
use cudarc::cublas::sys as cublas;
use cudarc::driver::sys as cu;

const TEST_CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const T: Duration = Duration::from_secs(20);

fn ck(what: &str, r: cu::CUresult) {
    assert_eq!(r, cu::CUresult::CUDA_SUCCESS, "{what}");
}

/// Makes device 0's primary context current on this thread, as a CUDA program would have it.
fn cuda_context() -> cu::CUcontext {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: plain driver calls with out-pointers to locals.
    unsafe {
        ck("cuInit", cu::cuInit(0));
        ck(
            "cuDevicePrimaryCtxRetain",
            cu::cuDevicePrimaryCtxRetain(&mut ctx, 0),
        );
        ck("cuCtxSetCurrent", cu::cuCtxSetCurrent(ctx));
    }
    ctx
}

fn cuda_alloc(bytes: usize) -> u64 {
    let mut p = 0;
    // SAFETY: out-pointer to a local; a context is current.
    ck("cuMemAlloc", unsafe { cu::cuMemAlloc_v2(&mut p, bytes) });
    p
}

fn htod<T: Copy>(dst: u64, src: &[T]) {
    // SAFETY: `dst` was allocated with at least this many bytes.
    ck("cuMemcpyHtoD", unsafe {
        cu::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), std::mem::size_of_val(src))
    });
}

fn dtoh<T: Copy + Default>(src: u64, n: usize) -> Vec<T> {
    let mut v = vec![T::default(); n];
    // SAFETY: `src` holds at least n elements.
    ck("cuMemcpyDtoH", unsafe {
        cu::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), src, n * std::mem::size_of::<T>())
    });
    v
}

fn stream() -> cu::CUstream {
    let mut s = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    ck("cuStreamCreate", unsafe {
        cu::cuStreamCreate(&mut s, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
    });
    s
}

/// `image` loaded by CUDA, and its kernel `name`.
fn cuda_function(image: &[u8], name: &std::ffi::CStr) -> (cu::CUmodule, cu::CUfunction) {
    let mut m = std::ptr::null_mut();
    let mut f = std::ptr::null_mut();
    // SAFETY: a valid cubin; out-pointers to locals.
    unsafe {
        ck(
            "cuModuleLoadData",
            cu::cuModuleLoadData(&mut m, image.as_ptr().cast()),
        );
        ck(
            "cuModuleGetFunction",
            cu::cuModuleGetFunction(&mut f, m, name.as_ptr()),
        );
    }
    (m, f)
}

/// A CUDA module of its own: CUDA's launches must keep working beside APEX's channel.
fn cuda_saxpy() -> cu::CUfunction {
    cuda_function(TEST_CUBIN, c"saxpy").1
}

fn cuda_launch_saxpy(f: cu::CUfunction, s: cu::CUstream, a: f32, x: u64, y: u64, n: u32) {
    let (mut a, mut x, mut y, mut n) = (a, x, y, n);
    let mut args: [*mut c_void; 4] = [
        (&mut a as *mut f32).cast(),
        (&mut x as *mut u64).cast(),
        (&mut y as *mut u64).cast(),
        (&mut n as *mut u32).cast(),
    ];
    // SAFETY: saxpy(float, const float*, float*, uint32_t) with buffers of n floats.
    ck("cuLaunchKernel", unsafe {
        cu::cuLaunchKernel(
            f,
            n.div_ceil(256),
            1,
            1,
            256,
            1,
            1,
            0,
            s,
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    });
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn apex_kernels_run_on_cuda_memory_in_cudas_context() {
    let _ctx = cuda_context();
    let n = 1u32 << 20;
    let x = cuda_alloc(n as usize * 4);
    let y = cuda_alloc(n as usize * 4);
    let xs: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let ys: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    htod(x, &xs);
    htod(y, &ys);
    let t = Instant::now();
    let gpu = Gpu::attach_cuda().expect("attach to the CUDA context");
    eprintln!("attached in {:?}: {}", t.elapsed(), gpu.selection());
    assert_eq!(gpu.backend(), Backend::Direct, "{}", gpu.selection());
    assert!(gpu.is_attached());
    let saxpy = gpu
        .load_module(TEST_CUBIN)
        .unwrap()
        .kernel("saxpy")
        .unwrap();
    let mut q = gpu.queue().unwrap();
    // A polled queue would park CUDA's channel group at its gate: refused, with the reason.
    let e = gpu
        .queue_with(apex::QueueOptions::default().polled(true))
        .unwrap_err()
        .to_string();
    assert!(e.contains("polled submission on a GPU attached"), "{e}");
    // SAFETY: x and y hold n floats (CUDA allocated them in the context APEX joined).
    unsafe {
        q.launch(
            &saxpy,
            &LaunchConfig::linear(n / 256, 256),
            &[Arg::F32(2.0), Arg::Ptr(x), Arg::Ptr(y), Arg::U32(n)],
        )
    }
    .unwrap()
    .wait(T)
    .unwrap();
    let got: Vec<f32> = dtoh(y, n as usize);
    for i in 0..n as usize {
        assert_eq!(got[i], 2.0 * xs[i] + ys[i], "element {i}");
    }
    // APEX's own buffer is in the same address space: a CUDA kernel reads it.
    let own = gpu.alloc(u64::from(n) * 4).unwrap();
    q.upload(&gpu, &own, 0, &vec![1u8; n as usize * 4]).unwrap();
    let f = cuda_saxpy();
    let s = stream();
    // SAFETY: a stream of the attached context.
    unsafe { q.make_cuda_stream_wait(s) }.unwrap();
    cuda_launch_saxpy(f, s, 1.0, own.device_ptr(), y, n);
    // SAFETY: a stream of the current context.
    ck("cuStreamSynchronize", unsafe { cu::cuStreamSynchronize(s) });
    let after: Vec<f32> = dtoh(y, n as usize);
    let one = f32::from_le_bytes([1; 4]);
    for i in (0..n as usize).step_by(4099) {
        assert_eq!(
            after[i],
            got[i] + one,
            "CUDA reading APEX's buffer, element {i}"
        );
    }
    drop(q);
    drop(gpu);
    // CUDA keeps working after APEX's channel is gone.
    cuda_launch_saxpy(f, s, 0.0, x, y, n);
    // SAFETY: as above.
    ck("cuCtxSynchronize", unsafe { cu::cuCtxSynchronize() });
}

/// Builds the APEX side of the ping-pong: out = (c + 1) mod 1024, and hist[k] = out[0].
fn step_kernel() -> Vec<u8> {
    let dir = std::env::temp_dir().join(format!("apex-attach-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("step.cu");
    std::fs::write(
        &src,
        r#"extern "C" __global__ void step(const float *c, float *x, float *hist, int k, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = c[i] + 1.0f;
        if (v >= 1024.0f) v -= 1024.0f;
        x[i] = v;
        if (i == 0) hist[k] = v;
    }
}"#,
    )
    .unwrap();
    let out = dir.join("step.cubin");
    let st = Command::new("nvcc")
        .args(["-cubin", "-arch=sm_90", "-o"])
        .arg(&out)
        .arg(&src)
        .status()
        .expect("nvcc");
    assert!(st.success());
    std::fs::read(&out).unwrap()
}

/// 10^4 rounds of: a cuBLAS GEMM on a CUDA stream (C = X·P, P a permutation, exact in fp32), then an APEX launch
/// reading C and writing the next X, each side waiting for the other on the GPU only. Every round's value is
/// checked against the CPU.
#[test]
#[ignore = "needs an NVIDIA GPU, nvcc and libcublas"]
fn cublas_and_apex_alternate_ten_thousand_times() {
    let _ctx = cuda_context();
    let n = 32usize;
    let rounds = 10_000usize;
    let perm: Vec<usize> = (0..n).map(|j| (j * 7 + 3) % n).collect();
    let mut p = vec![0f32; n * n];
    for j in 0..n {
        p[perm[j] + j * n] = 1.0; // column-major: P[perm[j], j] = 1, so (X·P)[i, j] = X[i, perm[j]]
    }
    let x0: Vec<f32> = (0..n * n).map(|i| (i % 1000) as f32).collect();
    let (x, pm, c, hist) = (
        cuda_alloc(n * n * 4),
        cuda_alloc(n * n * 4),
        cuda_alloc(n * n * 4),
        cuda_alloc(rounds * 4),
    );
    htod(x, &x0);
    htod(pm, &p);
    let s = stream();
    let mut handle = std::ptr::null_mut();
    // SAFETY: cuBLAS calls with out-pointers to locals and a stream of the current context.
    unsafe {
        assert_eq!(
            cublas::cublasCreate_v2(&mut handle),
            cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS
        );
        assert_eq!(
            cublas::cublasSetStream_v2(handle, s.cast()),
            cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS
        );
    }
    let gpu = Gpu::attach_cuda().expect("attach");
    assert_eq!(gpu.backend(), Backend::Direct, "{}", gpu.selection());
    let step = gpu
        .load_module(&step_kernel())
        .unwrap()
        .kernel("step")
        .unwrap();
    let mut q = gpu.queue().unwrap();
    let t = Instant::now();
    for k in 0..rounds {
        let (one, zero) = (1f32, 0f32);
        // SAFETY: n×n column-major matrices in CUDA memory.
        let r = unsafe {
            cublas::cublasSgemm_v2(
                handle,
                cublas::cublasOperation_t::CUBLAS_OP_N,
                cublas::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                n as i32,
                n as i32,
                &one,
                x as *const f32,
                n as i32,
                pm as *const f32,
                n as i32,
                &zero,
                c as *mut f32,
                n as i32,
            )
        };
        assert_eq!(
            r,
            cublas::cublasStatus_t::CUBLAS_STATUS_SUCCESS,
            "round {k}"
        );
        // SAFETY: a stream of the attached context.
        unsafe { q.wait_for_cuda_stream(s) }.unwrap();
        // SAFETY: c, x hold n×n floats, hist `rounds`.
        unsafe {
            q.launch(
                &step,
                &LaunchConfig::linear(((n * n) as u32).div_ceil(256), 256),
                &[
                    Arg::Ptr(c),
                    Arg::Ptr(x),
                    Arg::Ptr(hist),
                    Arg::I32(k as i32),
                    Arg::I32((n * n) as i32),
                ],
            )
        }
        .unwrap();
        // SAFETY: a stream of the attached context.
        unsafe { q.make_cuda_stream_wait(s) }.unwrap();
    }
    // SAFETY: a stream of the current context.
    ck("cuStreamSynchronize", unsafe { cu::cuStreamSynchronize(s) });
    q.synchronize().unwrap();
    let took = t.elapsed();
    // CPU reference, every round.
    let mut xr = x0.clone();
    let mut want_hist = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let mut next = vec![0f32; n * n];
        for j in 0..n {
            for i in 0..n {
                let v = xr[i + perm[j] * n] + 1.0;
                next[i + j * n] = if v >= 1024.0 { v - 1024.0 } else { v };
            }
        }
        want_hist.push(next[0]);
        xr = next;
    }
    let got_hist: Vec<f32> = dtoh(hist, rounds);
    for k in 0..rounds {
        assert_eq!(got_hist[k], want_hist[k], "round {k}");
    }
    assert_eq!(dtoh::<f32>(x, n * n), xr, "final matrix");
    eprintln!(
        "{rounds} cuBLAS GEMM + APEX launch rounds, ordered both ways on the GPU: {:?} ({:.1} us per round)",
        took,
        took.as_secs_f64() * 1e6 / rounds as f64
    );
    // SAFETY: the handle made above.
    unsafe { cublas::cublasDestroy_v2(handle) };
}

/// Device memory of every kind a CUDA program (PyTorch's caching allocator with and without expandable
/// segments, `cudaMallocAsync` pools, managed memory, mapped pinned host memory) hands a kernel.
enum CudaMemory {
    Alloc(u64),
    /// `cuMemCreate` + `cuMemAddressReserve` + `cuMemMap` + `cuMemSetAccess` (PyTorch's expandable segments).
    Vmm {
        va: u64,
        size: usize,
        handle: cu::CUmemGenericAllocationHandle,
    },
    /// `cuMemAllocAsync` from the device's default pool (the `cudaMallocAsync` allocator).
    Pool(u64),
    /// `cuMemAllocManaged`: pages move on demand, faults serviced by UVM in CUDA's address space.
    Managed(u64),
    /// `cuMemHostAlloc(DEVICEMAP)`: pinned host memory the GPU reaches over PCIe at the same address.
    Host(*mut c_void),
}

impl CudaMemory {
    fn new(kind: &str, bytes: usize, s: cu::CUstream) -> CudaMemory {
        // SAFETY: driver calls with out-pointers to locals; a context is current.
        unsafe {
            match kind {
                "cuMemAlloc" => CudaMemory::Alloc(cuda_alloc(bytes)),
                "cuMemCreate" => {
                    let prop = cu::CUmemAllocationProp {
                        type_: cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
                        location: cu::CUmemLocation {
                            type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                            id: 0,
                        },
                        ..std::mem::zeroed()
                    };
                    let mut gran = 0usize;
                    ck(
                        "cuMemGetAllocationGranularity",
                        cu::cuMemGetAllocationGranularity(
                            &mut gran,
                            &prop,
                            cu::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
                        ),
                    );
                    let size = bytes.next_multiple_of(gran);
                    let mut handle = 0;
                    ck("cuMemCreate", cu::cuMemCreate(&mut handle, size, &prop, 0));
                    let mut va = 0;
                    ck(
                        "cuMemAddressReserve",
                        cu::cuMemAddressReserve(&mut va, size, 0, 0, 0),
                    );
                    ck("cuMemMap", cu::cuMemMap(va, size, 0, handle, 0));
                    let access = cu::CUmemAccessDesc {
                        location: prop.location,
                        flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                    };
                    ck("cuMemSetAccess", cu::cuMemSetAccess(va, size, &access, 1));
                    CudaMemory::Vmm { va, size, handle }
                }
                "cuMemAllocAsync" => {
                    let mut p = 0;
                    ck("cuMemAllocAsync", cu::cuMemAllocAsync(&mut p, bytes, s));
                    ck("cuStreamSynchronize", cu::cuStreamSynchronize(s));
                    CudaMemory::Pool(p)
                }
                "cuMemAllocManaged" => {
                    let mut p = 0;
                    ck(
                        "cuMemAllocManaged",
                        cu::cuMemAllocManaged(
                            &mut p,
                            bytes,
                            cu::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL as u32,
                        ),
                    );
                    CudaMemory::Managed(p)
                }
                "cuMemHostAlloc" => {
                    let mut p = std::ptr::null_mut();
                    ck(
                        "cuMemHostAlloc",
                        cu::cuMemHostAlloc(&mut p, bytes, cu::CU_MEMHOSTALLOC_DEVICEMAP),
                    );
                    CudaMemory::Host(p)
                }
                other => panic!("unknown memory kind {other}"),
            }
        }
    }

    fn ptr(&self) -> u64 {
        match *self {
            CudaMemory::Alloc(p) | CudaMemory::Pool(p) | CudaMemory::Managed(p) => p,
            CudaMemory::Vmm { va, .. } => va,
            CudaMemory::Host(p) => p as u64,
        }
    }

    fn free(self, s: cu::CUstream) {
        // SAFETY: each was allocated above and is no longer used by any queue.
        unsafe {
            match self {
                CudaMemory::Alloc(p) | CudaMemory::Managed(p) => {
                    ck("cuMemFree", cu::cuMemFree_v2(p))
                }
                CudaMemory::Pool(p) => {
                    ck("cuMemFreeAsync", cu::cuMemFreeAsync(p, s));
                    ck("cuStreamSynchronize", cu::cuStreamSynchronize(s));
                }
                CudaMemory::Vmm { va, size, handle } => {
                    ck("cuMemUnmap", cu::cuMemUnmap(va, size));
                    ck("cuMemAddressFree", cu::cuMemAddressFree(va, size));
                    ck("cuMemRelease", cu::cuMemRelease(handle));
                }
                CudaMemory::Host(p) => ck("cuMemFreeHost", cu::cuMemFreeHost(p)),
            }
        }
    }
}

const MEMORY_KINDS: [&str; 5] = [
    "cuMemAlloc",
    "cuMemCreate",
    "cuMemAllocAsync",
    "cuMemAllocManaged",
    "cuMemHostAlloc",
];

/// `y = a·x + y` by APEX's attached queue on two buffers of `kind`, filled and read back by CUDA, every element
/// checked.
fn saxpy_on(gpu: &Gpu, q: &mut apex::Queue, kind: &str, s: cu::CUstream, n: u32, seed: u32) {
    let saxpy = gpu
        .load_module(TEST_CUBIN)
        .unwrap()
        .kernel("saxpy")
        .unwrap();
    let x = CudaMemory::new(kind, n as usize * 4, s);
    let y = CudaMemory::new(kind, n as usize * 4, s);
    let xs: Vec<f32> = (0..n).map(|i| ((i ^ seed) % 1000) as f32).collect();
    let ys: Vec<f32> = (0..n).map(|i| ((i + seed) % 7) as f32).collect();
    htod(x.ptr(), &xs);
    htod(y.ptr(), &ys);
    // cuMemcpyHtoD from pageable memory returns before its DMA lands (CUDA's documented behaviour): the APEX
    // queue waits, on the GPU, for the legacy default stream the copies went to.
    // SAFETY: the null stream of the attached context.
    unsafe { q.wait_for_cuda_stream(std::ptr::null_mut()) }
        .unwrap_or_else(|e| panic!("waiting for the default stream: {e}"));
    // SAFETY: x and y hold n floats in the context APEX is attached to.
    unsafe {
        q.launch(
            &saxpy,
            &LaunchConfig::linear(n.div_ceil(256), 256),
            &[
                Arg::F32(3.0),
                Arg::Ptr(x.ptr()),
                Arg::Ptr(y.ptr()),
                Arg::U32(n),
            ],
        )
    }
    .unwrap_or_else(|e| panic!("launch on {kind} memory: {e}"))
    .wait(T)
    .unwrap_or_else(|e| panic!("kernel on {kind} memory: {e}"));
    let got: Vec<f32> = dtoh(y.ptr(), n as usize);
    for i in 0..n as usize {
        assert_eq!(got[i], 3.0 * xs[i] + ys[i], "{kind} memory, element {i}");
    }
    x.free(s);
    y.free(s);
}

/// APEX kernels on every kind of memory a CUDA program allocates, before and after APEX attached (CUDA's later
/// allocations must not land where APEX's address ranges are).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn apex_kernels_run_on_every_kind_of_cuda_memory() {
    let _ctx = cuda_context();
    let s = stream();
    // Some memory exists before attaching, as in a program that has been running.
    let before = CudaMemory::new("cuMemAlloc", 64 << 20, s);
    let gpu = Gpu::attach_cuda().expect("attach");
    assert_eq!(gpu.backend(), Backend::Direct, "{}", gpu.selection());
    let mut q = gpu.queue().unwrap();
    for (i, kind) in MEMORY_KINDS.iter().enumerate() {
        saxpy_on(&gpu, &mut q, kind, s, (1 << 20) + 77, i as u32);
        eprintln!("APEX kernel on {kind} memory: checked");
    }
    // Many CUDA allocations after attaching, then APEX on the last one.
    let many: Vec<u64> = (0..64).map(|_| cuda_alloc(4 << 20)).collect();
    saxpy_on(&gpu, &mut q, "cuMemAlloc", s, 1 << 16, 99);
    for p in many {
        // SAFETY: allocated above, unused.
        ck("cuMemFree", unsafe { cu::cuMemFree_v2(p) });
    }
    before.free(s);
}

/// A context made with `cuCtxCreate` (not the primary one), while the primary context of the same GPU also
/// exists and holds memory: APEX joins the current context, whose memory its kernels then reach.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn attach_joins_the_current_context_among_several_on_one_gpu() {
    let primary = cuda_context();
    let s0 = stream();
    let in_primary = CudaMemory::new("cuMemAlloc", 1 << 20, s0);
    let mut created = std::ptr::null_mut();
    // SAFETY: out-pointer to a local, no creation parameters; device 0 exists (the primary context is on it).
    ck("cuCtxCreate", unsafe {
        cu::cuCtxCreate_v4(&mut created, std::ptr::null_mut(), 0, 0)
    });
    // SAFETY: the context just made.
    ck("cuCtxSetCurrent", unsafe { cu::cuCtxSetCurrent(created) });
    let s1 = stream();
    let gpu = Gpu::attach_cuda().expect("attach to a created context");
    eprintln!("attached to a created context: {}", gpu.selection());
    let mut q = gpu.queue().unwrap();
    saxpy_on(&gpu, &mut q, "cuMemAlloc", s1, 1 << 18, 5);
    drop(q);
    drop(gpu);
    // The primary context is untouched.
    // SAFETY: contexts made above.
    unsafe {
        ck("cuCtxSetCurrent", cu::cuCtxSetCurrent(primary));
        in_primary.free(s0);
        ck("cuCtxDestroy", cu::cuCtxDestroy_v2(created));
    }
}

/// The older of two contexts on one GPU is current when APEX attaches (a newer one made with `cuCtxCreate` also
/// holds memory and streams): APEX must join the current one, whose memory its kernels then reach, and leave the
/// other working.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn attach_joins_an_older_current_context_while_a_newer_one_exists() {
    if std::env::var_os("APEX_TEST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_writer(std::io::stderr)
            .try_init();
    }
    let primary = cuda_context();
    let s0 = stream();
    let in_primary = CudaMemory::new("cuMemAlloc", 1 << 20, s0);
    let mut created = std::ptr::null_mut();
    // SAFETY: out-pointer to a local, no creation parameters; device 0 exists (the primary context is on it).
    ck("cuCtxCreate", unsafe {
        cu::cuCtxCreate_v4(&mut created, std::ptr::null_mut(), 0, 0)
    });
    let s1 = stream();
    let in_created = CudaMemory::new("cuMemAlloc", 1 << 20, s1);
    let ys: Vec<f32> = (0..1024).map(|i| i as f32).collect();
    htod(in_created.ptr(), &ys);
    // SAFETY: the primary context retained above.
    ck("cuCtxSetCurrent", unsafe { cu::cuCtxSetCurrent(primary) });
    let gpu = Gpu::attach_cuda().expect("attach to the older, current context");
    eprintln!(
        "attached to the primary context while a created one exists: {}",
        gpu.selection()
    );
    let mut q = gpu.queue().unwrap();
    saxpy_on(&gpu, &mut q, "cuMemAlloc", s0, 1 << 18, 11);
    drop(q);
    drop(gpu);
    // The created context still works.
    // SAFETY: contexts made above.
    unsafe {
        ck("cuCtxSetCurrent", cu::cuCtxSetCurrent(created));
        ck("cuCtxSynchronize", cu::cuCtxSynchronize());
    }
    assert_eq!(dtoh::<f32>(in_created.ptr(), 1024), ys);
    in_created.free(s1);
    // SAFETY: as above.
    unsafe {
        ck("cuCtxSetCurrent", cu::cuCtxSetCurrent(primary));
        in_primary.free(s0);
        ck("cuCtxDestroy", cu::cuCtxDestroy_v2(created));
    }
}

const MODULE_DATA: &[u8] = include_bytes!("../kernels/conformance/module_data.sm_90.cubin");

/// The same module loaded by CUDA and by APEX with its `__device__` variables placed at CUDA's addresses
/// (`Gpu::load_module_sharing`): increments from both sides land in one variable, and pointers stored in
/// variables point at CUDA's instance.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn apex_and_cuda_instances_of_a_module_share_its_variables() {
    let _ctx = cuda_context();
    let (cuda_mod, bump) = cuda_function(MODULE_DATA, c"bump");
    let cuda_global = |name: &str| -> Option<apex::VariableHome> {
        let c = std::ffi::CString::new(name).ok()?;
        let (mut p, mut n) = (0u64, 0usize);
        // SAFETY: out-pointers to locals; a live module.
        let r = unsafe { cu::cuModuleGetGlobal_v2(&mut p, &mut n, cuda_mod, c.as_ptr()) };
        (r == cu::CUresult::CUDA_SUCCESS).then_some(apex::VariableHome {
            address: p,
            size: n as u64,
        })
    };
    let gpu = Gpu::attach_cuda().expect("attach");
    assert_eq!(gpu.backend(), Backend::Direct, "{}", gpu.selection());
    let m = gpu
        .load_module_sharing(MODULE_DATA, &|name, _| cuda_global(name))
        .expect("load with CUDA's variables");
    let dev_value = cuda_global("dev_value").unwrap().address;
    assert_eq!(m.global("dev_value").unwrap().device_ptr(), dev_value);
    let mut q = gpu.queue().unwrap();
    // CUDA's memory, which CUDA can read back (APEX's own buffers are unknown to cuMemcpy).
    let out = cuda_alloc(64 * 4);
    // SAFETY: bump(int) on one thread; read_back(int*) writes 25 ints into a 64-int buffer.
    unsafe {
        q.launch(
            &m.kernel("bump").unwrap(),
            &LaunchConfig::linear(1, 1),
            &[Arg::I32(5)],
        )
        .unwrap()
        .wait(T)
        .unwrap();
    }
    // CUDA's instance adds 7 to the same variable.
    let mut by = 7i32;
    let mut args: [*mut c_void; 1] = [(&mut by as *mut i32).cast()];
    // SAFETY: bump(int), one thread, the legacy stream; then the context is synchronized.
    unsafe {
        ck(
            "cuLaunchKernel",
            cu::cuLaunchKernel(
                bump,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                std::ptr::null_mut(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            ),
        );
        ck("cuCtxSynchronize", cu::cuCtxSynchronize());
    }
    assert_eq!(
        dtoh::<i32>(dev_value, 1),
        [1234 + 5 + 7],
        "CUDA's variable saw both increments"
    );
    // APEX's kernels read the shared variables; dev_ptr (initialized by CUDA's loader) points at CUDA's dev_value.
    // SAFETY: as above.
    unsafe {
        q.launch(
            &m.kernel("read_back").unwrap(),
            &LaunchConfig::linear(1, 1),
            &[Arg::Ptr(out)],
        )
        .unwrap()
        .wait(T)
        .unwrap();
    }
    let got: Vec<i32> = dtoh(out, 2);
    assert_eq!(
        got,
        [1246, 7],
        "dev_value and dev_zero[0] as CUDA's kernel left them"
    );
}
