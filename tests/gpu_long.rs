//! Long runs and threads (run with `--include-ignored` on an NVIDIA GPU).

use std::sync::Arc;
use std::time::{Duration, Instant};

use apex::launch::{Arg, ComputeQueue, ComputeQueueConfig, LaunchConfig};
use apex::module::Module;
use apex::pushbuf::{Queue, QueueConfig, Signal};
use apex::rm::{GpuCore, Memory, MemoryDesc};

const CUBIN: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

fn maps() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .map(|m| m.lines().count())
        .unwrap_or(0)
}

fn chain(q: &mut ComputeQueue, m: &Arc<Module>, v: &Memory, n: u64, seed: u64) -> u64 {
    let k = m.kernel("chain_step").unwrap();
    v.write(0, &seed.to_le_bytes()).unwrap();
    let mut expect = seed;
    let mut last = None;
    for i in 0..n {
        let (mul, add) = (i.wrapping_mul(0x9e37_79b9) | 1, i ^ seed);
        expect = expect.wrapping_mul(mul).wrapping_add(add);
        // SAFETY: `v` is the 8 bytes the kernel touches.
        last = Some(
            unsafe {
                q.launch(
                    &k,
                    &LaunchConfig::linear(1, 1),
                    &[Arg::Ptr(v.va()), Arg::U64(mul), Arg::U64(add)],
                )
            }
            .unwrap(),
        );
    }
    last.unwrap().wait(Duration::from_secs(30)).unwrap();
    let mut b = [0u8; 8];
    v.read(0, &mut b).unwrap();
    assert_eq!(u64::from_le_bytes(b), expect);
    expect
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_million_launches_build_a_checked_chain() {
    let gpu = GpuCore::open(0).unwrap();
    let mut q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).unwrap();
    let m = Module::load(&gpu, CUBIN).unwrap();
    let v = Memory::alloc(&gpu, MemoryDesc::video(8).with_cpu()).unwrap();
    let t = Instant::now();
    chain(&mut q, &m, &v, 1_000_000, 0x1234_5678);
    let wraps = q.queue().last_submitted() / u64::from(q.queue().channel().ring_state().entries());
    eprintln!(
        "10^6 dependent launches in {:?}, {wraps} ring wraps",
        t.elapsed()
    );
    assert!(wraps > 100);
}

/// Create/destroy cycles of GPU, compute queue, module and buffer, each running a checked chain.
/// `APEX_CYCLES` sets the count (default 1000). `APEX_CYCLES_ANCHOR=1` keeps one more GPU open throughout, so
/// the kernel driver's per-GPU state (UVM's GPU registration) stays up, as in a runtime that holds a device
/// while it recreates contexts. `APEX_CYCLES_TRACE=1` logs every ioctl of the first cycle with its duration.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_queue_module_cycles_return_to_baseline() {
    let env = |k: &str| std::env::var(k).ok();
    let cycles: usize = env("APEX_CYCLES")
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let anchor = env("APEX_CYCLES_ANCHOR").is_some_and(|v| v == "1");
    let traced = env("APEX_CYCLES_TRACE").is_some_and(|v| v == "1");
    let _anchor = anchor.then(|| GpuCore::open(0).unwrap());
    drop(GpuCore::open(0).unwrap());
    let (f0, m0, r0) = (fds(), maps(), apex::rm::live_objects());
    eprintln!("baseline: fds {f0}, mappings {m0}, RM objects {r0}; anchor {anchor}");
    const PHASES: [&str; 8] = [
        "open",
        "queue",
        "module",
        "buffer",
        "chain",
        "drop module+buffer",
        "drop queue",
        "drop gpu",
    ];
    let mut total = [Duration::ZERO; PHASES.len()];
    let mut slowest = Duration::ZERO;
    let t = Instant::now();
    for i in 0..cycles {
        let run = || {
            let mut at = [Instant::now(); PHASES.len() + 1];
            let gpu = GpuCore::open(0).unwrap();
            at[1] = Instant::now();
            let mut q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).unwrap();
            at[2] = Instant::now();
            let m = Module::load(&gpu, CUBIN).unwrap();
            at[3] = Instant::now();
            let v = Memory::alloc(&gpu, MemoryDesc::video(8).with_cpu()).unwrap();
            at[4] = Instant::now();
            chain(&mut q, &m, &v, 3, i as u64);
            at[5] = Instant::now();
            drop((v, m));
            at[6] = Instant::now();
            drop(q);
            at[7] = Instant::now();
            drop(gpu);
            at[8] = Instant::now();
            at
        };
        let at = if traced && i == 0 {
            let sub = tracing_subscriber::fmt()
                .with_max_level(tracing::Level::TRACE)
                .with_writer(std::io::stderr)
                .finish();
            tracing::subscriber::with_default(sub, run)
        } else {
            run()
        };
        for p in 0..PHASES.len() {
            total[p] += at[p + 1] - at[p];
        }
        slowest = slowest.max(at[PHASES.len()] - at[0]);
        if (i + 1) % 1000 == 0 {
            eprintln!(
                "{} cycles, {:?}: fds {}, mappings {}, RM objects {}",
                i + 1,
                t.elapsed(),
                fds(),
                maps(),
                apex::rm::live_objects()
            );
        }
    }
    let per = |d: Duration| d / cycles.max(1) as u32;
    let phases: Vec<String> = PHASES
        .iter()
        .zip(total)
        .map(|(n, d)| format!("{n} {:?}", per(d)))
        .collect();
    eprintln!(
        "{cycles} GPU+queue+module cycles in {:?} (per cycle: {}; slowest cycle {slowest:?}); \
         fds {f0} -> {}, mappings {m0} -> {}, RM objects {r0} -> {}",
        t.elapsed(),
        phases.join(", "),
        fds(),
        maps(),
        apex::rm::live_objects()
    );
    assert_eq!((fds(), maps(), apex::rm::live_objects()), (f0, m0, r0));
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn eight_threads_each_with_its_own_queue() {
    let secs: u64 = std::env::var("APEX_THREAD_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let gpu = GpuCore::open(0).unwrap();
    let m = Module::load(&gpu, CUBIN).unwrap();
    let handles: Vec<_> = (0..8u64)
        .map(|t| {
            let (gpu, m) = (gpu.clone(), m.clone());
            std::thread::spawn(move || {
                let mut q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).unwrap();
                let v = Memory::alloc(&gpu, MemoryDesc::video(8).with_cpu()).unwrap();
                let end = Instant::now() + Duration::from_secs(secs);
                let mut rounds = 0u64;
                while Instant::now() < end {
                    chain(&mut q, &m, &v, 1000, t * 1_000_003 + rounds);
                    rounds += 1;
                }
                rounds * 1000
            })
        })
        .collect();
    let total: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
    eprintln!("8 threads, {secs} s: {total} checked launches");
    assert!(total > 0);
}

/// Runs one role of [`no_submission_is_lost_beside_other_processes`] or
/// [`a_long_grid_completes_beside_another_process`] in this process, for `secs` seconds, and
/// returns what it did.
fn contention_role(role: &str, secs: u64) -> String {
    fn lost(what: &str, i: u64, e: &dyn std::fmt::Display) -> ! {
        panic!("{what}: submission {i} not done within 1 s (a lost doorbell?): {e}")
    }
    let gpu = GpuCore::open(0).unwrap();
    let end = Instant::now() + Duration::from_secs(secs);
    let mut n = 0u64;
    match role {
        "round-trips" => {
            let mut q = Queue::new(&gpu, QueueConfig::default()).unwrap();
            while Instant::now() < end {
                let f = q.submit(0, Signal::Host, |_, _| {}).unwrap();
                if let Err(e) = f.wait(Duration::from_secs(1)) {
                    let ch = q.channel();
                    let at = format!(
                        "GP_GET {} of GP_PUT {}",
                        ch.read_gp_get(),
                        ch.published_put()
                    );
                    lost(&format!("round trips ({at})"), n, &e);
                }
                n += 1;
            }
        }
        "launches" => {
            let m = Module::load(&gpu, CUBIN).unwrap();
            let k = m.kernel("chain_step").unwrap();
            let v = Memory::alloc(&gpu, MemoryDesc::video(8).with_cpu()).unwrap();
            let mut q = ComputeQueue::new(&gpu, ComputeQueueConfig::default()).unwrap();
            while Instant::now() < end {
                // SAFETY: `v` is the 8 bytes the kernel touches.
                let f = unsafe {
                    q.launch(
                        &k,
                        &LaunchConfig::linear(1, 1),
                        &[Arg::Ptr(v.va()), Arg::U64(3), Arg::U64(1)],
                    )
                }
                .unwrap();
                if let Err(e) = f.wait(Duration::from_secs(1)) {
                    lost("launches", n, &e);
                }
                n += 1;
            }
        }
        "long-grid" => return long_grid(&gpu, secs),
        other => panic!("unknown role {other}"),
    }
    format!("{role}: {n} in {secs} s")
}

/// Runs one grid of about `secs` seconds made of blocks of about 5 ms each (`spill`, calibrated on this GPU first),
/// and waits for it: the grid must complete.
fn long_grid(gpu: &Arc<GpuCore>, secs: u64) -> String {
    let m = Module::load(gpu, CUBIN).unwrap();
    let k = m.kernel("spill").unwrap();
    let wave = gpu.info().sm_count * 32;
    let block = Duration::from_millis(5);
    let waves = (Duration::from_secs(secs).as_secs_f64() / block.as_secs_f64()).ceil() as u32;
    // Before the queue, so that it is freed after the queue (which waits for the grid) even on a timeout.
    let out = Memory::alloc(
        gpu,
        MemoryDesc::video(u64::from(wave) * u64::from(waves) * 4),
    )
    .unwrap();
    let mut q = ComputeQueue::new(gpu, ComputeQueueConfig::default()).unwrap();
    let mut run = |blocks: u32, n: u32, limit: Duration| {
        let t = Instant::now();
        // SAFETY: `out` holds a word for each of the grid's threads, the only memory `spill` writes.
        unsafe {
            q.launch(
                &k,
                &LaunchConfig::linear(blocks, 1),
                &[Arg::Ptr(out.va()), Arg::U32(7), Arg::U32(n)],
            )
        }
        .unwrap()
        .wait(limit)
        .map(|()| t.elapsed())
    };
    // The first launch grows the queue's local memory (a wait for idle): not part of what is timed.
    run(wave, 1, Duration::from_secs(30)).unwrap();
    let n0 = 20_000u32;
    let t0 = run(wave, n0, Duration::from_secs(30)).unwrap();
    let n = (f64::from(n0) * block.as_secs_f64() / t0.as_secs_f64()).clamp(1.0, 1e9) as u32;
    eprintln!("long-grid: launched, {waves} waves of {n} iterations ({n0} took {t0:?})");
    match run(wave * waves, n, Duration::from_secs(secs * 10 + 30)) {
        // Shorter than intended, the grid would not have overlapped the other process long enough to matter.
        Ok(took) if took < Duration::from_secs(secs) * 3 / 4 => {
            panic!(
                "the long grid took only {took:?} of the {secs} s intended: the calibration is off"
            )
        }
        Ok(took) => format!("long-grid: completed in {took:?}"),
        Err(e) => panic!("the long grid did not complete: {e}"),
    }
}

/// The role a child process of [`no_submission_is_lost_beside_other_processes`] or
/// [`a_long_grid_completes_beside_another_process`] plays.
const CONTENTION_ROLE: &str = "APEX_CONTENTION_ROLE";

/// Runs test `test` of this binary again in a process of its own, playing `role` for `secs` seconds; its output is
/// piped.
fn spawn_role(test: &str, role: &str, secs: u64) -> std::process::Child {
    std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--include-ignored", "--nocapture"])
        .env(CONTENTION_ROLE, role)
        .env("APEX_CONTENTION_SECS", secs.to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// Reports what a role's process said (`lines`, its stderr) and whether it succeeded: it must have exited with
/// success and printed its summary (a line starting with the role's name, other than the long grid's "launched"),
/// since a child whose filter matched no test would exit 0 having done nothing.
fn role_succeeded(role: &str, exited_ok: bool, lines: &[String]) -> bool {
    let said: Vec<&str> = lines
        .iter()
        .map(String::as_str)
        .filter(|l| {
            l.starts_with(role)
                || l.contains("panicked")
                || l.contains("did not")
                || l.contains("not done")
        })
        .collect();
    eprintln!("{role} process: {}", said.join(" / "));
    let reported = said
        .iter()
        .any(|l| l.starts_with(role) && !l.contains("launched"));
    exited_ok && reported
}

/// A finished child's stderr, as lines.
fn stderr_lines(out: &std::process::Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .map(String::from)
        .collect()
}

/// Two processes run bare semaphore round trips as fast as they can; a second later a third starts launching
/// kernels and waiting for each. Every submission must complete: one whose doorbell reached the GPU before its
/// GP_PUT did (a doorbell through BAR0, USERD written through BAR1) waits for the next doorbell, which these loops
/// never send, and is caught as a wait of over a second. Built with the BAR0 doorbell, each round-trip process lost
/// a submission in every run on an H100 (11 of 11 processes); threads of one process did not show it. Each role is
/// this test run again by its own process (`APEX_CONTENTION_ROLE`); `APEX_CONTENTION_SECS` sets the run (default
/// 10 s).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn no_submission_is_lost_beside_other_processes() {
    let secs: u64 = std::env::var("APEX_CONTENTION_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    if let Ok(role) = std::env::var(CONTENTION_ROLE) {
        eprintln!("{}", contention_role(&role, secs));
        return;
    }
    let test = "no_submission_is_lost_beside_other_processes";
    let mut children = vec![
        ("round-trips", spawn_role(test, "round-trips", secs + 2)),
        ("round-trips", spawn_role(test, "round-trips", secs + 2)),
    ];
    std::thread::sleep(Duration::from_secs(1));
    children.push(("launches", spawn_role(test, "launches", secs)));
    let mut failed = Vec::new();
    for (role, child) in children {
        let out = child.wait_with_output().unwrap();
        if !role_succeeded(role, out.status.success(), &stderr_lines(&out)) {
            failed.push(role);
        }
    }
    assert!(failed.is_empty(), "processes failed: {failed:?}");
}

/// One process runs a grid of about 8 s made of short blocks; once it runs, another process launches kernels and
/// waits for each, for 6 s. The grid must complete. With RM's default compute preemption (wait for the grid to
/// end), RM ended such a grid with a context-switch timeout (Xid 109) 4.3 s after the other process began; the
/// channel groups are now set to instruction-level preemption (CILP), as libcuda sets its own, and the engine
/// takes turns between the two. Roles run as in [`no_submission_is_lost_beside_other_processes`].
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_long_grid_completes_beside_another_process() {
    if let Ok(role) = std::env::var(CONTENTION_ROLE) {
        let secs = std::env::var("APEX_CONTENTION_SECS")
            .unwrap()
            .parse()
            .unwrap();
        eprintln!("{}", contention_role(&role, secs));
        return;
    }
    let test = "a_long_grid_completes_beside_another_process";
    let mut long = spawn_role(test, "long-grid", 8);
    // The launching process starts once the grid runs (the child calibrates it first), read off its stderr.
    let stderr = long.stderr.take().unwrap();
    let (started, grid_runs) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in std::io::BufRead::lines(std::io::BufReader::new(stderr)).map_while(Result::ok) {
            if line.starts_with("long-grid: launched") {
                let _ = started.send(());
            }
            lines.push(line);
        }
        lines
    });
    let _ = grid_runs.recv_timeout(Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(500));
    let launches = spawn_role(test, "launches", 6);
    let long_ok = long.wait().unwrap().success();
    let long_said = reader.join().unwrap();
    let out = launches.wait_with_output().unwrap();
    let mut failed = Vec::new();
    if !role_succeeded("long-grid", long_ok, &long_said) {
        failed.push("long-grid");
    }
    if !role_succeeded("launches", out.status.success(), &stderr_lines(&out)) {
        failed.push("launches");
    }
    assert!(failed.is_empty(), "processes failed: {failed:?}");
}
