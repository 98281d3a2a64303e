//! Programmatic dependent launches on the GPU (issue 11), both backends: thousands of `pdl_step` launches, each
//! reading and rewriting every word the launch before it wrote. `pdl_step` lets its dependent be scheduled before
//! its own writes, so only the latch (`griddepcontrol.wait`) keeps the next launch from reading stale words: any
//! word that differs from the CPU's sequence is a broken dependency. Ordinary, prepared and programmatic launches
//! of another kernel, and copies, are mixed in.

use std::time::Duration;

use apex::{Arg, BackendRequest, Gpu, LaunchConfig};

const PDL: &[u8] = include_bytes!("../kernels/apex_pdl.sm_90.cubin");
const N: u32 = 1 << 20;
const LAUNCHES: u32 = 3000;

fn words(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn steps_match_the_cpu(request: BackendRequest) {
    let gpu = Gpu::open_with(0, request).expect("open the GPU");
    let m = gpu.load_module(PDL).unwrap();
    let step = m.kernel("pdl_step").unwrap();
    let busy = m.kernel("pdl_busy").unwrap();
    let buf = gpu.alloc(u64::from(N) * 4).unwrap();
    let scratch = gpu.alloc(4096).unwrap();
    let other = gpu.alloc(4096).unwrap();
    let mut q = gpu.queue().unwrap();
    let init: Vec<u8> = (0..N).flat_map(|i| i.to_le_bytes()).collect();
    q.upload(&gpu, &buf, 0, &init).unwrap();
    // Two blocks per SM, each thread striding over several words: the kernel runs for microseconds.
    let cfg = LaunchConfig::linear(2 * gpu.info().sm_count, 256);
    let prepared = q.prepare(&step, &cfg).unwrap();
    let mut want: Vec<u32> = (0..N).collect();
    let mut last = None;
    for v in 0..LAUNCHES {
        let args = [buf.arg(), Arg::U32(N), Arg::U32(v)];
        // SAFETY: pdl_step and pdl_busy run griddepcontrol.wait before touching memory; buf, scratch and other are
        // used by this queue alone.
        let f = unsafe {
            match v % 50 {
                10 => q.launch(&step, &cfg, &args),
                20 => q.launch_prepared(&prepared, &args),
                25..=27 => q.launch_prepared_programmatic(&prepared, &args),
                30 => {
                    // A programmatic launch of another kernel in between (writes only scratch).
                    q.launch_programmatic(
                        &busy,
                        &LaunchConfig::linear(gpu.info().sm_count, 128),
                        &[scratch.arg(), Arg::U32(1000)],
                    )
                    .unwrap();
                    q.launch_programmatic(&step, &cfg, &args)
                }
                40 => {
                    q.copy_device_to_device(&scratch, 0, &other, 0, 4096)
                        .unwrap();
                    q.launch_programmatic(&step, &cfg, &args)
                }
                _ => q.launch_programmatic(&step, &cfg, &args),
            }
        }
        .unwrap();
        for x in &mut want {
            *x = x.wrapping_mul(3).wrapping_add(v);
        }
        last = Some(f);
    }
    last.unwrap().wait(Duration::from_secs(60)).unwrap();
    q.synchronize().unwrap();
    let mut out = vec![0u8; N as usize * 4];
    q.download(&gpu, &buf, 0, &mut out).unwrap();
    let got = words(&out);
    let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
    assert_eq!(
        bad,
        0,
        "{:?}: {bad} of {N} words differ from the CPU after {LAUNCHES} dependent launches (first at {:?})",
        gpu.backend(),
        got.iter().zip(&want).position(|(a, b)| a != b)
    );
    if let Some(cq) = q.direct() {
        assert!(cq.is_programmatic(), "the direct queue built its gates");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn programmatic_launches_on_the_direct_path_keep_every_dependency() {
    steps_match_the_cpu(BackendRequest::Direct);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn programmatic_launches_on_the_driver_backend_keep_every_dependency() {
    steps_match_the_cpu(BackendRequest::Driver);
}
