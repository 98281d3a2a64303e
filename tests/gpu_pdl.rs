//! Programmatic dependent launches on the GPU (issue 11), both backends: thousands of `pdl_step` launches, each
//! reading and rewriting every word the launch before it wrote. `pdl_step` lets its dependent be scheduled before
//! its own writes, so only the latch (`griddepcontrol.wait`) keeps the next launch from reading stale words: any
//! word that differs from the CPU's sequence is a broken dependency. Ordinary, prepared and programmatic launches
//! of another kernel, and copies, are mixed in.

use std::time::Duration;

use apex::{Arg, BackendRequest, Buffer, Gpu, HostBuffer, Launch, LaunchConfig, Queue};

const PDL: &[u8] = include_bytes!("../kernels/apex_pdl.sm_90.cubin");
const N: u32 = 1 << 20;
const LAUNCHES: u32 = 3000;

fn words(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Words on the GPU that `pdl_step` launches advance (`x = 3x + v` each), and the CPU's copy of what they must be.
struct Steps {
    buf: Buffer,
    want: Vec<u32>,
}

impl Steps {
    /// `init` uploaded to a new buffer of as many words.
    fn new(gpu: &Gpu, q: &mut Queue, init: Vec<u32>) -> Steps {
        let buf = gpu.alloc(init.len() as u64 * 4).unwrap();
        let bytes: Vec<u8> = init.iter().flat_map(|w| w.to_le_bytes()).collect();
        q.upload(gpu, &buf, 0, &bytes).unwrap();
        Steps { buf, want: init }
    }

    /// The arguments of the `pdl_step` launch that applies `v`.
    fn args(&self, v: u32) -> [Arg<'static>; 3] {
        [
            self.buf.arg(),
            Arg::U32(self.want.len() as u32),
            Arg::U32(v),
        ]
    }

    /// What a `pdl_step` launch with `v` does, on the CPU's copy.
    fn advance(&mut self, v: u32) {
        for x in &mut self.want {
            *x = x.wrapping_mul(3).wrapping_add(v);
        }
    }

    /// Asserts that every word on the GPU (read once `q`'s work is done) is the CPU's.
    fn check(&self, gpu: &Gpu, q: &mut Queue, what: &str) {
        q.synchronize().unwrap();
        let mut out = vec![0u8; self.want.len() * 4];
        q.download(gpu, &self.buf, 0, &mut out).unwrap();
        let got = words(&out);
        let bad = got.iter().zip(&self.want).filter(|(a, b)| a != b).count();
        assert_eq!(
            bad,
            0,
            "{:?}: {bad} of {} words differ from the CPU after {what} (first at {:?})",
            gpu.backend(),
            self.want.len(),
            got.iter().zip(&self.want).position(|(a, b)| a != b)
        );
    }
}

/// A word of `host` at byte `offset`.
fn host_word(host: &HostBuffer, offset: u64) -> u32 {
    let mut b = [0u8; 4];
    host.read(offset, &mut b).unwrap();
    u32::from_le_bytes(b)
}

fn steps_match_the_cpu(request: BackendRequest) {
    let gpu = Gpu::open_with(0, request).expect("open the GPU");
    let m = gpu.load_module(PDL).unwrap();
    let step = m.kernel("pdl_step").unwrap();
    let busy = m.kernel("pdl_busy").unwrap();
    let scratch = gpu.alloc(4096).unwrap();
    let other = gpu.alloc(4096).unwrap();
    let mut q = gpu.queue().unwrap();
    let mut steps = Steps::new(&gpu, &mut q, (0..N).collect());
    // Two blocks per SM, each thread striding over several words: the kernel runs for microseconds.
    let cfg = LaunchConfig::linear(2 * gpu.info().sm_count, 256);
    let prepared = q.prepare(&step, &cfg).unwrap();
    let mut last = None;
    for v in 0..LAUNCHES {
        let args = steps.args(v);
        // SAFETY: pdl_step and pdl_busy run griddepcontrol.wait before touching memory; buf, scratch and other are
        // used by this queue alone.
        let programmatic = Launch::new(&step, &cfg, &args).programmatic();
        let f = unsafe {
            match v % 50 {
                10 => q.launch(&step, &cfg, &args),
                20 => q.submit_fenced(&Launch::prepared(&prepared, &args)),
                25..=27 => q.submit_fenced(&Launch::prepared(&prepared, &args).programmatic()),
                30 => {
                    // A programmatic launch of another kernel in between (writes only scratch).
                    let busy_cfg = LaunchConfig::linear(gpu.info().sm_count, 128);
                    let busy_args = [scratch.arg(), Arg::U32(1000)];
                    q.submit(&Launch::new(&busy, &busy_cfg, &busy_args).programmatic())
                        .unwrap();
                    q.submit_fenced(&programmatic)
                }
                40 => {
                    q.copy_device_to_device(&scratch, 0, &other, 0, 4096)
                        .unwrap();
                    q.submit_fenced(&programmatic)
                }
                _ => q.submit_fenced(&programmatic),
            }
        }
        .unwrap();
        steps.advance(v);
        last = Some(f);
    }
    last.unwrap().wait(Duration::from_secs(60)).unwrap();
    steps.check(&gpu, &mut q, &format!("{LAUNCHES} dependent launches"));
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

/// Chains of `pdl_step` links, each a programmatic dependent of the link before (`Launch::chained().programmatic()`):
/// long enough to be sent in several parts, with plain links, chain ends and an eager launch mixed in, every word
/// checked against the CPU.
fn chained_steps_match_the_cpu(request: BackendRequest) {
    let gpu = Gpu::open_with(0, request).expect("open the GPU");
    let m = gpu.load_module(PDL).unwrap();
    let step = m.kernel("pdl_step").unwrap();
    let mut q = gpu.queue().unwrap();
    let mut steps = Steps::new(&gpu, &mut q, (0..N).collect());
    let cfg = LaunchConfig::linear(2 * gpu.info().sm_count, 256);
    for v in 0..LAUNCHES {
        let args = steps.args(v);
        // SAFETY: pdl_step runs griddepcontrol.wait before touching memory; buf is used by this queue alone.
        let link = Launch::new(&step, &cfg, &args).chained();
        unsafe {
            match v % 700 {
                0 => q.submit(&link).map(drop).unwrap(),
                350 => drop(q.launch(&step, &cfg, &args).unwrap()),
                699 => {
                    q.submit(&link.programmatic()).unwrap();
                    q.end_chain().unwrap();
                }
                _ if v % 97 == 0 => q.submit(&link).map(drop).unwrap(),
                _ => q.submit(&link.programmatic()).map(drop).unwrap(),
            }
        }
        steps.advance(v);
    }
    q.end_chain()
        .unwrap()
        .wait(Duration::from_secs(60))
        .unwrap();
    steps.check(
        &gpu,
        &mut q,
        &format!("{LAUNCHES} chained programmatic launches"),
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn chained_programmatic_links_on_the_direct_path_keep_every_dependency() {
    chained_steps_match_the_cpu(BackendRequest::Direct);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn chained_programmatic_links_on_the_driver_backend_keep_every_dependency() {
    chained_steps_match_the_cpu(BackendRequest::Driver);
}

/// Many short programmatic launches: the slot ring wraps thousands of times and every gate is re-armed as often;
/// the result is still the CPU's, word for word.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn two_hundred_thousand_programmatic_launches_keep_every_dependency() {
    const SMALL: u32 = 4096;
    const MANY: u32 = 200_000;
    let gpu = Gpu::open_with(0, BackendRequest::Direct).expect("open the GPU");
    let m = gpu.load_module(PDL).unwrap();
    let step = m.kernel("pdl_step").unwrap();
    let mut q = gpu.queue().unwrap();
    let mut steps = Steps::new(&gpu, &mut q, (0..SMALL).map(|i| i ^ 0x5a5a).collect());
    let cfg = LaunchConfig::linear(8, 128);
    for v in 0..MANY {
        // SAFETY: pdl_step waits for the launch before it before touching the words, which only this queue uses.
        let args = steps.args(v);
        unsafe { q.submit(&Launch::new(&step, &cfg, &args).programmatic()) }.unwrap();
        steps.advance(v);
    }
    steps.check(&gpu, &mut q, &format!("{MANY} programmatic launches"));
}

/// A programmatic launch whose kernel runs no `griddepcontrol.wait` (it touches nothing its producer writes) may
/// run while its producer still does; its fence must still not complete before the producer has, the queue's
/// timeline must never go backwards, and an ordinary launch after both must run. The dependent also records
/// whether it ran before its producer ended, which shows that the gate really started it early.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_dependent_that_does_not_wait_completes_after_its_producer() {
    let gpu = Gpu::open_with(0, BackendRequest::Direct).expect("open the GPU");
    let m = gpu.load_module(PDL).unwrap();
    let (empty, late, nowait) = (
        m.kernel("pdl_empty").unwrap(),
        m.kernel("pdl_late").unwrap(),
        m.kernel("pdl_nowait").unwrap(),
    );
    let host = gpu.alloc_host(4096).unwrap();
    let (flag, out) = (host.device_ptr(), host.device_ptr() + 256);
    let mut q = gpu.queue().unwrap();
    let one = LaunchConfig::linear(1, 32);
    let word = |offset: u64| host_word(&host, offset);
    let mut early = 0;
    for round in 0..5 {
        host.write(0, &[0u8; 512]).unwrap();
        // SAFETY: the kernels write only `host`, which this test alone uses; pdl_empty touches nothing.
        let (producer, dependent) = unsafe {
            q.submit(&Launch::new(&empty, &one, &[]).programmatic())
                .unwrap();
            let late_args = [Arg::Ptr(flag), Arg::U32(4_000_000)];
            let a = q
                .submit_fenced(&Launch::new(&late, &one, &late_args).programmatic())
                .unwrap();
            let nowait_args = [Arg::Ptr(out), Arg::Ptr(flag)];
            let p = q
                .submit_fenced(&Launch::new(&nowait, &one, &nowait_args).programmatic())
                .unwrap();
            (a, p)
        };
        dependent.wait(Duration::from_secs(30)).unwrap();
        let flag_then = word(0);
        let producer_done = producer.is_done();
        let cq = q.direct().expect("a direct queue");
        let timeline_then = cq.queue().timeline().completed();
        q.synchronize().unwrap();
        let seen = word(256);
        let timeline_after = q.direct().unwrap().queue().timeline().completed();
        println!(
            "round {round}: when the dependent's fence completed the producer's flag was {flag_then} (fence done \
             {producer_done}), timeline {timeline_then} then {timeline_after}; the dependent saw {seen}"
        );
        assert_eq!(
            flag_then, 1,
            "round {round}: the dependent's fence completed before its producer had"
        );
        assert!(
            timeline_after >= timeline_then,
            "the timeline went backwards"
        );
        early += u32::from(seen == 10);
        // An ordinary launch after both still runs.
        // SAFETY: pdl_empty touches nothing.
        unsafe { q.launch(&empty, &one, &[]) }
            .unwrap()
            .wait(Duration::from_secs(30))
            .unwrap();
    }
    assert!(
        early > 0,
        "the dependent never ran before its producer ended: the gate never started it early"
    );
}

/// The same for a chain link and a graph node that are programmatic dependents and skip `griddepcontrol.wait`:
/// the chain's fence (the dependent is its last link) and the replay's fence (the dependent is the graph's sink, on
/// both of the queue's graph schedules) must not complete before the producer has. A replay's fence is released
/// without a wait for idle, so only the work distributor holding the dependent's completion until its latch keeps
/// this order.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn chained_and_graph_dependents_that_do_not_wait_complete_after_their_producers() {
    use apex::Graph;
    use apex::launch::GraphSchedule;
    let gpu = Gpu::open_with(0, BackendRequest::Direct).expect("open the GPU");
    let m = gpu.load_module(PDL).unwrap();
    let (late, nowait) = (
        m.kernel("pdl_late").unwrap(),
        m.kernel("pdl_nowait").unwrap(),
    );
    let host = gpu.alloc_host(4096).unwrap();
    let (flag, out) = (host.device_ptr(), host.device_ptr() + 256);
    let mut q = gpu.queue().unwrap();
    let one = LaunchConfig::linear(1, 32);
    let word = |offset: u64| host_word(&host, offset);
    let late_args = [Arg::Ptr(flag), Arg::U32(4_000_000)];
    let nowait_args = [Arg::Ptr(out), Arg::Ptr(flag)];
    let check =
        |what: &str, q: &mut apex::Queue, run: &mut dyn FnMut(&mut apex::Queue) -> apex::Fence| {
            let mut early = 0;
            for round in 0..5 {
                q.synchronize().unwrap();
                host.write(0, &[0u8; 512]).unwrap();
                let fence = run(q);
                fence.wait(Duration::from_secs(30)).unwrap();
                let flag_then = word(0);
                q.synchronize().unwrap();
                early += u32::from(word(256) == 10);
                assert_eq!(
                    flag_then, 1,
                    "{what}, round {round}: the fence completed before the producer had"
                );
            }
            println!("{what}: the dependent ran before its producer ended in {early} of 5 rounds");
        };
    check("chain", &mut q, &mut |q| {
        // SAFETY: the kernels write only `host`, which this test alone uses.
        unsafe {
            q.submit(&Launch::new(&late, &one, &late_args).chained())
                .unwrap();
            q.submit(
                &Launch::new(&nowait, &one, &nowait_args)
                    .chained()
                    .programmatic(),
            )
            .unwrap();
        }
        q.end_chain().unwrap()
    });
    check("chain, the last link's ticket", &mut q, &mut |q| {
        // SAFETY: as above.
        let t = unsafe {
            q.submit(&Launch::new(&late, &one, &late_args).chained())
                .unwrap();
            q.submit(
                &Launch::new(&nowait, &one, &nowait_args)
                    .chained()
                    .programmatic(),
            )
            .unwrap()
        };
        // The chain is sent by flush: the ticket's fence completes with it.
        q.flush().unwrap();
        q.fence(t).unwrap()
    });
    for schedule in [GraphSchedule::Gpu, GraphSchedule::FrontEnd] {
        q.direct().unwrap().set_graph_schedule(schedule);
        let mut g = Graph::new();
        let a = g.launch(&late, one, &late_args).unwrap().id();
        let b = g
            .launch(&nowait, one, &nowait_args)
            .unwrap()
            .programmatic()
            .id();
        g.edge(a, b).unwrap();
        let mut exec = q.instantiate(&g).unwrap();
        // SAFETY: as above.
        check(&format!("graph ({schedule:?})"), &mut q, &mut |q| unsafe {
            q.replay(&mut exec).unwrap()
        });
    }
}
