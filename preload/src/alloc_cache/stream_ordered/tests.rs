//! The stream-ordered flows against a driver double that records what would reach libcuda: a loop served without
//! libcuda, another stream served only once the free is complete (a synchronization, or a marker taken when another
//! stream asks), the default-pool and capture conditions, streams of another context, a second free, a destroyed
//! stream, out-of-memory retries, trims and pool queries.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};

use super::*;
use crate::alloc_cache::frees_so_far;

const CTX: usize = 0xc0;
const DEFAULT_POOL: usize = 0xd0;
const S1: usize = 0x5000;
const S2: usize = 0x6000;
/// A stream of another context.
const ELSEWHERE: usize = 0x7000;

/// libcuda and the engine as the flows see them.
struct Fake {
    generation: Cell<u64>,
    capturing: Cell<bool>,
    current_pool: Cell<usize>,
    /// Out-of-memory answers still to give.
    oom: Cell<u32>,
    next_ptr: Cell<u64>,
    next_event: Cell<usize>,
    /// Events whose work is complete.
    complete: RefCell<HashSet<usize>>,
    /// libcuda refuses records on these streams.
    bad_streams: RefCell<HashSet<usize>>,
    /// libcuda refuses waits for these events.
    bad_events: RefCell<HashSet<usize>>,
    /// Streams made without `CU_STREAM_NON_BLOCKING` (the others are non-blocking).
    blocking: RefCell<HashSet<usize>>,
    /// Runs inside `event_record`: what another thread does meanwhile.
    on_record: RefCell<Option<Box<dyn Fn()>>>,
    calls: RefCell<Vec<String>>,
    /// Pool queries made (`pools`).
    asked: Cell<u32>,
    streams: HashMap<usize, usize>,
    /// libcuda's allocations from the default pool and their sizes.
    live: RefCell<HashMap<u64, usize>>,
    /// Stream-ordered frees libcuda was given that their streams have not reached yet: libcuda counts their blocks
    /// as used until then (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT`).
    in_flight: RefCell<Vec<u64>>,
}

impl Fake {
    fn new() -> Fake {
        Fake {
            generation: Cell::new(1),
            capturing: Cell::new(false),
            current_pool: Cell::new(DEFAULT_POOL),
            oom: Cell::new(0),
            next_ptr: Cell::new(0x10_0000),
            next_event: Cell::new(1),
            complete: RefCell::new(HashSet::new()),
            bad_streams: RefCell::new(HashSet::new()),
            bad_events: RefCell::new(HashSet::new()),
            blocking: RefCell::new(HashSet::new()),
            on_record: RefCell::new(None),
            calls: RefCell::new(Vec::new()),
            asked: Cell::new(0),
            streams: HashMap::from([(S1, CTX), (S2, CTX), (ELSEWHERE, CTX + 1)]),
            live: RefCell::new(HashMap::new()),
            in_flight: RefCell::new(Vec::new()),
        }
    }

    /// The default pool's used bytes as libcuda counts them.
    fn pool_used(&self) -> usize {
        self.live.borrow().values().sum()
    }

    /// Every stream reaches the frees it was given (the program synchronized).
    fn reach_all(&self) {
        let done = std::mem::take(&mut *self.in_flight.borrow_mut());
        let mut live = self.live.borrow_mut();
        for p in done {
            live.remove(&p);
        }
    }

    fn log(&self, s: String) {
        self.calls.borrow_mut().push(s);
    }

    /// What reached libcuda since the last look.
    fn calls(&self) -> Vec<String> {
        std::mem::take(&mut self.calls.borrow_mut())
    }

    fn complete_all(&self) {
        let n = self.next_event.get();
        self.complete.borrow_mut().extend(1..n);
    }
}

impl Driver for Fake {
    type Ordered = ();
    fn pool_generation(&self) -> u64 {
        self.generation.get()
    }
    fn current_context(&self) -> Option<usize> {
        Some(CTX)
    }
    fn capturing(&self) -> bool {
        self.capturing.get()
    }
    fn pools(&self) -> Option<(usize, usize)> {
        self.asked.set(self.asked.get() + 1);
        Some((self.current_pool.get(), DEFAULT_POOL))
    }
    fn stream_context(&self, handle: usize) -> Option<usize> {
        self.streams.get(&handle).copied()
    }
    fn stream_nonblocking(&self, handle: usize) -> bool {
        !self.blocking.borrow().contains(&handle)
    }
    unsafe fn alloc_async(&self, dptr: *mut u64, bytes: usize, stream: usize, _: bool) -> c_int {
        self.log(format!("alloc {bytes} on {stream:#x}"));
        if self.oom.get() > 0 {
            self.oom.set(self.oom.get() - 1);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        let p = self.next_ptr.get();
        self.next_ptr.set(p + 0x10_0000);
        self.live.borrow_mut().insert(p, bytes);
        // SAFETY: the tests pass a live u64.
        unsafe { *dptr = p };
        CUDA_SUCCESS
    }
    fn free_async(&self, ptr: u64, stream: usize, _: bool) -> c_int {
        self.log(format!("free {ptr:#x} on {stream:#x}"));
        // libcuda stops counting the block as used at once (an H100, 580.159.04: the pool's used bytes asked right
        // after came back without it).
        self.live.borrow_mut().remove(&ptr);
        self.in_flight.borrow_mut().push(ptr);
        CUDA_SUCCESS
    }
    fn free(&self, ptr: u64) -> c_int {
        self.log(format!("cuMemFree {ptr:#x}"));
        // A pool block freed with cuMemFree stays counted as used (what libcuda answered on the same H100): the
        // cache never gives pool blocks back this way.
        CUDA_SUCCESS
    }
    fn free_point(&self, _: usize, _: bool) -> FreePoint<()> {
        FreePoint::Cuda(())
    }
    fn after(&self, _: usize, _: bool, _: ()) {}
    fn event_create(&self) -> Option<usize> {
        let e = self.next_event.get();
        self.next_event.set(e + 1);
        self.log(format!("create {e}"));
        Some(e)
    }
    fn event_record(&self, event: usize, stream: usize) -> c_int {
        if self.bad_streams.borrow().contains(&stream) {
            return 400;
        }
        self.complete.borrow_mut().remove(&event);
        self.log(format!("record {event} on {stream:#x}"));
        if let Some(f) = self.on_record.borrow().as_ref() {
            f();
        }
        CUDA_SUCCESS
    }
    fn event_query(&self, event: usize) -> c_int {
        if self.complete.borrow().contains(&event) {
            CUDA_SUCCESS
        } else {
            600
        }
    }
    fn event_synchronize(&self, event: usize) -> c_int {
        if self.bad_events.borrow().contains(&event) {
            return 400;
        }
        self.log(format!("wait {event}"));
        self.complete.borrow_mut().insert(event);
        CUDA_SUCCESS
    }
    fn event_destroy(&self, event: usize) {
        self.log(format!("destroy {event}"));
    }
    fn fence_done(&self, f: &apex::Fence) -> bool {
        f.is_done()
    }
    fn wait_fence(&self, _: &apex::Fence) -> Result<(), String> {
        Ok(())
    }
    fn trim_to_threshold(&self, pool: usize) {
        self.log(format!("trim {pool:#x}"));
    }
}

fn cache() -> Mutex<AllocCache> {
    Mutex::new(AllocCache::new(1 << 30))
}

/// The program synchronized the context (`cudaDeviceSynchronize`): every stream's work is complete, events too.
fn settle(c: &Mutex<AllocCache>, d: &Fake) {
    d.complete_all();
    synchronized(c, d, None, frees_so_far());
}

/// `cudaMallocAsync` through the flow: (CUresult, pointer).
fn malloc(c: &Mutex<AllocCache>, d: &Fake, bytes: usize, stream: usize) -> (c_int, u64) {
    let mut p = 0u64;
    // SAFETY: a live out-parameter.
    let r = unsafe { alloc(c, d, &mut p, bytes, stream, false) };
    (r, p)
}

/// Allocates and frees `bytes` on `stream` until the cache keeps its block (the size asked for twice).
fn held_block(c: &Mutex<AllocCache>, d: &Fake, bytes: usize, stream: usize) -> u64 {
    loop {
        let (r, p) = malloc(c, d, bytes, stream);
        assert_eq!(r, CUDA_SUCCESS);
        assert_eq!(free(c, d, p, stream, false), CUDA_SUCCESS);
        if locked(c).block(p) == Block::Held {
            return p;
        }
    }
}

#[test]
fn a_loop_on_one_stream_is_served_without_libcuda() {
    let (c, d) = (cache(), Fake::new());
    let mut got = Vec::new();
    for _ in 0..4 {
        let (r, p) = malloc(&c, &d, 4096, S1);
        assert_eq!(r, CUDA_SUCCESS);
        got.push(p);
        assert_eq!(free(&c, &d, p, S1, false), CUDA_SUCCESS);
        if got.len() == 2 {
            // The first free was a one-off's; the second block is kept, with no driver call.
            assert_eq!(
                d.calls(),
                [
                    "alloc 4096 on 0x5000",
                    "free 0x100000 on 0x5000",
                    "alloc 4096 on 0x5000",
                ]
            );
        }
    }
    assert_eq!(got[2], got[1]);
    assert_eq!(got[3], got[1]);
    // From then on: no allocation, no free, no event: nothing reaches libcuda.
    assert!(d.calls().is_empty());
    let s = locked(&c).stats();
    assert_eq!(
        (s.async_hits, s.async_misses, s.async_kept, s.async_unready),
        (2, 2, 3, 0)
    );
    assert_eq!(d.asked.get(), 1, "pools asked once per generation");
}

#[test]
fn another_stream_gets_the_block_only_once_the_free_is_complete() {
    let (c, d) = (cache(), Fake::new());
    let p = held_block(&c, &d, 4096, S1);
    d.calls();
    // S1's work up to the free may still run: S2's allocation goes to libcuda, and the block is marked on S1 (an
    // event recorded there now stands for the free, which came before it).
    let (r, q) = malloc(&c, &d, 4096, S2);
    assert_eq!(r, CUDA_SUCCESS);
    assert_ne!(q, p);
    assert_eq!(
        d.calls(),
        ["create 1", "record 1 on 0x5000", "alloc 4096 on 0x6000"]
    );
    assert_eq!(locked(&c).stats().async_unready, 1);
    // Not yet complete: libcuda again, and no second marker.
    let (_, q2) = malloc(&c, &d, 4096, S2);
    assert_ne!(q2, p);
    assert_eq!(d.calls(), ["alloc 4096 on 0x6000"]);
    d.complete_all();
    assert_eq!(malloc(&c, &d, 4096, S2), (CUDA_SUCCESS, p));
    assert!(d.calls().is_empty());
}

#[test]
fn a_synchronized_stream_hands_its_frees_to_any_stream_without_libcuda() {
    let (c, d) = (cache(), Fake::new());
    let p = held_block(&c, &d, 4096, S1);
    let q = held_block(&c, &d, 8192, S2);
    d.calls();
    // S2 synchronized: its free is complete, S1's is not known to be.
    synchronized(&c, &d, Some(StreamKey::Handle(S2)), frees_so_far());
    assert_eq!(malloc(&c, &d, 8192, S1), (CUDA_SUCCESS, q));
    assert!(d.calls().is_empty());
    let (_, r) = malloc(&c, &d, 4096, S2);
    assert_ne!(r, p);
    // The context synchronized (cudaDeviceSynchronize): every free so far is complete.
    synchronized(&c, &d, None, frees_so_far());
    d.calls();
    free(&c, &d, r, S2, false);
    // 4096 was seen crossing from S1 to S2: its frees are marked at once now (the marker's event is a spare one).
    assert_eq!(d.calls(), ["record 1 on 0x6000"]);
    assert_eq!(
        malloc(&c, &d, 4096, S2),
        (CUDA_SUCCESS, r),
        "its own stream first"
    );
    assert_eq!(malloc(&c, &d, 4096, S2).1, p, "then a complete one");
    assert!(d.calls().is_empty());
    // 8192 never crossed unmarked (S2's block was complete when S1 took it): its frees stay unmarked.
    free(&c, &d, q, S1, false);
    assert!(d.calls().is_empty());
    // A synchronization of another thread's default stream completes nothing held.
    synchronized(&c, &d, Some(StreamKey::PerThread(u64::MAX)), frees_so_far());
}

/// A free another thread makes while a synchronization of its stream runs may follow work that synchronization did
/// not wait for: only the frees kept before it began are completed.
#[test]
fn a_synchronization_completes_only_the_frees_made_before_it_began() {
    let (c, d) = (cache(), Fake::new());
    let p = held_block(&c, &d, 4096, S1);
    // cuStreamSynchronize(S1) begins (the hook reads the count), then another thread frees q on S1.
    let before = frees_so_far();
    let (_, q) = malloc(&c, &d, 4096, S1);
    assert_eq!(q, p, "the same stream takes it at once");
    let (_, r) = malloc(&c, &d, 4096, S1);
    free(&c, &d, q, S1, false);
    free(&c, &d, r, S1, false);
    synchronized(&c, &d, Some(StreamKey::Handle(S1)), before);
    d.calls();
    // Neither free is known complete: S2 marks one and goes to libcuda.
    let (_, x) = malloc(&c, &d, 4096, S2);
    assert!(x != q && x != r);
    assert!(
        d.calls()
            .iter()
            .any(|c| c.starts_with("alloc 4096 on 0x6000"))
    );
    // The next synchronization completes them.
    synchronized(&c, &d, Some(StreamKey::Handle(S1)), frees_so_far());
    assert!([q, r].contains(&malloc(&c, &d, 4096, S2).1));
}

#[test]
fn a_destroyed_stream_marks_its_unmarked_blocks_on_itself_first() {
    let (c, d) = (cache(), Fake::new());
    let p = held_block(&c, &d, 4096, S1);
    let q = held_block(&c, &d, 8192, S1);
    // q marked (event 1): another stream asked for its size.
    malloc(&c, &d, 8192, S2);
    d.calls();
    stream_destroyed(&c, &d, S1);
    // p is marked on S1 while S1 exists (a marker outlives its stream); both stay held.
    assert_eq!(d.calls(), ["create 2", "record 2 on 0x5000"]);
    assert_eq!(locked(&c).block(p), Block::Held);
    assert_eq!(locked(&c).block(q), Block::Held);
    // A new stream with S1's handle does not take either before its free is complete.
    assert_ne!(malloc(&c, &d, 8192, S1).1, q);
    assert_ne!(malloc(&c, &d, 4096, S1).1, p);
    d.complete_all();
    d.calls();
    assert_eq!(malloc(&c, &d, 8192, S1), (CUDA_SUCCESS, q));
    assert_eq!(malloc(&c, &d, 4096, S1), (CUDA_SUCCESS, p));
    assert!(d.calls().is_empty());
}

#[test]
fn a_destroyed_stream_frees_on_itself_the_blocks_it_cannot_mark() {
    let (c, d) = (cache(), Fake::new());
    let p = held_block(&c, &d, 4096, S1);
    d.bad_streams.borrow_mut().insert(S1);
    d.calls();
    stream_destroyed(&c, &d, S1);
    // The record is refused: the block goes back to libcuda on S1, after the program's free.
    assert_eq!(
        d.calls(),
        ["create 1".to_string(), format!("free {p:#x} on 0x5000")]
    );
    assert_eq!(locked(&c).block(p), Block::Unknown);
    assert_eq!(locked(&c).stats().held_bytes, 0);
}

/// A free on a blocking stream (or the legacy one) also follows the other's earlier work (implicit synchronization),
/// which a synchronization of that stream alone does not wait for: only the context's synchronization, or a marker,
/// completes it.
#[test]
fn a_synchronized_blocking_stream_does_not_complete_its_frees() {
    let (c, d) = (cache(), Fake::new());
    d.blocking.borrow_mut().insert(S1);
    let p = held_block(&c, &d, 4096, S1);
    synchronized(&c, &d, Some(StreamKey::Handle(S1)), frees_so_far());
    synchronized(&c, &d, Some(StreamKey::Legacy), frees_so_far());
    d.calls();
    assert_ne!(malloc(&c, &d, 4096, S2).1, p);
    // Marked on demand meanwhile; the context's synchronization completes it either way.
    synchronized(&c, &d, None, frees_so_far());
    assert_eq!(malloc(&c, &d, 4096, S2), (CUDA_SUCCESS, p));
}

#[test]
fn nothing_is_served_while_another_pool_is_current() {
    let (c, d) = (cache(), Fake::new());
    let p = held_block(&c, &d, 256, S1);
    // cudaDeviceSetMemPool(dev, other): the generation moves, the default pool's blocks go back.
    d.current_pool.set(0xe0);
    d.generation.set(2);
    d.calls();
    after_pool_set(&c, &d);
    assert_eq!(d.calls(), [format!("free {p:#x} on 0x5000")]);
    for _ in 0..3 {
        let (r, q) = malloc(&c, &d, 256, S1);
        assert_eq!(r, CUDA_SUCCESS);
        assert_eq!(free(&c, &d, q, S1, false), CUDA_SUCCESS);
    }
    assert_eq!(d.calls().len(), 6, "every call went to libcuda");
    assert_eq!(locked(&c).stats().held_bytes, 0);
    // The default pool current again: served again.
    d.current_pool.set(DEFAULT_POOL);
    d.generation.set(3);
    held_block(&c, &d, 256, S1);
    let before = d.calls().len();
    let (_, q) = malloc(&c, &d, 256, S1);
    assert_eq!(free(&c, &d, q, S1, false), CUDA_SUCCESS);
    assert!(
        d.calls().is_empty(),
        "after {before} calls, served with no libcuda call"
    );
}

#[test]
fn during_a_capture_allocations_and_frees_are_graph_nodes_for_libcuda() {
    let (c, d) = (cache(), Fake::new());
    let p = held_block(&c, &d, 256, S1);
    let (_, live) = malloc(&c, &d, 256, S1);
    assert_eq!(live, p);
    d.calls();
    d.capturing.set(true);
    let (r, q) = malloc(&c, &d, 256, S1);
    assert_eq!((r, q == p), (CUDA_SUCCESS, false));
    assert_eq!(free(&c, &d, live, S1, false), CUDA_SUCCESS);
    assert_eq!(
        d.calls(),
        [
            "alloc 256 on 0x5000",
            format!("free {live:#x} on 0x5000").as_str()
        ]
    );
    // The block is the graph's to free now: unknown to the cache.
    assert_eq!(locked(&c).block(live), Block::Unknown);
}

#[test]
fn a_stream_of_another_context_goes_to_libcuda() {
    let (c, d) = (cache(), Fake::new());
    held_block(&c, &d, 256, S1);
    d.complete_all();
    d.calls();
    let (r, q) = malloc(&c, &d, 256, ELSEWHERE);
    assert_eq!(r, CUDA_SUCCESS);
    assert_eq!(free(&c, &d, q, ELSEWHERE, false), CUDA_SUCCESS);
    assert_eq!(
        d.calls(),
        [
            "alloc 256 on 0x7000",
            format!("free {q:#x} on 0x7000").as_str()
        ]
    );
}

#[test]
fn a_second_free_is_refused_without_libcuda() {
    let (c, d) = (cache(), Fake::new());
    let p = held_block(&c, &d, 256, S1);
    d.calls();
    assert_eq!(free(&c, &d, p, S2, false), CUDA_ERROR_INVALID_VALUE);
    assert!(d.calls().is_empty());
    // A pointer the cache never saw is libcuda's to answer.
    assert_eq!(free(&c, &d, 0xdead, S1, false), CUDA_SUCCESS);
    assert_eq!(d.calls(), ["free 0xdead on 0x5000"]);
}

#[test]
fn a_failed_record_leaves_the_free_to_libcuda() {
    let (c, d) = (cache(), Fake::new());
    // The per-thread default stream names another stream in each thread: its frees are marked at once.
    for _ in 0..2 {
        let (_, p) = malloc(&c, &d, 256, 0);
        assert_eq!(free(&c, &d, p, 0, true), CUDA_SUCCESS);
    }
    let (_, p) = malloc(&c, &d, 256, 0);
    d.calls();
    d.bad_streams
        .borrow_mut()
        .insert(crate::order::CU_STREAM_PER_THREAD);
    assert_eq!(free(&c, &d, p, 0, true), CUDA_SUCCESS);
    // The first kept block holds event 1: a new one for this free, refused, so the free is libcuda's.
    assert_eq!(
        d.calls(),
        ["create 2".to_string(), format!("free {p:#x} on 0x0")]
    );
    assert_eq!(locked(&c).block(p), Block::Unknown);
    // Its event was kept for the next free.
    assert_eq!(locked(&c).spare_event(CTX), Some(2));
}

/// Another thread completes the block while its marker is recorded (the cache unlocked meanwhile): the marker is not
/// used, its event goes back to the spares, and the allocation goes on (it once waited for ever on the cache's lock).
#[test]
fn a_block_completed_while_its_marker_is_recorded_keeps_the_cache_usable() {
    let c = std::sync::Arc::new(cache());
    let d = Fake::new();
    let p = held_block(&c, &d, 4096, S1);
    let other = c.clone();
    d.on_record.replace(Some(Box::new(move || {
        locked(&other).synchronized(Some(CTX), None, u64::MAX);
    })));
    d.calls();
    let (r, x) = malloc(&c, &d, 4096, S2);
    assert_eq!(r, CUDA_SUCCESS);
    assert_ne!(x, p);
    assert_eq!(locked(&c).spare_event(CTX), Some(1));
    assert_eq!(malloc(&c, &d, 4096, S2), (CUDA_SUCCESS, p));
}

#[test]
fn a_marker_libcuda_refuses_leaves_the_block_unmarked() {
    let (c, d) = (cache(), Fake::new());
    let p = held_block(&c, &d, 256, S1);
    d.bad_streams.borrow_mut().insert(S1);
    d.calls();
    assert_ne!(malloc(&c, &d, 256, S2).1, p);
    assert_eq!(d.calls(), ["create 1", "alloc 256 on 0x6000"]);
    assert_eq!(locked(&c).block(p), Block::Held);
    // The event is kept for another marker; a synchronization of S1 still completes the free.
    synchronized(&c, &d, Some(StreamKey::Handle(S1)), frees_so_far());
    assert_eq!(malloc(&c, &d, 256, S2), (CUDA_SUCCESS, p));
    assert_eq!(locked(&c).spare_event(CTX), Some(1));
}

#[test]
fn out_of_memory_gives_back_what_is_held_and_retries_once() {
    let (c, d) = (cache(), Fake::new());
    let a = held_block(&c, &d, 256, S1);
    settle(&c, &d);
    let b = held_block(&c, &d, 512, S2);
    let (_, x) = malloc(&c, &d, 1024, 0);
    free(&c, &d, x, 0, true);
    let (_, y) = malloc(&c, &d, 1024, 0);
    assert_eq!(free(&c, &d, y, 0, true), CUDA_SUCCESS);
    assert_eq!(
        locked(&c).block(y),
        Block::Held,
        "held from the per-thread stream"
    );
    let marker = d.next_event.get() - 1;
    d.calls();
    d.oom.set(1);
    let (r, _) = malloc(&c, &d, 8192, S1);
    assert_eq!(r, CUDA_SUCCESS);
    assert_eq!(
        d.calls(),
        [
            "alloc 8192 on 0x5000".to_string(),
            // Complete: freed on the legacy stream.
            format!("free {a:#x} on 0x0"),
            // Still running on S2: freed in S2's order.
            format!("free {b:#x} on 0x6000"),
            // Freed on a thread's own default stream: after waiting for its point.
            format!("wait {marker}"),
            format!("free {y:#x} on 0x0"),
            "alloc 8192 on 0x5000".to_string(),
        ]
    );
    assert_eq!(locked(&c).stats().held_bytes, 0);
    // Nothing held: libcuda's answer stands, with no second try.
    d.oom.set(2);
    assert_eq!(malloc(&c, &d, 8192, S1).0, CUDA_ERROR_OUT_OF_MEMORY);
    assert_eq!(d.calls(), ["alloc 8192 on 0x5000"]);
}

#[test]
fn a_synchronous_allocation_out_of_memory_trims_the_pool_after_giving_back() {
    let (c, d) = (cache(), Fake::new());
    let a = held_block(&c, &d, 256, S1);
    settle(&c, &d);
    d.calls();
    assert!(give_back_for_memory(&c, &d, CTX));
    assert_eq!(
        d.calls(),
        [format!("free {a:#x} on 0x0"), "trim 0xd0".into()]
    );
    assert!(!give_back_for_memory(&c, &d, CTX));
    assert!(d.calls().is_empty(), "nothing held, no trim");
}

#[test]
fn a_trim_gives_back_what_is_complete_and_the_spare_events() {
    let (c, d) = (cache(), Fake::new());
    let a = held_block(&c, &d, 256, S1);
    settle(&c, &d);
    let b = held_block(&c, &d, 512, S1);
    // b marked: another stream asked for its size while S1 ran (an event of the preload's on S1).
    let (_, y) = malloc(&c, &d, 512, S2);
    assert_ne!(y, b);
    let e = held_block(&c, &d, 1024, S1);
    let (_, x) = malloc(&c, &d, 256, S2);
    assert_eq!(x, a, "complete: another stream takes it");
    d.calls();
    // Another pool: nothing happens.
    before_trim(&c, &d, 0xe0);
    assert!(d.calls().is_empty());
    before_trim(&c, &d, DEFAULT_POOL);
    // b's free is still running (CUDA's trim keeps such memory too). e was never marked: libcuda gets it, freed on
    // its stream after the program's free, and its trim decides as without the preload.
    assert_eq!(d.calls(), [format!("free {e:#x} on 0x5000")]);
    assert_eq!(locked(&c).block(b), Block::Held);
    assert_eq!(free(&c, &d, x, S2, false), CUDA_SUCCESS);
    settle(&c, &d);
    d.calls();
    before_trim(&c, &d, DEFAULT_POOL);
    assert_eq!(
        d.calls(),
        [
            format!("free {a:#x} on 0x0"),
            format!("free {b:#x} on 0x0"),
            // The event of b's marker, back with the spares.
            "destroy 1".into(),
        ]
    );
    assert_eq!(locked(&c).stats().held_bytes, 0);
}

#[test]
fn a_query_of_the_pools_used_bytes_gives_back_every_block() {
    let (c, d) = (cache(), Fake::new());
    let a = held_block(&c, &d, 256, S1);
    d.calls();
    before_pool_query(&c, &d, DEFAULT_POOL, 4);
    assert!(
        d.calls().is_empty(),
        "the release threshold is not about held blocks"
    );
    before_pool_query(&c, &d, DEFAULT_POOL, ATTR_USED_MEM_CURRENT);
    // Its free's point is not known complete: freed in S1's order (libcuda counts it free at once).
    assert_eq!(d.calls(), [format!("free {a:#x} on 0x5000")]);
    assert_eq!(locked(&c).stats().held_bytes, 0);
}

/// alloc_async_loop.cu's failure under the background set-up: the pool's used bytes asked while the cache held the
/// loop's blocks, their frees' points marked by CUDA events (the context not attached yet: the engine cannot say
/// where a stream stands) that the cache had not seen complete. libcuda alone answers 0 (the program freed
/// everything and synchronized); the preload must too, at once, not once the streams reach frees it gives them.
#[test]
fn a_pool_query_counts_no_block_the_program_freed_while_the_frees_are_pending() {
    let (c, d) = (cache(), Fake::new());
    let sizes = [4096, 1 << 20, 16 << 20];
    for i in 0..4 {
        // Two blocks of each size live at once on S1, and one more filled on S1 and freed on S2.
        for &n in &sizes {
            let (ra, a) = malloc(&c, &d, n, S1);
            let (rb, b) = malloc(&c, &d, n, S1);
            assert_eq!((ra, rb), (CUDA_SUCCESS, CUDA_SUCCESS));
            assert_ne!(a, b);
            assert_eq!(free(&c, &d, a, S1, false), CUDA_SUCCESS);
            assert_eq!(free(&c, &d, b, S1, false), CUDA_SUCCESS);
        }
        let (_, x) = malloc(&c, &d, 65536, S1);
        assert_eq!(free(&c, &d, x, S2, false), CUDA_SUCCESS);
        // cudaStreamSynchronize(S1), (S2): libcuda reaches the frees it was given. The last iteration's frees are
        // not seen complete when the pool is asked.
        d.reach_all();
        if i < 3 {
            synchronized(&c, &d, Some(StreamKey::Handle(S1)), frees_so_far());
            synchronized(&c, &d, Some(StreamKey::Handle(S2)), frees_so_far());
        }
    }
    let held = locked(&c).stats().held_bytes;
    assert_eq!(held, 2 * (4096 + (1 << 20) + (16 << 20)) + 65536);
    assert_eq!(d.pool_used() as u64, held, "libcuda counts the held blocks");
    d.calls();
    before_pool_query(&c, &d, DEFAULT_POOL, ATTR_USED_MEM_CURRENT);
    assert_eq!(d.pool_used(), 0, "as libcuda alone answers");
    assert_eq!(locked(&c).stats().held_bytes, 0);
    let calls = d.calls();
    assert_eq!(calls.iter().filter(|c| c.starts_with("free ")).count(), 7);
    assert!(
        !calls.iter().any(|c| c.starts_with("cuMemFree")),
        "no pool block goes back with cuMemFree: {calls:?}"
    );
    // The reserved bytes are asked the same way; nothing is held any more.
    before_pool_query(&c, &d, DEFAULT_POOL, ATTR_RESERVED_MEM_CURRENT);
    assert!(d.calls().is_empty());
    // Complete frees need no wait.
    let a = held_block(&c, &d, 256, S1);
    d.reach_all();
    settle(&c, &d);
    d.calls();
    before_pool_query(&c, &d, DEFAULT_POOL, ATTR_USED_MEM_CURRENT);
    assert_eq!(d.calls(), [format!("free {a:#x} on 0x0")]);
    assert_eq!(d.pool_used(), 0);
}

/// A pending free whose point cannot be waited for (libcuda refuses the wait) is left to the block's stream, as the
/// program's own free would have been.
#[test]
fn a_pool_query_frees_in_stream_order_what_it_cannot_wait_for() {
    let (c, d) = (cache(), Fake::new());
    let a = held_block(&c, &d, 256, S1);
    // Marked with event 1: another stream asked for its size.
    malloc(&c, &d, 256, S2);
    d.bad_events.borrow_mut().insert(1);
    d.calls();
    before_pool_query(&c, &d, DEFAULT_POOL, ATTR_USED_MEM_CURRENT);
    assert_eq!(d.calls(), [format!("free {a:#x} on 0x5000")]);
    assert_eq!(locked(&c).stats().held_bytes, 0);
}
