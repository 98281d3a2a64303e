//! A CUDA program's small kernels through an APEX queue attached to its context, its large work on a CUDA stream
//! (issue 12), beside the same program all on CUDA, in one process. Needs an NVIDIA GPU with libcuda.
//!
//! Rows: the CPU cost of one small launch (cuLaunchKernel vs the attached queue), the end-to-end time of
//! `ITERS` iterations of (`SMALL` small kernels + one large one, dependent both ways), and a ping-pong of
//! dependent empty kernels alternating between a CUDA stream and the APEX queue (each waits for the other on the
//! GPU), beside the same ping-pong between two CUDA streams: the channel-group switch is gone when the two are
//! close.
//!
//! `cargo run --release --example attach_mixed [iters]`

use std::ffi::c_void;
use std::time::{Duration, Instant};

use apex::{Gpu, Launch, LaunchConfig, LaunchMemory, QueueOptions};
use cudarc::driver::sys as cu;

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const SMALL: usize = 8;
const BIG_N: u32 = 1 << 24;

fn ck(what: &str, r: cu::CUresult) -> Result<(), String> {
    if r == cu::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what} failed: {r:?}"))
    }
}

struct Cuda {
    stream: cu::CUstream,
    stream2: cu::CUstream,
    empty: cu::CUfunction,
    saxpy: cu::CUfunction,
    x: u64,
    y: u64,
}

impl Cuda {
    fn new() -> Result<Cuda, String> {
        let mut ctx = std::ptr::null_mut();
        let (mut m, mut e, mut s) = (
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        );
        let (mut st, mut st2) = (std::ptr::null_mut(), std::ptr::null_mut());
        let (mut x, mut y) = (0, 0);
        // SAFETY: driver calls with out-pointers to locals; the cubin is valid.
        unsafe {
            ck("cuInit", cu::cuInit(0))?;
            ck(
                "cuDevicePrimaryCtxRetain",
                cu::cuDevicePrimaryCtxRetain(&mut ctx, 0),
            )?;
            ck("cuCtxSetCurrent", cu::cuCtxSetCurrent(ctx))?;
            ck(
                "cuModuleLoadData",
                cu::cuModuleLoadData(&mut m, CUBIN.as_ptr().cast()),
            )?;
            ck(
                "cuModuleGetFunction",
                cu::cuModuleGetFunction(&mut e, m, c"empty".as_ptr()),
            )?;
            ck(
                "cuModuleGetFunction",
                cu::cuModuleGetFunction(&mut s, m, c"saxpy".as_ptr()),
            )?;
            let flags = cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
            ck("cuStreamCreate", cu::cuStreamCreate(&mut st, flags))?;
            ck("cuStreamCreate", cu::cuStreamCreate(&mut st2, flags))?;
            ck("cuMemAlloc", cu::cuMemAlloc_v2(&mut x, BIG_N as usize * 4))?;
            ck("cuMemAlloc", cu::cuMemAlloc_v2(&mut y, BIG_N as usize * 4))?;
            ck("cuMemsetD32", cu::cuMemsetD32_v2(x, 0, BIG_N as usize))?;
            ck("cuMemsetD32", cu::cuMemsetD32_v2(y, 0, BIG_N as usize))?;
        }
        Ok(Cuda {
            stream: st,
            stream2: st2,
            empty: e,
            saxpy: s,
            x,
            y,
        })
    }

    fn empty(&self, s: cu::CUstream) -> Result<(), String> {
        // SAFETY: a kernel without parameters.
        ck("cuLaunchKernel", unsafe {
            cu::cuLaunchKernel(
                self.empty,
                1,
                1,
                1,
                32,
                1,
                1,
                0,
                s,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        })
    }

    fn big(&self) -> Result<(), String> {
        let (mut a, mut x, mut y, mut n) = (1.0f32, self.x, self.y, BIG_N);
        let mut args: [*mut c_void; 4] = [
            (&mut a as *mut f32).cast(),
            (&mut x as *mut u64).cast(),
            (&mut y as *mut u64).cast(),
            (&mut n as *mut u32).cast(),
        ];
        // SAFETY: saxpy over BIG_N floats of x and y.
        ck("cuLaunchKernel", unsafe {
            cu::cuLaunchKernel(
                self.saxpy,
                BIG_N / 256,
                1,
                1,
                256,
                1,
                1,
                0,
                self.stream,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    fn sync(&self) -> Result<(), String> {
        // SAFETY: a context is current.
        ck("cuCtxSynchronize", unsafe { cu::cuCtxSynchronize() })
    }

    /// Makes `waiter` wait for `signaler` with an event, as a CUDA program orders two streams.
    fn order(
        &self,
        waiter: cu::CUstream,
        signaler: cu::CUstream,
        ev: cu::CUevent,
    ) -> Result<(), String> {
        // SAFETY: both streams and the event belong to the current context.
        unsafe {
            ck("cuEventRecord", cu::cuEventRecord(ev, signaler))?;
            ck("cuStreamWaitEvent", cu::cuStreamWaitEvent(waiter, ev, 0))
        }
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let iters: usize = std::env::args().nth(1).map_or(Ok(1000), |s| s.parse())?;
    let cuda = Cuda::new()?;
    let gpu = Gpu::attach_cuda()?;
    println!(
        "{} attached to the CUDA context: {}",
        gpu.info().name,
        gpu.selection()
    );
    let empty = gpu.load_module(CUBIN)?.kernel("empty")?;
    let mut q = gpu.queue()?;
    let cfg = LaunchConfig::linear(1, 32);
    let mut ev = std::ptr::null_mut();
    // SAFETY: out-pointer to a local; a context is current.
    ck("cuEventCreate", unsafe {
        cu::cuEventCreate(&mut ev, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
    })?;

    // Warm up both paths.
    for _ in 0..100 {
        cuda.empty(cuda.stream)?;
        // SAFETY: a kernel without parameters.
        unsafe { q.launch(&empty, &cfg, &[])? };
    }
    cuda.sync()?;
    q.synchronize()?;

    // 0. The CPU cost of one launch call with nothing else going on. Both sides wait for the GPU every BURST
    //    (APEX_BURST, 32) launches, outside the timed calls: back to back, empty kernels in stream order finish one per ~1.6 µs on
    //    the GPU, so once the queue's launch slots are full a call would time the GPU's pace, not its own cost.
    // APEX_BURST=1 waits after every launch, as examples/launch_latency's `submit` does.
    let burst: usize = std::env::var("APEX_BURST")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(32)
        .max(1);
    let mut idle_cuda = Vec::with_capacity(iters * SMALL);
    for i in 0..iters * SMALL {
        let s = Instant::now();
        cuda.empty(cuda.stream)?;
        idle_cuda.push(s.elapsed().as_secs_f64() * 1e9);
        if i % burst == burst - 1 {
            cuda.sync()?;
        }
    }
    cuda.sync()?;
    let mut idle_apex = Vec::with_capacity(iters * SMALL);
    for i in 0..iters * SMALL {
        let s = Instant::now();
        // SAFETY: a kernel without parameters.
        unsafe { q.launch(&empty, &cfg, &[])? };
        idle_apex.push(s.elapsed().as_secs_f64() * 1e9);
        if i % burst == burst - 1 {
            q.synchronize()?;
        }
    }
    q.synchronize()?;

    // 0b. The same call prepared (`Queue::prepare`), on this queue and on an attached queue in host launch memory;
    //     and an ordinary launch on a queue of APEX's own channel group (not attached) in this process, to tell
    //     what attaching costs per call from what the machine costs.
    let prepared = q.prepare(&empty, &cfg)?;
    let mut qh = gpu.queue_with(QueueOptions::default().launch_memory(LaunchMemory::Host))?;
    let prepared_h = qh.prepare(&empty, &cfg)?;
    let per_call = |q: &mut apex::Queue,
                    call: &mut dyn FnMut(&mut apex::Queue) -> apex::Result<apex::Fence>|
     -> apex::Result<Vec<f64>> {
        for _ in 0..100 {
            call(q)?;
        }
        q.synchronize()?;
        let mut v = Vec::with_capacity(iters * SMALL);
        for i in 0..iters * SMALL {
            let s = Instant::now();
            call(q)?;
            v.push(s.elapsed().as_secs_f64() * 1e9);
            if i % burst == burst - 1 {
                q.synchronize()?;
            }
        }
        q.synchronize()?;
        Ok(v)
    };
    // SAFETY (the calls below): kernels without parameters.
    let mut idle_prepared = per_call(&mut q, &mut |q| unsafe {
        q.submit_fenced(&Launch::prepared(&prepared, &[]))
    })?;
    let mut idle_prepared_host = per_call(&mut qh, &mut |q| unsafe {
        q.submit_fenced(&Launch::prepared(&prepared_h, &[]))
    })?;
    drop(qh);

    // 1. All CUDA: SMALL small kernels then one large one per iteration, one stream.
    let mut cuda_small = Vec::with_capacity(iters * SMALL);
    let t = Instant::now();
    for _ in 0..iters {
        for _ in 0..SMALL {
            let s = Instant::now();
            cuda.empty(cuda.stream)?;
            cuda_small.push(s.elapsed().as_secs_f64() * 1e9);
        }
        cuda.big()?;
    }
    cuda.sync()?;
    let cuda_total = t.elapsed();

    // 2. Small kernels through the attached queue, the large one on the CUDA stream, ordered both ways.
    let mut apex_small = Vec::with_capacity(iters * SMALL);
    let t = Instant::now();
    for _ in 0..iters {
        // SAFETY: a stream of the attached context.
        unsafe { q.wait_for_cuda_stream(cuda.stream) }?;
        for _ in 0..SMALL {
            let s = Instant::now();
            // SAFETY: a kernel without parameters.
            unsafe { q.launch(&empty, &cfg, &[])? };
            apex_small.push(s.elapsed().as_secs_f64() * 1e9);
        }
        // SAFETY: a stream of the attached context.
        unsafe { q.make_cuda_stream_wait(cuda.stream) }?;
        cuda.big()?;
    }
    cuda.sync()?;
    q.synchronize()?;
    let mixed_total = t.elapsed();

    // 2b. The same, the small kernels as one chain (`Launch::chained` links + `end_chain`): the GPU schedules each
    //     after the one before without a front-end round trip, as a CUDA graph would.
    let t = Instant::now();
    for _ in 0..iters {
        // SAFETY: a stream of the attached context.
        unsafe { q.wait_for_cuda_stream(cuda.stream) }?;
        for _ in 0..SMALL {
            // SAFETY: a kernel without parameters.
            unsafe { q.submit(&Launch::new(&empty, &cfg, &[]).chained())? };
        }
        q.end_chain()?;
        // SAFETY: a stream of the attached context.
        unsafe { q.make_cuda_stream_wait(cuda.stream) }?;
        cuda.big()?;
    }
    cuda.sync()?;
    q.synchronize()?;
    let chained_total = t.elapsed();

    // 3. Ping-pong of dependent empty kernels: CUDA stream <-> APEX queue, and CUDA stream <-> CUDA stream.
    let pp = iters.max(100);
    let t = Instant::now();
    for _ in 0..pp {
        cuda.empty(cuda.stream)?;
        // SAFETY: a stream of the attached context.
        unsafe { q.wait_for_cuda_stream(cuda.stream) }?;
        // SAFETY: a kernel without parameters.
        unsafe { q.launch(&empty, &cfg, &[])? };
        // SAFETY: a stream of the attached context.
        unsafe { q.make_cuda_stream_wait(cuda.stream) }?;
    }
    cuda.sync()?;
    q.synchronize()?;
    let pp_apex = t.elapsed();
    let t = Instant::now();
    for _ in 0..pp {
        cuda.empty(cuda.stream)?;
        cuda.order(cuda.stream2, cuda.stream, ev)?;
        cuda.empty(cuda.stream2)?;
        cuda.order(cuda.stream, cuda.stream2, ev)?;
    }
    cuda.sync()?;
    let pp_cuda = t.elapsed();

    // Last, so that nothing after it runs beside a second channel group: an own queue in this process.
    let own = Gpu::open_with(0, apex::BackendRequest::Direct)?;
    let own_empty = own.load_module(CUBIN)?.kernel("empty")?;
    let mut qo = own.queue()?;
    // SAFETY: a kernel without parameters.
    let mut idle_own = per_call(&mut qo, &mut |q| unsafe { q.launch(&own_empty, &cfg, &[]) })?;
    drop((qo, own_empty, own));

    let per = |d: Duration, n: usize| d.as_secs_f64() * 1e6 / n as f64;
    let (cs, as_) = (median(&mut cuda_small), median(&mut apex_small));
    println!("measure                                    CUDA        APEX attached   ratio");
    let (ci, ai) = (median(&mut idle_cuda), median(&mut idle_apex));
    println!(
        "launch call alone, CPU cost (median ns)    {:>8.0}    {:>8.0}        {:.2}x",
        ci,
        ai,
        ci / ai
    );
    for (what, v) in [
        (
            "  the same, prepared                     ",
            &mut idle_prepared,
        ),
        (
            "  the same, prepared, host launch memory ",
            &mut idle_prepared_host,
        ),
        ("  own (not attached) queue, same process ", &mut idle_own),
    ] {
        let m = median(v);
        println!("{what}   {ci:>8.0}    {m:>8.0}        {:.2}x", ci / m);
    }
    println!(
        "small launch in the mix, CPU (median ns)   {:>8.0}    {:>8.0}        {:.2}x",
        cs,
        as_,
        cs / as_
    );
    println!(
        "iteration: {SMALL} small + 1 large (us)           {:>8.2}    {:>8.2}        {:.2}x",
        per(cuda_total, iters),
        per(mixed_total, iters),
        per(cuda_total, iters) / per(mixed_total, iters)
    );
    println!(
        "  the same, small kernels chained (us)          {:>8.2}    {:>8.2}        {:.2}x",
        per(cuda_total, iters),
        per(chained_total, iters),
        per(cuda_total, iters) / per(chained_total, iters)
    );
    println!(
        "dependent ping-pong, per round trip (us)   {:>8.2}    {:>8.2}        {:.2}x   (CUDA: two streams and events; APEX: queue <-> stream)",
        per(pp_cuda, pp),
        per(pp_apex, pp),
        per(pp_cuda, pp) / per(pp_apex, pp)
    );
    // SAFETY: the event made above.
    unsafe { cu::cuEventDestroy_v2(ev) };
    Ok(())
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            let mut s = e.source();
            while let Some(c) = s {
                eprintln!("  caused by: {c}");
                s = c.source();
            }
            std::process::ExitCode::FAILURE
        }
    }
}
