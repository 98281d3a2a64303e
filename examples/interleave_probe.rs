//! Diagnostic: direct launches interleaved with CUDA driver launches in the same process, for each way a
//! launch can wait for the previous one. Prints, per variant, whether every launch completed and, if not,
//! where the channel stopped.

mod support;

use std::time::{Duration, Instant};

use apex::driver;
use apex::launch::{ComputeQueue, ComputeQueueConfig, LaunchConfig};
use apex::module::Module;
use apex::pushbuf::Acquire;
use apex::rm::GpuCore;

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
const ONE: LaunchConfig = LaunchConfig::new([1, 1, 1], [1, 1, 1]);

fn main() -> std::process::ExitCode {
    support::report(run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = driver::Context::new(0)?;
    let gpu = GpuCore::open(0)?;
    let k = Module::load(&gpu, CUBIN)?.kernel("empty")?;
    let mut stream = driver::Stream::new(&ctx)?;
    let f = driver::Module::load(&ctx, CUBIN)?.function("empty")?;
    let variants = [
        ("circ_geq", Acquire::CircularGeq, false, true),
        ("strict_geq", Acquire::StrictGeq, false, true),
        ("circ_geq+switch_tsg", Acquire::CircularGeq, true, true),
        ("circ_geq, no CUDA work", Acquire::CircularGeq, false, false),
    ];
    for (name, cmp, switch, with_cuda) in variants {
        let mut q = ComputeQueue::new(&gpu, ComputeQueueConfig::default())?;
        q.set_ordering(cmp, switch);
        let t = Instant::now();
        let mut failed = None;
        for i in 0..20_000u32 {
            // SAFETY: the empty kernel touches no memory.
            let fence = unsafe { q.launch(&k, &ONE, &[]) }?;
            if with_cuda {
                // SAFETY: as above.
                unsafe { stream.launch(&f, [1, 1, 1], [1, 1, 1], 0, &mut []) }?;
            }
            if i % 64 == 63 {
                if let Err(e) = fence.wait(Duration::from_secs(2)) {
                    let ch = q.queue().channel();
                    failed = Some(format!(
                        "launch {i}: {e}; GP_GET {} PUT {}; timeline {} want {}; fault {:?}",
                        ch.read_gp_get(),
                        ch.ring_state().put(),
                        q.queue().timeline().completed(),
                        fence.value(),
                        ch.fault()
                    ));
                    break;
                }
                stream.synchronize()?;
            }
        }
        match failed {
            None => println!("{name:<24} ok: 20000 launches in {:?}", t.elapsed()),
            Some(why) => println!("{name:<24} STUCK at {why}"),
        }
        stream.synchronize()?;
    }
    Ok(())
}
