//! The GPT-2-small decoder of issue 11 (kernels/gpt2.cu) on both backends, checked against the CPU reference
//! step by step: eager launches (plain and programmatic), GPU-scheduled chains, and replays of the step as a launch
//! graph.

#[path = "../examples/support/gpt2.rs"]
mod gpt2;

use apex::{BackendRequest, Gpu};
use gpt2::{CpuModel, GPT2_SMALL, GpuModel, Kernels, StepLaunch, max_rel_diff};

const STEPS: usize = 4;

fn decode_matches_the_cpu(request: BackendRequest) {
    let s = GPT2_SMALL;
    let w = gpt2::random_weights(&s, 7);
    let toks = gpt2::tokens(&s, 11);
    let mut cpu = CpuModel::new(s, &w);
    let want: Vec<Vec<f32>> = (0..STEPS).map(|p| cpu.step(toks[p], p)).collect();
    let gpu = Gpu::open_with(0, request).expect("open the GPU");
    let mut q = gpu.queue().unwrap();
    let k = Kernels::load(&gpu).unwrap();
    let m = GpuModel::new(&gpu, &mut q, s, &w, &toks).unwrap();
    // The step as a launch graph, replayed once per token: plain, then with programmatic dependent launches.
    for programmatic in [false, true] {
        let mut exec = q.instantiate(&m.graph(&k, programmatic).unwrap()).unwrap();
        m.set_position(&gpu, &mut q, 0).unwrap();
        for (p, want) in want.iter().enumerate() {
            // SAFETY: the graph's nodes declare the model's buffers, which nothing else uses; its kernels wait for
            // their producers themselves.
            unsafe { q.replay(&mut exec) }.unwrap();
            let got = m.logits(&gpu, &mut q).unwrap();
            let diff = max_rel_diff(&got, want);
            assert!(
                diff < 1e-3,
                "{:?}, graph replay (programmatic {programmatic}), step {p}: logits differ from the CPU by {diff} \
                 (relative)",
                gpu.backend()
            );
        }
    }
    for how in [
        StepLaunch::Eager,
        StepLaunch::Chained,
        StepLaunch::ChainedProgrammatic,
        StepLaunch::Programmatic,
    ] {
        m.set_position(&gpu, &mut q, 0).unwrap();
        for (p, want) in want.iter().enumerate() {
            // SAFETY: the model's own kernels and buffers, used by this queue alone; the kernels wait for their
            // producers themselves.
            unsafe { m.launch_step(&mut q, &k, how) }.unwrap();
            let got = m.logits(&gpu, &mut q).unwrap();
            let diff = max_rel_diff(&got, want);
            assert!(
                diff < 1e-3,
                "{:?}, {how:?} launches, step {p}: logits differ from the CPU by {diff} (relative)",
                gpu.backend()
            );
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpt2_decode_on_the_direct_path_matches_the_cpu() {
    decode_matches_the_cpu(BackendRequest::Direct);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpt2_decode_on_the_driver_backend_matches_the_cpu() {
    decode_matches_the_cpu(BackendRequest::Driver);
}
