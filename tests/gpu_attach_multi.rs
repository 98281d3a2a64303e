//! APEX attached to CUDA contexts beyond the first GPU (issue 28; run with `--include-ignored` on a machine with two
//! NVIDIA GPUs): a process whose only context is on its second GPU (a PyTorch process on `cuda:1`, a
//! torch.distributed rank), and a process with contexts on two GPUs attached to both, by the current context, by
//! device and by context handle.

use std::ffi::c_void;

use apex::{Arg, Backend, Gpu, LaunchConfig};
use cudarc::driver::sys as cu;

const TEST_CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
/// Set in the process [`a_process_whose_only_context_is_on_its_second_gpu`] starts for its role.
const ROLE: &str = "APEX_ATTACH_MULTI_ROLE";

fn ck(what: &str, r: cu::CUresult) {
    assert_eq!(r, cu::CUresult::CUDA_SUCCESS, "{what}");
}

fn device_count() -> i32 {
    let mut n = 0;
    // SAFETY: plain driver calls with an out-pointer to a local.
    unsafe {
        ck("cuInit", cu::cuInit(0));
        ck("cuDeviceGetCount", cu::cuDeviceGetCount(&mut n));
    }
    n
}

/// Device `ordinal`'s primary context, retained and made current on this thread (as `torch.cuda.set_device` does).
fn primary(ordinal: i32) -> cu::CUcontext {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: plain driver calls with out-pointers to locals.
    unsafe {
        ck(
            "cuDevicePrimaryCtxRetain",
            cu::cuDevicePrimaryCtxRetain(&mut ctx, ordinal),
        );
        ck("cuCtxSetCurrent", cu::cuCtxSetCurrent(ctx));
    }
    ctx
}

fn set_current(ctx: cu::CUcontext) {
    // SAFETY: a live primary context retained by the caller.
    ck("cuCtxSetCurrent", unsafe { cu::cuCtxSetCurrent(ctx) });
}

/// The UUID of device `ordinal`, formatted as `Gpu::uuid` formats it.
fn cuda_uuid(ordinal: i32) -> String {
    let mut u = cu::CUuuid { bytes: [0; 16] };
    // SAFETY: out-pointer to a local.
    ck("cuDeviceGetUuid", unsafe {
        cu::cuDeviceGetUuid_v2(&mut u, ordinal)
    });
    let h: String = u
        .bytes
        .iter()
        .map(|x| format!("{:02x}", *x as u8))
        .collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// `n` floats of the current context's memory holding `v`.
fn cuda_floats(v: &[f32]) -> u64 {
    let mut p = 0;
    // SAFETY: out-pointer to a local, then a copy of `v` into the new allocation of its size.
    unsafe {
        ck("cuMemAlloc", cu::cuMemAlloc_v2(&mut p, v.len() * 4));
        ck(
            "cuMemcpyHtoD",
            cu::cuMemcpyHtoD_v2(p, v.as_ptr().cast::<c_void>(), v.len() * 4),
        );
    }
    p
}

fn read_floats(p: u64, n: usize) -> Vec<f32> {
    let mut v = vec![0f32; n];
    // SAFETY: `p` holds at least n floats of the current context.
    ck("cuMemcpyDtoH", unsafe {
        cu::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), p, n * 4)
    });
    v
}

/// y = a·x + y on `gpu` over CUDA memory of its context, and the CUDA stream `s` of that context ordered after it
/// on the GPU; the result is read back by CUDA. `ctx` must be current.
fn saxpy_through(gpu: &Gpu, a: f32, seed: u32) {
    let n = 1u32 << 16;
    let xs: Vec<f32> = (0..n).map(|i| (i % 251) as f32 + seed as f32).collect();
    let ys: Vec<f32> = (0..n).map(|i| (i % 13) as f32).collect();
    let (x, y) = (cuda_floats(&xs), cuda_floats(&ys));
    let saxpy = gpu
        .load_module(TEST_CUBIN)
        .unwrap()
        .kernel("saxpy")
        .unwrap();
    let mut q = gpu.queue().unwrap();
    // SAFETY: x and y hold n floats of the context the GPU is attached to.
    unsafe {
        q.launch(
            &saxpy,
            &LaunchConfig::linear(n / 256, 256),
            &[Arg::F32(a), Arg::Ptr(x), Arg::Ptr(y), Arg::U32(n)],
        )
    }
    .unwrap();
    let mut s = std::ptr::null_mut();
    // SAFETY: out-pointer to a local; a stream of the current (attached) context.
    ck("cuStreamCreate", unsafe {
        cu::cuStreamCreate(&mut s, cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
    });
    // SAFETY: `s` is a stream of the attached context.
    unsafe { q.make_cuda_stream_wait(s) }.unwrap();
    // SAFETY: as above.
    ck("cuStreamSynchronize", unsafe { cu::cuStreamSynchronize(s) });
    let got = read_floats(y, n as usize);
    for i in 0..n as usize {
        assert_eq!(got[i], a * xs[i] + ys[i], "element {i}");
    }
    q.synchronize().unwrap();
    // SAFETY: our own stream and allocations, no work pending on them.
    unsafe {
        cu::cuStreamDestroy_v2(s);
        cu::cuMemFree_v2(x);
        cu::cuMemFree_v2(y);
    }
}

fn two_gpus() -> bool {
    let n = device_count();
    if n < 2 {
        eprintln!("skipped: CUDA lists {n} device(s), the test needs two");
    }
    n >= 2
}

/// The role: a process that never touches its first GPU, as a torch.distributed rank on `cuda:1` does. libcuda's
/// client holds a device object for every GPU but a compute channel group only on the second.
#[test]
#[ignore = "needs two NVIDIA GPUs"]
fn role_only_the_second_gpu() {
    if std::env::var_os(ROLE).is_none() {
        return;
    }
    assert!(device_count() >= 2);
    let _ctx = primary(1);
    let warm = cuda_floats(&[0.0]);
    let gpu = Gpu::attach_cuda().expect("attach to the context on the second GPU");
    assert_eq!(gpu.backend(), Backend::Direct, "{}", gpu.selection());
    assert_eq!(gpu.uuid().unwrap(), cuda_uuid(1));
    saxpy_through(&gpu, 3.0, 1);
    // SAFETY: our own allocation.
    unsafe { cu::cuMemFree_v2(warm) };
    eprintln!("second-gpu role: attached and ran on {}", cuda_uuid(1));
}

#[test]
#[ignore = "needs two NVIDIA GPUs"]
fn a_process_whose_only_context_is_on_its_second_gpu() {
    if std::env::var_os(ROLE).is_some() || !two_gpus() {
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "role_only_the_second_gpu",
            "--include-ignored",
            "--nocapture",
        ])
        .env(ROLE, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stderr}");
    assert!(out.status.success(), "the role's process failed");
    assert!(
        stderr.contains("second-gpu role: attached"),
        "the role did not run"
    );
}

/// Contexts on both GPUs of one process: each attach finds its own context's GPU, whichever way the context is
/// named, and kernels of both run on their own context's memory; a thread switching devices keeps each in order.
#[test]
#[ignore = "needs two NVIDIA GPUs"]
fn a_process_with_contexts_on_two_gpus_attaches_to_each() {
    if std::env::var_os(ROLE).is_some() || !two_gpus() {
        return;
    }
    let c0 = primary(0);
    let w0 = cuda_floats(&[0.0]);
    let c1 = primary(1);
    let w1 = cuda_floats(&[0.0]);
    // Current context: device 1's (made current last).
    let by_current = Gpu::attach_cuda().expect("attach to the current context (device 1)");
    assert_eq!(by_current.uuid().unwrap(), cuda_uuid(1));
    // By device, while device 1's context is current.
    let g0 = Gpu::attach_cuda_device(0).expect("attach to device 0");
    assert_eq!(g0.backend(), Backend::Direct, "{}", g0.selection());
    assert_eq!(g0.uuid().unwrap(), cuda_uuid(0));
    // By context handle.
    // SAFETY: c1 is device 1's primary context, retained above for the whole test.
    let g1 = unsafe { Gpu::attach_cuda_context(c1) }.expect("attach to device 1's context");
    assert_eq!(g1.backend(), Backend::Direct, "{}", g1.selection());
    assert_eq!(g1.uuid().unwrap(), cuda_uuid(1));
    assert_ne!(g0.uuid().unwrap(), g1.uuid().unwrap());
    // Work on each, switching the current device between them as a multi-GPU program does.
    for round in 0..3 {
        set_current(c0);
        saxpy_through(&g0, 2.0, round);
        set_current(c1);
        saxpy_through(&g1, 0.5, round);
        saxpy_through(&by_current, 4.0, round);
    }
    drop((g0, g1, by_current));
    // SAFETY: our own allocations, each freed in its own context.
    unsafe {
        set_current(c0);
        cu::cuMemFree_v2(w0);
        set_current(c1);
        cu::cuMemFree_v2(w1);
    }
}
