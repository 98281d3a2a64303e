//! The occupancy calculator against the CUDA driver's `cuOccupancyMaxActiveBlocksPerMultiprocessor`
//! over every kernel of the test cubin × block sizes × dynamic shared memory sizes.
//!
//! Run on a machine with an NVIDIA GPU and libcuda:
//! `cargo test --release --test gpu_occupancy -- --include-ignored --nocapture`

use std::ffi::CString;
use std::ptr;

use apex::launch::occupancy::{DeviceLimits, KernelResources, Occupancy, occupancy};
use apex::module::cubin::Cubin;
use cudarc::driver::sys as cu;

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");

fn check(r: cu::CUresult, what: &str) {
    assert_eq!(r, cu::CUresult::CUDA_SUCCESS, "{what} failed: {r:?}");
}

fn device_attr(dev: cu::CUdevice, attr: cu::CUdevice_attribute) -> i32 {
    let mut v = 0;
    // SAFETY: `v` is a live i32 out-parameter; `dev` came from cuDeviceGet.
    check(
        unsafe { cu::cuDeviceGetAttribute(&mut v, attr, dev) },
        "cuDeviceGetAttribute",
    );
    v
}

fn func_attr(f: cu::CUfunction, attr: cu::CUfunction_attribute) -> i32 {
    let mut v = 0;
    // SAFETY: `v` is a live i32 out-parameter; `f` came from cuModuleGetFunction.
    check(
        unsafe { cu::cuFuncGetAttribute(&mut v, attr, f) },
        "cuFuncGetAttribute",
    );
    v
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn occupancy_matches_the_driver() {
    // SAFETY: only probes for libcuda with dlopen.
    if !unsafe { cu::is_culib_present() } {
        panic!("libcuda.so not found: this test needs the CUDA driver");
    }
    use cu::CUdevice_attribute as A;
    use cu::CUfunction_attribute as F;
    // SAFETY: plain driver API calls with live out-parameters; the cubin bytes outlive the module.
    let (dev, module) = unsafe {
        check(cu::cuInit(0), "cuInit");
        let mut dev = 0;
        check(cu::cuDeviceGet(&mut dev, 0), "cuDeviceGet");
        let mut ctx = ptr::null_mut();
        check(
            cu::cuDevicePrimaryCtxRetain(&mut ctx, dev),
            "cuDevicePrimaryCtxRetain",
        );
        check(cu::cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
        let mut module = ptr::null_mut();
        check(
            cu::cuModuleLoadData(&mut module, CUBIN.as_ptr().cast()),
            "cuModuleLoadData",
        );
        (dev, module)
    };
    let major = device_attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) as u32;
    let minor = device_attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR) as u32;
    let sms = device_attr(dev, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT) as u32;
    let limits = DeviceLimits::for_sm(major * 10 + minor, sms).expect("known SM version");
    println!("device sm_{major}{minor}, {sms} SMs; our limits: {limits:?}");
    // The driver's own figures, side by side with ours.
    let driver = [
        (
            "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR",
            A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
            limits.smem_per_sm,
        ),
        (
            "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN",
            A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            limits.smem_per_block_optin,
        ),
        (
            "MAX_SHARED_MEMORY_PER_BLOCK",
            A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK,
            limits.smem_per_block,
        ),
        (
            "RESERVED_SHARED_MEMORY_PER_BLOCK",
            A::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK,
            limits.reserved_smem_per_block,
        ),
        (
            "MAX_REGISTERS_PER_MULTIPROCESSOR",
            A::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR,
            limits.regs_per_sm,
        ),
        (
            "MAX_REGISTERS_PER_BLOCK",
            A::CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK,
            limits.regs_per_block,
        ),
        (
            "MAX_BLOCKS_PER_MULTIPROCESSOR",
            A::CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR,
            limits.max_blocks_per_sm,
        ),
        (
            "MAX_THREADS_PER_MULTIPROCESSOR",
            A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR,
            limits.max_warps_per_sm * 32,
        ),
        (
            "MAX_THREADS_PER_BLOCK",
            A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
            limits.max_threads_per_block,
        ),
    ];
    let mut attr_mismatch = Vec::new();
    for (name, attr, ours) in driver {
        let v = device_attr(dev, attr) as u32;
        println!("  {name}: driver {v}, ours {ours}");
        if v != ours {
            attr_mismatch.push(format!("{name}: driver {v}, ours {ours}"));
        }
    }

    let cubin = Cubin::parse(CUBIN).expect("test cubin parses");
    let blocks: Vec<u32> = (1..=1024u32)
        .filter(|b| *b <= 64 || b % 32 == 0 || b % 96 == 1 || b % 100 == 0)
        .collect();
    let dynamic: [u32; 12] = [
        0,
        1,
        1000,
        4096,
        12 * 1024,
        48 * 1024,
        64 * 1024 + 7,
        100 * 1024,
        113 * 1024,
        150 * 1024,
        226 * 1024,
        227 * 1024,
    ];
    let (mut n, mut mismatches, mut alt_mismatches) = (0u32, Vec::new(), 0u32);
    for k in cubin.kernels() {
        let name = CString::new(k.name.as_str()).unwrap();
        let mut f = ptr::null_mut();
        // SAFETY: live out-parameter, NUL-terminated name, module loaded above.
        check(
            unsafe { cu::cuModuleGetFunction(&mut f, module, name.as_ptr()) },
            "cuModuleGetFunction",
        );
        let res = KernelResources::from_kernel(k, cubin.sm_version());
        let drv_regs = func_attr(f, F::CU_FUNC_ATTRIBUTE_NUM_REGS) as u32;
        let drv_static = func_attr(f, F::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES) as u32;
        let drv_max_threads = func_attr(f, F::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK) as u32;
        println!(
            "kernel {}: cubin regs {} static {} | driver NUM_REGS {drv_regs} SHARED_SIZE_BYTES {drv_static} MAX_THREADS_PER_BLOCK {drv_max_threads}",
            k.name, res.registers, res.static_shared
        );
        // The other reading of the reserve (added on top of the cubin's static size), to tell which
        // one the driver uses if the main one mismatches.
        let alt = KernelResources::new(res.registers, res.static_shared, !res.reserve_in_static);
        let mut opted_in = 0u32;
        for &d in &dynamic {
            if d > 48 * 1024 && d > opted_in {
                // SAFETY: valid function handle; the driver rejects values above the device maximum.
                let r = unsafe {
                    cu::cuFuncSetAttribute(
                        f,
                        F::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        d as i32,
                    )
                };
                if r == cu::CUresult::CUDA_SUCCESS {
                    opted_in = d;
                } else {
                    println!("  cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES, {d}) -> {r:?}");
                }
            }
            for &b in &blocks {
                let mut got = 0i32;
                // SAFETY: live out-parameter, valid function handle.
                let r = unsafe {
                    cu::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                        &mut got, f, b as i32, d as usize,
                    )
                };
                // A shape the driver refuses counts as 0 resident blocks.
                let driver = if r == cu::CUresult::CUDA_SUCCESS {
                    got as u32
                } else {
                    0
                };
                let ours_full = occupancy(&limits, &res, b, d);
                let alt_full = occupancy(&limits, &alt, b, d);
                // Above the kernel's own thread limit the driver refuses shapes the device could hold.
                let blocks_of = |o: &Result<Occupancy, _>| {
                    if b > drv_max_threads {
                        0
                    } else {
                        o.as_ref().map_or(0, |o| o.active_blocks)
                    }
                };
                let (ours, alt_ours) = (blocks_of(&ours_full), blocks_of(&alt_full));
                n += 1;
                if alt_ours != driver {
                    alt_mismatches += 1;
                }
                if ours != driver {
                    mismatches.push(format!(
                        "{} block {b} dyn {d}: driver {driver} (status {r:?}), ours {ours} ({})",
                        k.name,
                        match &ours_full {
                            Ok(o) => o.to_string(),
                            Err(e) => e.to_string(),
                        }
                    ));
                }
            }
        }
    }
    for m in mismatches.iter().take(50) {
        println!("MISMATCH {m}");
    }
    println!("(other reading of the shared-memory reserve: {alt_mismatches} mismatches of {n})");
    println!(
        "occupancy sweep: {n} configurations, {} mismatches",
        mismatches.len()
    );
    for m in &attr_mismatch {
        println!("DEVICE ATTRIBUTE MISMATCH {m}");
    }
    assert!(n >= 1000, "only {n} configurations");
    assert!(mismatches.is_empty(), "{} mismatches", mismatches.len());
    assert!(
        attr_mismatch.is_empty(),
        "device limits differ: {attr_mismatch:?}"
    );
}
