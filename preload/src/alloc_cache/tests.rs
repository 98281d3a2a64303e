//! The cache's bookkeeping: sizes, contexts, bounds, the history that decides what is kept, and the stream-ordered
//! path's rules (its own stream at once, another stream once the free is complete, only the default pool).

use super::*;

const CTX: usize = 0xc0;

/// A loop allocating and freeing one size: the first free is a one-off's (released), from the second
/// iteration on blocks are kept, and from the third every allocation is a hit on the same address.
#[test]
fn a_loop_of_one_size_hits_from_its_third_iteration() {
    let mut c = AllocCache::new(1 << 30);
    let mut next = 0x1000u64;
    let mut libcuda = |c: &mut AllocCache, bytes: usize| {
        next += 0x10_0000;
        c.allocated(CTX, bytes, next);
        next
    };
    let mut got = Vec::new();
    for _ in 0..5 {
        let p = match c.take(CTX, 4096) {
            Some(p) => p,
            None => libcuda(&mut c, 4096),
        };
        got.push(p);
        c.freed(CTX, p);
    }
    assert_eq!(got[2], got[1], "the second block is reused");
    assert!(got[2..].iter().all(|&p| p == got[1]));
    let s = c.stats();
    assert_eq!((s.hits, s.misses, s.kept), (3, 2, 4));
    assert_eq!(s.held_bytes, 4096);
    assert_eq!(s.peak_bytes, 4096);
}

#[test]
fn sizes_contexts_and_the_bound_are_respected() {
    let mut c = AllocCache::new(10_000);
    for _ in 0..2 {
        assert_eq!(c.take(CTX, 6000), None);
    }
    c.allocated(CTX, 6000, 0xa000);
    c.allocated(CTX, 6000, 0xb000);
    assert_eq!(c.freed(CTX, 0xa000), Freed::Kept);
    // Over the bound: released.
    assert_eq!(c.freed(CTX, 0xb000), Freed::Released);
    // Another size, another context: no hit.
    assert_eq!(c.take(CTX, 6001), None);
    assert_eq!(c.take(CTX + 1, 6000), None);
    assert_eq!(c.held_in(CTX), 6000);
    assert_eq!(c.held_in(CTX + 1), 0);
    // Freed with another context current: given back to libcuda.
    c.allocated(CTX + 1, 6000, 0xc000);
    assert_eq!(c.freed(CTX, 0xc000), Freed::Released);
    // Unknown pointers (made before the preload, by cuMemAllocAsync, or freed twice).
    assert_eq!(c.freed(CTX, 0xdead), Freed::Unknown);
    assert_eq!(c.freed(CTX, 0xa000), Freed::Unknown);
    assert!(!c.knows(0xa000));
    assert_eq!(c.take(CTX, 6000), Some(0xa000));
    assert!(c.knows(0xa000));
    c.release(0xa000);
    assert!(!c.knows(0xa000));
    assert_eq!(c.freed(CTX, 0xa000), Freed::Unknown);
}

#[test]
fn out_of_memory_drains_and_teardown_forgets() {
    let mut c = AllocCache::new(1 << 20);
    let blocks = [(0x1000, 256), (0x2000, 256), (0x3000, 512)];
    for (p, b) in blocks {
        assert_eq!(c.take(CTX, b), None);
        c.allocated(CTX, b, p);
    }
    c.take(CTX, 512);
    for (p, _) in blocks {
        assert_eq!(c.freed(CTX, p), Freed::Kept);
    }
    // The extra request of 512 bytes was a hit on nothing: a miss.
    assert_eq!(c.stats().misses, 4);
    c.take(CTX + 1, 256);
    c.take(CTX + 1, 256);
    c.allocated(CTX + 1, 256, 0x9000);
    c.freed(CTX + 1, 0x9000);
    let mut drained = c.drain(CTX);
    drained.sort_unstable();
    assert_eq!(drained, [0x1000, 0x2000, 0x3000]);
    assert_eq!(c.held_in(CTX), 0);
    assert_eq!(c.stats().held_bytes, 256);
    c.forget(Some(CTX + 1));
    assert_eq!(c.stats().held_bytes, 0);
    assert_eq!(c.take(CTX + 1, 256), None);
    c.allocated(CTX, 64, 0x5000);
    c.forget(None);
    assert!(!c.knows(0x5000));
}

#[test]
fn a_zero_bound_keeps_nothing() {
    let mut c = AllocCache::new(0);
    c.take(CTX, 64);
    c.take(CTX, 64);
    c.allocated(CTX, 64, 0x1000);
    assert_eq!(c.freed(CTX, 0x1000), Freed::Released);
}

// ---- the stream-ordered path ----

const S1: Option<StreamKey> = Some(StreamKey::Handle(0x5000));
const S2: Option<StreamKey> = Some(StreamKey::Handle(0x6000));

/// A cache serving `CTX`'s stream-ordered allocations (its device's default pool is current).
fn serving(cap: usize) -> AllocCache {
    let mut c = AllocCache::new(cap);
    c.set_pools(
        CTX,
        Pools {
            default: 0xd0,
            current_is_default: true,
            generation: 1,
        },
    );
    c
}

/// Makes `bytes` a loop's size (asked twice) and has libcuda hand out `ptr` of it.
fn live_async(c: &mut AllocCache, bytes: usize, ptr: u64) {
    while !c.repeated(CTX, bytes, true) {
        assert_eq!(c.take_async(CTX, bytes, S1, &mut |_| false), None);
    }
    c.allocated_async(CTX, bytes, ptr);
}

fn never(_: &Marker) -> bool {
    false
}

#[test]
fn a_block_freed_on_a_stream_goes_back_to_that_stream_at_once() {
    let mut c = serving(1 << 20);
    live_async(&mut c, 4096, 0xa000);
    assert_eq!(c.block(0xa000), Block::LiveAsync);
    assert!(c.keeps_async(CTX, 0xa000));
    assert!(c.hold_async(CTX, 0xa000, S1, Marker::Event(7)).is_ok());
    assert_eq!(c.block(0xa000), Block::Held, "a second free is told apart");
    assert_eq!(c.held_in(CTX), 4096);
    // The free's work is still running, but stream order puts every later use on S1 after it.
    assert_eq!(c.take_async(CTX, 4096, S1, &mut never), Some(0xa000));
    assert_eq!(c.block(0xa000), Block::LiveAsync);
    assert_eq!(
        c.spare_event(CTX),
        Some(7),
        "the marker's event is free again"
    );
    let s = c.stats();
    assert_eq!((s.async_hits, s.async_kept, s.held_bytes), (1, 1, 0));
    assert_eq!(s.peak_bytes, 4096);
}

#[test]
fn another_stream_gets_a_block_only_once_its_free_is_complete() {
    let mut c = serving(1 << 20);
    live_async(&mut c, 4096, 0xa000);
    c.hold_async(CTX, 0xa000, S1, Marker::Event(7)).unwrap();
    let mut asked = Vec::new();
    let mut running = |m: &Marker| {
        asked.push(m.event());
        false
    };
    assert_eq!(c.take_async(CTX, 4096, S2, &mut running), None);
    assert_eq!(asked, [Some(7)], "the free's event was asked about");
    let s = c.stats();
    assert_eq!((s.async_misses, s.async_unready), (3, 1), "{s:?}");
    // The per-thread default stream is never "the same stream": it is each thread's own.
    assert_eq!(lane(StreamKey::PerThread(1)), None);
    assert_eq!(c.take_async(CTX, 4096, None, &mut never), None);
    // Once the event says S1's work up to the free is complete, any stream may have it.
    let mut complete = |m: &Marker| m.event() == Some(7);
    assert_eq!(c.take_async(CTX, 4096, S2, &mut complete), Some(0xa000));
    assert_eq!(c.spare_event(CTX), Some(7));
    assert_eq!(c.spare_event(CTX), None);
    // A marker known complete needs no question.
    c.hold_async(CTX, 0xa000, S1, Marker::Done).unwrap();
    assert_eq!(c.take_async(CTX, 4096, None, &mut never), Some(0xa000));
}

#[test]
fn a_destroyed_stream_hands_its_blocks_out_only_once_complete() {
    let mut c = serving(1 << 20);
    live_async(&mut c, 256, 0xa000);
    c.set_stream_context(0x5000, CTX);
    c.hold_async(CTX, 0xa000, S1, Marker::Event(7)).unwrap();
    // A new stream may get the destroyed one's handle: it must not take the block at once.
    c.stream_destroyed(0x5000);
    assert_eq!(c.stream_context(0x5000), None, "asked again");
    assert_eq!(c.take_async(CTX, 256, S1, &mut never), None);
    assert_eq!(c.take_async(CTX, 256, S1, &mut |_| true), Some(0xa000));
}

#[test]
fn the_stream_ordered_path_serves_only_while_the_default_pool_is_current() {
    let mut c = AllocCache::new(1 << 20);
    assert_eq!(c.serves_async(CTX, 1), None, "not asked yet");
    let other = Pools {
        default: 0xd0,
        current_is_default: false,
        generation: 1,
    };
    c.set_pools(CTX, other);
    assert_eq!(c.serves_async(CTX, 1), Some(false));
    assert_eq!(
        c.serves_async(CTX, 2),
        None,
        "asked again after a pool change"
    );
    assert_eq!(c.default_pool(CTX), 0xd0);
    live_async(&mut c, 4096, 0xa000);
    assert!(!c.keeps_async(CTX, 0xa000), "not kept under another pool");
    assert!(c.hold_async(CTX, 0xa000, S1, Marker::Done).is_err());
    assert_eq!(c.block(0xa000), Block::Unknown, "libcuda frees it");
    // Served again once the default pool is current: blocks held since are handed out.
    c.set_pools(
        CTX,
        Pools {
            current_is_default: true,
            generation: 2,
            ..other
        },
    );
    c.allocated_async(CTX, 4096, 0xb000);
    c.hold_async(CTX, 0xb000, S1, Marker::Done).unwrap();
    c.set_pools(
        CTX,
        Pools {
            generation: 3,
            ..other
        },
    );
    assert_eq!(c.take_async(CTX, 4096, S1, &mut never), None);
    c.set_pools(
        CTX,
        Pools {
            current_is_default: true,
            generation: 4,
            ..other
        },
    );
    assert_eq!(c.take_async(CTX, 4096, S1, &mut never), Some(0xb000));
}

#[test]
fn the_two_paths_never_trade_blocks() {
    let mut c = serving(1 << 20);
    live_async(&mut c, 4096, 0xa000);
    c.hold_async(CTX, 0xa000, S1, Marker::Done).unwrap();
    // A cuMemAlloc of the size is no hit: a pool block would answer MEMPOOL_HANDLE with the pool.
    assert_eq!(c.take(CTX, 4096), None);
    c.take(CTX, 4096);
    c.allocated(CTX, 4096, 0xb000);
    assert_eq!(c.block(0xb000), Block::Live);
    assert_eq!(c.freed(CTX, 0xb000), Freed::Kept);
    assert_eq!(c.take_async(CTX, 4096, S2, &mut never), Some(0xa000));
    assert_eq!(c.take_async(CTX, 4096, S2, &mut |_| true), None);
    // Neither path's free takes the other's block.
    c.allocated_async(CTX, 64, 0xc000);
    assert_eq!(c.freed(CTX, 0xc000), Freed::Unknown);
    assert_eq!(c.take(CTX, 4096), Some(0xb000));
    assert!(!c.keeps_async(CTX, 0xb000));
}

#[test]
fn stream_ordered_blocks_are_bounded_by_the_bytes_and_drained_by_completion() {
    let mut c = serving(10_000);
    live_async(&mut c, 6000, 0xa000);
    c.allocated_async(CTX, 6000, 0xb000);
    c.allocated_async(CTX, 6000, 0xc000);
    c.hold_async(CTX, 0xa000, S1, Marker::Event(1)).unwrap();
    // Over the bound (both paths count): libcuda frees it.
    assert!(!c.keeps_async(CTX, 0xb000));
    assert_eq!(
        c.hold_async(CTX, 0xb000, S1, Marker::Event(2))
            .unwrap_err()
            .event(),
        Some(2)
    );
    // Freed with another context current: libcuda's.
    assert!(!c.keeps_async(CTX + 1, 0xc000));
    let mut c = serving(1 << 20);
    live_async(&mut c, 256, 0xa000);
    for p in [0xb000, 0xc000] {
        c.allocated_async(CTX, 256, p);
    }
    c.hold_async(CTX, 0xa000, S1, Marker::Event(1)).unwrap();
    c.hold_async(CTX, 0xb000, S2, Marker::Event(2)).unwrap();
    c.hold_async(CTX, 0xc000, None, Marker::Done).unwrap();
    assert!(c.holds_async(CTX));
    // What a trim may release: the complete ones.
    let (ready, pending) = c.drain_async(CTX, false, &mut |m| m.event() == Some(2));
    assert_eq!((ready, pending.len()), (vec![0xb000, 0xc000], 0));
    assert_eq!(c.held_in(CTX), 256);
    assert_eq!(c.take_spare_events(CTX), [2]);
    // Everything (out of memory, a pool query).
    let (ready, pending) = c.drain_async(CTX, true, &mut never);
    assert!(ready.is_empty());
    assert_eq!(pending.len(), 1);
    assert_eq!((pending[0].ptr, pending[0].lane), (0xa000, S1));
    assert_eq!(c.block(0xa000), Block::Unknown);
    assert!(!c.holds_async(CTX));
    assert_eq!(c.stats().held_bytes, 0);
}

#[test]
fn held_stream_ordered_blocks_are_bounded_in_number() {
    let mut c = serving(usize::MAX);
    live_async(&mut c, 16, 0x10);
    for i in 0..MAX_HELD_ASYNC as u64 {
        c.allocated_async(CTX, 16, 0x100 + 16 * i);
        c.hold_async(CTX, 0x100 + 16 * i, S1, Marker::Done).unwrap();
    }
    assert!(!c.keeps_async(CTX, 0x10));
    c.take_async(CTX, 16, S1, &mut never);
    assert!(c.keeps_async(CTX, 0x10));
}

#[test]
fn teardown_forgets_the_stream_ordered_path_too() {
    let mut c = serving(1 << 20);
    live_async(&mut c, 256, 0xa000);
    c.set_stream_context(0x5000, CTX);
    c.hold_async(CTX, 0xa000, S1, Marker::Event(3)).unwrap();
    c.recycle(CTX, Marker::Event(4));
    c.forget(Some(CTX));
    assert_eq!(c.stats().held_bytes, 0);
    assert_eq!(c.block(0xa000), Block::Unknown);
    assert_eq!(
        c.spare_event(CTX),
        None,
        "the context's events went with it"
    );
    assert_eq!(c.stream_context(0x5000), None);
    assert_eq!(c.serves_async(CTX, 1), None);
}
