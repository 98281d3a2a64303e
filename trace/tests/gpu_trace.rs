//! apex-trace preloaded into real CUDA programs (needs an NVIDIA GPU, nvcc in PATH).
//!
//! On the GPU machine `libapex_trace.so` must sit next to this test binary (or one directory up):
//! copy `target/release/libapex_trace.so` into the same folder as the `gpu_trace-*` binary.
//! Run: `./gpu_trace-<hash> --include-ignored --nocapture --test-threads=1`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use apex_trace::record::Record;

/// `libapex_trace.so` next to this test binary or one level up.
fn cdylib() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().expect("test binary has a directory");
    [
        dir.join("libapex_trace.so"),
        dir.join("../libapex_trace.so"),
    ]
    .into_iter()
    .find(|p| p.exists())
    .unwrap_or_else(|| {
        panic!(
            "copy libapex_trace.so next to {} (or one directory up)",
            exe.display()
        )
    })
}

const PROGRAM: &str = r#"
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>
// Every thread owns one element (no two threads of a launch touch the same one), so the result is deterministic
// and any difference under the tracer is the tracer's doing.
__device__ int gid() {
  int block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  int thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  return block * (blockDim.x * blockDim.y * blockDim.z) + thread;
}
extern "C" __global__ void k_add(float *a, int n) { int i = gid(); if (i < n) a[i] += 1.0f; }
extern "C" __global__ void k_scale(float *a, int n) { int i = gid(); if (i < n) a[i] *= 0.5f; }
extern "C" __global__ void k_fill(float *a, int n) { __shared__ float s[64]; int i = gid(); s[threadIdx.x % 64] = (float)blockIdx.y; __syncthreads(); if (i < n) a[i] = a[i] * 0.25f + s[threadIdx.x % 64]; }
int main() {
  const int n = 1 << 16; float *d; cudaMalloc(&d, n * sizeof(float)); cudaMemset(d, 0, n * sizeof(float));
  for (int i = 0; i < 1000; i++) {
    dim3 grid(1 + i % 7, 1 + i % 3, 1), block(32 * (1 + i % 4), 1 + i % 2, 1);
    switch (i % 3) { case 0: k_add<<<grid, block>>>(d, n); break; case 1: k_scale<<<grid, block>>>(d, n); break; default: k_fill<<<grid, block>>>(d, n); }
  }
  float h[n]; cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost);
  double sum = 0; for (int i = 0; i < n; i++) sum += h[i] * (1 + i % 13);
  printf("checksum %.6f\n", sum); printf("error %s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
"#;

/// (kernel, grid, block) → launches, as PROGRAM makes them.
fn expected() -> BTreeMap<(String, [u32; 3], [u32; 3]), u64> {
    let mut m = BTreeMap::new();
    for i in 0..1000u32 {
        let name = ["k_add", "k_scale", "k_fill"][(i % 3) as usize].to_string();
        let key = (
            name,
            [1 + i % 7, 1 + i % 3, 1],
            [32 * (1 + i % 4), 1 + i % 2, 1],
        );
        *m.entry(key).or_default() += 1;
    }
    m
}

fn read_trace(path: &Path) -> Vec<Record> {
    let text = std::fs::read_to_string(path).expect("trace file written");
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad record {e}: {l}")))
        .collect()
}

/// Runs `cmd` with and without the tracer; returns (plain stdout, traced stdout, traced stderr,
/// plain seconds, traced seconds).
fn both(mut make: impl FnMut() -> Command, trace: &Path) -> (String, String, String, f64, f64) {
    let t = Instant::now();
    let plain = make().output().expect("program runs");
    let plain_s = t.elapsed().as_secs_f64();
    assert!(plain.status.success(), "{plain:?}");
    let t = Instant::now();
    let traced = make()
        .env("LD_PRELOAD", cdylib())
        .env("APEX_TRACE_FILE", trace)
        .output()
        .expect("program runs");
    let traced_s = t.elapsed().as_secs_f64();
    assert!(traced.status.success(), "{traced:?}");
    let s = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (
        s(&plain.stdout),
        s(&traced.stdout),
        s(&traced.stderr),
        plain_s,
        traced_s,
    )
}

/// `source` compiled with nvcc for sm_90 into `dir`/`name`; `None` (the test skipped, said so) without nvcc.
fn compile(dir: &Path, name: &str, source: &str) -> Option<PathBuf> {
    std::fs::create_dir_all(dir).unwrap();
    let src = dir.join(format!("{name}.cu"));
    std::fs::write(&src, source).unwrap();
    let bin = dir.join(name);
    let Ok(nvcc) = Command::new("nvcc")
        .args(["-O2", "-arch=sm_90", "-o"])
        .arg(&bin)
        .arg(&src)
        .output()
    else {
        println!("SKIPPED: nvcc not found in PATH");
        return None;
    };
    assert!(
        nvcc.status.success(),
        "nvcc failed: {}",
        String::from_utf8_lossy(&nvcc.stderr)
    );
    Some(bin)
}

fn summarize(records: &[Record]) {
    let mut kinds = BTreeMap::<&str, usize>::new();
    for r in records {
        let k = match r {
            Record::Ioctl(_) => "ioctl",
            Record::Channel(_) => "channel",
            Record::Submission(_) => "submission",
            Record::Launch(_) => "launch",
            Record::QmdUpload(_) => "qmd_upload",
            Record::DriverLaunch(_) => "driver_launch",
            Record::DriverCall(_) => "driver_call",
            Record::Summary(_) => "summary",
        };
        *kinds.entry(k).or_default() += 1;
    }
    println!("records by type: {kinds:?}");
    for r in records {
        if let Record::Channel(c) = r {
            println!("channel {c:?}");
        }
    }
    if let Some(Record::Summary(s)) = records.last() {
        print!("{}", apex_trace::tracer::render(s));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn cuda_program_launches_are_all_found() {
    let dir = std::env::temp_dir().join(format!("apex-trace-gpu-{}", std::process::id()));
    let Some(bin) = compile(&dir, "prog", PROGRAM) else {
        return;
    };
    let trace = dir.join("trace.jsonl");
    let (plain, traced, stderr, plain_s, traced_s) = both(|| Command::new(&bin), &trace);
    println!("plain: {plain}traced: {traced}tracer stderr:\n{stderr}");
    println!(
        "overhead: {plain_s:.3} s without, {traced_s:.3} s with the tracer ({:+.1}%)",
        (traced_s / plain_s - 1.0) * 100.0
    );
    assert_eq!(
        plain, traced,
        "the program's output changed under the tracer"
    );
    assert!(plain.contains("error no error"), "{plain}");
    let records = read_trace(&trace);
    summarize(&records);
    let want = expected();
    // From QMDs: every (grid, block) at least as often as the program launched it (CUDA's own
    // kernels, e.g. cudaMemset, may add more).
    let mut qmd = BTreeMap::<([u32; 3], [u32; 3]), u64>::new();
    let mut undecoded = 0;
    for r in &records {
        match r {
            Record::Launch(l) if l.kernel => *qmd.entry((l.grid, l.block)).or_default() += 1,
            Record::Submission(s) if s.undecoded.is_some() => {
                undecoded += 1;
                if undecoded <= 5 {
                    println!(
                        "undecoded submission: {:?}",
                        s.undecoded.as_ref().unwrap().reason
                    );
                }
            }
            _ => {}
        }
    }
    let mut want_shapes = BTreeMap::<([u32; 3], [u32; 3]), u64>::new();
    for ((_, g, b), n) in &want {
        *want_shapes.entry((*g, *b)).or_default() += n;
    }
    let mut missing = Vec::new();
    for (shape, n) in &want_shapes {
        let got = qmd.get(shape).copied().unwrap_or(0);
        if got < *n {
            missing.push(format!("QMD {shape:?}: want {n}, found {got}"));
        }
    }
    // From cuLaunchKernel records: exact counts per name and shape.
    let mut drv = BTreeMap::<(String, [u32; 3], [u32; 3]), u64>::new();
    for r in &records {
        if let Record::DriverLaunch(d) = r
            && let Some(name) = &d.name
            && name.starts_with("k_")
        {
            *drv.entry((name.clone(), d.grid, d.block)).or_default() += 1;
        }
    }
    let drv_total: u64 = drv.values().sum();
    println!(
        "QMD kernel launches: {}, driver launches of k_*: {drv_total}, undecoded submissions: {undecoded}",
        qmd.values().sum::<u64>()
    );
    if drv != want {
        missing.push(format!(
            "driver launches differ: {} of 1000 recorded; first differences: {:?}",
            drv_total,
            want.iter()
                .filter(|(k, v)| drv.get(*k) != Some(v))
                .take(5)
                .collect::<Vec<_>>()
        ));
    }
    for m in &missing {
        println!("MISSING {m}");
    }
    assert!(missing.is_empty(), "{} problems", missing.len());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn pytorch_script_runs_unchanged() {
    let probe = Command::new("python3")
        .args(["-c", "import torch; assert torch.cuda.is_available()"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        println!("SKIPPED: `python3 -c 'import torch'` failed (or no CUDA in torch)");
        return;
    }
    let script = r#"
import torch
torch.manual_seed(0)
x = torch.randn(1024, 1024, device="cuda")
acc = torch.zeros(1024, 1024, device="cuda")
for i in range(200):
    acc = acc + torch.relu(x * (1.0 + i / 100.0) - 0.5)
torch.cuda.synchronize()
print("checksum %.4f" % float(acc.double().sum()))
"#;
    let dir = std::env::temp_dir().join(format!("apex-trace-torch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("trace.jsonl");
    let (plain, traced, stderr, plain_s, traced_s) = both(
        || {
            let mut c = Command::new("python3");
            c.args(["-c", script]);
            c
        },
        &trace,
    );
    println!(
        "plain: {plain}traced: {traced}tracer stderr (tail):\n{}",
        tail(&stderr, 40)
    );
    println!(
        "overhead: {plain_s:.3} s without, {traced_s:.3} s with the tracer ({:+.1}%)",
        (traced_s / plain_s - 1.0) * 100.0
    );
    assert_eq!(plain, traced);
    let records = read_trace(&trace);
    summarize(&records);
    let qmd = records
        .iter()
        .filter(|r| matches!(r, Record::Launch(l) if l.kernel))
        .count();
    let drv = records
        .iter()
        .filter(|r| matches!(r, Record::DriverLaunch(_)))
        .count();
    println!("PyTorch: {qmd} QMD kernel launches, {drv} driver launches");
    assert!(
        qmd >= 400,
        "expected at least 400 kernel launches in QMDs, found {qmd}"
    );
}

const STREAMS_PROGRAM: &str = r#"
#include <cstdio>
#include <cuda_runtime.h>
__global__ void spin(int *p) { p[threadIdx.x] += 1; }
int main() {
  int *d; cudaMalloc(&d, 1024); cudaMemset(d, 0, 1024);
  cudaStream_t s; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaEvent_t e; cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  printf("stream %llx event %llx\n", (unsigned long long)s, (unsigned long long)e);
  spin<<<1, 32, 0, s>>>(d);
  cudaEventRecord(e, s);
  cudaStreamWaitEvent(0, e, 0);
  spin<<<1, 32>>>(d);
  cudaError_t q = cudaEventQuery(e); printf("query %s\n", q == cudaSuccess || q == cudaErrorNotReady ? "ok" : "bad");
  cudaEventSynchronize(e);
  cudaStreamSynchronize(s);
  cudaDeviceSynchronize();
  cudaEventDestroy(e);
  cudaStreamDestroy(s);
  int h[32]; cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost);
  printf("value %d error %s\n", h[0], cudaGetErrorString(cudaGetLastError()));
  return 0;
}
"#;

/// The stream and event calls of a CUDA runtime program are recorded in order, with the handles it used.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn stream_and_event_calls_are_recorded_in_order() {
    let dir = std::env::temp_dir().join(format!("apex-trace-calls-{}", std::process::id()));
    let Some(bin) = compile(&dir, "streams", STREAMS_PROGRAM) else {
        return;
    };
    let trace = dir.join("trace.jsonl");
    let (plain, traced, stderr, _, _) = both(|| Command::new(&bin), &trace);
    println!("traced: {traced}tracer stderr:\n{stderr}");
    assert!(
        plain.contains("value 2 error no error") && plain.contains("query ok"),
        "{plain}"
    );
    let handles: Vec<u64> = traced
        .lines()
        .next()
        .and_then(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            Some(vec![
                u64::from_str_radix(w.get(1)?, 16).ok()?,
                u64::from_str_radix(w.get(3)?, 16).ok()?,
            ])
        })
        .unwrap_or_else(|| panic!("no handles in {traced}"));
    let (stream, event) = (handles[0], handles[1]);
    let records = read_trace(&trace);
    summarize(&records);
    let calls: Vec<_> = records
        .iter()
        .filter_map(|r| match r {
            Record::DriverCall(c) if c.stream == Some(stream) || c.event == Some(event) => Some(c),
            _ => None,
        })
        .collect();
    for c in &calls {
        println!(
            "{} stream {:?} event {:?} flags {:?} -> {}",
            c.api, c.stream, c.event, c.flags, c.result
        );
    }
    // The calls this program makes on its stream and event, in order (the runtime may add others between them).
    let want: [(&[&str], bool, bool); 8] = [
        (
            &["cuStreamCreate", "cuStreamCreateWithPriority"],
            true,
            false,
        ),
        (&["cuEventCreate"], false, true),
        (&["cuEventRecord", "cuEventRecordWithFlags"], true, true),
        (&["cuStreamWaitEvent"], false, true),
        (&["cuEventQuery"], false, true),
        (&["cuEventSynchronize"], false, true),
        (&["cuStreamSynchronize"], true, false),
        (&["cuEventDestroy_v2"], false, true),
    ];
    let mut next = 0;
    for c in &calls {
        if next < want.len() {
            let (apis, on_stream, on_event) = want[next];
            if apis.contains(&c.api.as_str())
                && (!on_stream || c.stream == Some(stream))
                && (!on_event || c.event == Some(event))
            {
                // A query may find the event not yet reached (600, CUDA_ERROR_NOT_READY); everything else succeeds.
                let ok = c.result == 0 || (c.api == "cuEventQuery" && c.result == 600);
                assert!(ok, "{c:?}");
                next += 1;
            }
        }
    }
    assert_eq!(
        next,
        want.len(),
        "calls found in order: {next} of {}; next missing: {:?}",
        want.len(),
        want.get(next)
    );
    assert!(
        calls
            .iter()
            .any(|c| c.api == "cuStreamDestroy_v2" && c.stream == Some(stream)),
        "the stream's destruction is missing"
    );
    let summary = match records.last() {
        Some(Record::Summary(s)) => s,
        other => panic!("the trace does not end with a summary: {other:?}"),
    };
    assert!(
        summary
            .driver_calls
            .iter()
            .any(|c| c.api == "cuCtxSynchronize" && c.count >= 1),
        "{summary:?}"
    );
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
