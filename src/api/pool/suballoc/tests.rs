use super::*;
use std::cell::Cell;
use std::rc::Rc;

/// A queue's timeline the test moves by hand.
#[derive(Clone, Debug, Default)]
struct Tl(Rc<Cell<u64>>);

impl Clock for Tl {
    fn reached(&self, value: u64) -> bool {
        self.0.get() >= value
    }
}

const MIB: u64 = 1 << 20;

fn config() -> Config {
    Config {
        chunk_bytes: 2 * MIB,
        large_threshold: 512 << 10,
        release_threshold: u64::MAX,
        reserve_limit: None,
    }
}

/// An allocator whose chunks are numbered payloads at addresses the test makes up.
struct Fixture {
    a: Suballocator<u32, Tl>,
    next_base: u64,
    made: u32,
}

impl Fixture {
    fn new(config: Config) -> Fixture {
        Fixture {
            a: Suballocator::new(config),
            next_base: 1 << 40,
            made: 0,
        }
    }

    fn alloc(&mut self, slot: u32, bytes: u64) -> Result<(Block, bool), OverLimit> {
        match self.a.alloc(slot, bytes)? {
            Alloc::Hit(b) => Ok((b, true)),
            Alloc::Need(need) => {
                assert!(need.bytes >= bytes);
                let base = self.next_base;
                self.next_base += need.bytes.next_multiple_of(2 * MIB);
                self.made += 1;
                Ok((
                    self.a.add_chunk(slot, need, self.made, base, need.bytes),
                    false,
                ))
            }
        }
    }
}

#[test]
fn classes_round_up_by_at_most_a_quarter_and_stay_256_aligned() {
    assert_eq!(class_of(1), 0);
    assert_eq!(class_size(0), 256);
    assert_eq!(class_of(256), 0);
    assert_eq!(class_of(257), 1);
    assert_eq!(class_of(1024), 3);
    assert_eq!(class_size(4), 1280);
    assert_eq!(class_of(2048), 7);
    assert_eq!(class_size(8), 2560);
    for c in 0..80 {
        assert_eq!(class_of(class_size(c)), c, "class {c}");
        assert!(class_size(c + 1) > class_size(c));
        assert_eq!(class_size(c) % GRANULE, 0);
    }
    for bytes in (1..(4 * MIB)).step_by(97) {
        let s = class_size(class_of(bytes));
        assert!(s >= bytes);
        if bytes > SMALL_LIMIT {
            assert!(s - bytes <= bytes / 4 + GRANULE, "{bytes} -> {s}");
        } else {
            assert!(s - bytes < GRANULE);
        }
    }
    assert_eq!(large_size(1), 64 << 10);
    assert_eq!(large_size(9 * MIB + 1), 10 * MIB);
}

#[test]
fn a_queue_reuses_its_own_free_at_once_and_another_only_after_the_fence() {
    let mut f = Fixture::new(config());
    let (ta, tb) = (Tl::default(), Tl::default());
    let a = f.a.slot(1, || ta.clone());
    let b = f.a.slot(2, || tb.clone());
    assert_eq!(f.a.slot(1, || unreachable!()), a);
    let (x, hit) = f.alloc(a, 1000).unwrap();
    assert!(!hit, "the first request makes a chunk");
    assert_eq!(x.bytes, 1024);
    assert_eq!(x.ptr % 256, 0);
    f.a.free(x.id, a, 10);
    // Queue B must not get x while A's timeline is below 10.
    let (y, hit) = f.alloc(b, 1000).unwrap();
    assert!(hit);
    assert_ne!(y.ptr, x.ptr);
    // Queue A gets it back at once (stream order).
    let (x2, _) = f.alloc(a, 1000).unwrap();
    assert_eq!(x2.ptr, x.ptr);
    f.a.free(x2.id, a, 11);
    ta.0.set(10);
    let (z, _) = f.alloc(b, 1000).unwrap();
    assert_ne!(z.ptr, x.ptr, "A's free at 11 is not complete");
    ta.0.set(11);
    let (z2, _) = f.alloc(b, 1000).unwrap();
    assert_eq!(z2.ptr, x.ptr, "A's free at 11 is complete: B takes it");
    let s = f.a.stats();
    assert_eq!((s.misses, s.hits, s.chunks), (1, 4, 1));
    assert_eq!(s.blocks, 3);
    assert_eq!(s.in_use, 3 * 1024);
    assert_eq!(f.a.held_by(), vec![(2, 3 * 1024)]);
}

#[test]
fn the_oldest_free_of_another_queue_is_taken_first() {
    let mut f = Fixture::new(config());
    let (ta, tb) = (Tl::default(), Tl::default());
    let a = f.a.slot(1, || ta.clone());
    let b = f.a.slot(2, || tb.clone());
    let blocks: Vec<Block> = (0..3).map(|_| f.alloc(a, 256).unwrap().0).collect();
    for (i, x) in blocks.iter().enumerate() {
        f.a.free(x.id, a, 5 + i as u64);
    }
    ta.0.set(6);
    assert_eq!(f.alloc(b, 256).unwrap().0.ptr, blocks[0].ptr);
    assert_eq!(f.alloc(b, 256).unwrap().0.ptr, blocks[1].ptr);
    let third = f.alloc(b, 256).unwrap().0.ptr;
    assert_ne!(third, blocks[2].ptr, "value 7 is not reached");
    // A takes its newest free first.
    assert_eq!(f.alloc(a, 256).unwrap().0.ptr, blocks[2].ptr);
}

#[test]
fn large_requests_get_chunks_of_their_own_reused_by_size_and_fence() {
    let mut f = Fixture::new(config());
    let ta = Tl::default();
    let tb = Tl::default();
    let a = f.a.slot(1, || ta.clone());
    let b = f.a.slot(2, || tb.clone());
    let (x, hit) = f.alloc(a, 3 * MIB).unwrap();
    assert!(!hit);
    assert_eq!(x.bytes, 3 * MIB);
    f.a.free(x.id, a, 4);
    // Too small a request for x (more than a quarter would be wasted), then one that fits.
    let (small, hit) = f.alloc(a, MIB).unwrap();
    assert!(!hit);
    assert_ne!(small.ptr, x.ptr);
    assert!(
        !f.alloc(b, 3 * MIB - 1000).unwrap().1,
        "fence 4 not reached"
    );
    ta.0.set(4);
    let (y, hit) = f.alloc(b, 3 * MIB - 1000).unwrap();
    assert!(hit);
    assert_eq!(y.ptr, x.ptr);
    assert_eq!(f.a.stats().chunks, 3);
}

#[test]
fn trim_releases_idle_chunks_once_their_frees_are_complete() {
    let mut f = Fixture::new(config());
    let ta = Tl::default();
    let a = f.a.slot(1, || ta.clone());
    let x = f.alloc(a, 4096).unwrap().0;
    let y = f.alloc(a, 100_000).unwrap().0;
    let z = f.alloc(a, MIB).unwrap().0;
    assert_eq!(f.a.stats().reserved, 2 * MIB + 2 * MIB + MIB);
    f.a.free(x.id, a, 1);
    f.a.free(y.id, a, 2);
    // z still in use, frees pending: nothing goes.
    assert_eq!(f.a.release_over(0), 0);
    ta.0.set(1);
    assert_eq!(f.a.release_over(0), 2 * MIB, "x's chunk only");
    assert_eq!(f.a.take_released(), vec![1]);
    ta.0.set(2);
    f.a.free(z.id, NO_SLOT, 0);
    // Keeping 2 MiB: the large chunk goes first (1 MiB), then y's (2 MiB) to get under.
    assert_eq!(f.a.release_over(2 * MIB), MIB);
    assert_eq!(f.a.stats().reserved, 2 * MIB);
    assert_eq!(f.a.release_over(0), 2 * MIB);
    let mut gone = f.a.take_released();
    gone.sort();
    assert_eq!(gone, vec![2, 3]);
    let s = f.a.stats();
    assert_eq!((s.reserved, s.chunks, s.in_use, s.blocks), (0, 0, 0, 0));
    assert!(f.a.held_by().is_empty());
    // The queue was forgotten with nothing left in the pool; registered again, it allocates as before.
    let a = f.a.slot(1, || ta.clone());
    let w = f.alloc(a, 4096).unwrap();
    assert!(!w.1);
    assert_eq!(f.a.stats().chunks, 1);
}

#[test]
fn the_release_threshold_gives_back_idle_chunks_on_free_and_before_growing() {
    let mut f = Fixture::new(Config {
        release_threshold: 2 * MIB,
        ..config()
    });
    let ta = Tl::default();
    let a = f.a.slot(1, || ta.clone());
    let x = f.alloc(a, 256).unwrap().0;
    let y = f.alloc(a, 4096).unwrap().0;
    assert_eq!(f.a.stats().reserved, 4 * MIB);
    // Freed with no queue to wait for: the chunk is idle and complete, over the threshold: released.
    f.a.free(x.id, NO_SLOT, 0);
    assert_eq!(f.a.stats().reserved, 2 * MIB);
    assert_eq!(f.a.take_released(), vec![1]);
    // Freed on a queue still running: kept until it completes; a miss then releases it first.
    f.a.free(y.id, a, 9);
    assert_eq!(f.a.stats().reserved, 2 * MIB);
    ta.0.set(9);
    let (_, hit) = f.alloc(a, 20_000).unwrap();
    assert!(!hit);
    assert_eq!(f.a.take_released(), vec![2]);
    assert_eq!(f.a.stats().reserved, 2 * MIB);
    f.a.set_release_threshold(0);
    assert_eq!(f.a.stats().reserved, 2 * MIB, "a block is in use");
}

#[test]
fn the_reserve_limit_refuses_after_releasing_what_it_can() {
    let mut f = Fixture::new(Config {
        reserve_limit: Some(4 * MIB),
        ..config()
    });
    let ta = Tl::default();
    let a = f.a.slot(1, || ta.clone());
    let x = f.alloc(a, 256).unwrap().0;
    let _y = f.alloc(a, 4096).unwrap().0;
    let err = f.alloc(a, 8192).unwrap_err();
    assert_eq!(
        err,
        OverLimit {
            limit: 4 * MIB,
            needed: 2 * MIB
        }
    );
    // Once x's chunk is idle and its free complete, it makes room.
    f.a.free(x.id, a, 3);
    assert!(f.alloc(a, 8192).is_err());
    ta.0.set(3);
    let (_, hit) = f.alloc(a, 8192).unwrap();
    assert!(!hit);
    assert_eq!(f.a.take_released(), vec![1]);
}

#[test]
fn many_cycles_over_many_queues_keep_the_books_balanced() {
    let mut f = Fixture::new(config());
    let clocks: Vec<Tl> = (0..4).map(|_| Tl::default()).collect();
    let slots: Vec<u32> = (0..4)
        .map(|i| f.a.slot(i as u64 + 1, || clocks[i].clone()))
        .collect();
    let mut live: Vec<(Block, usize)> = Vec::new();
    let mut seed = 12345u64;
    let mut rnd = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut values = [0u64; 4];
    let mut requests = 0u64;
    for _ in 0..20_000 {
        let q = (rnd() % 4) as usize;
        if live.len() < 64 && rnd() % 2 == 0 {
            let bytes = 1 + rnd() % (if rnd() % 16 == 0 { 4 * MIB } else { 64 << 10 });
            let (b, _) = f.alloc(slots[q], bytes).unwrap();
            requests += 1;
            assert!(b.bytes >= bytes);
            assert_eq!(b.ptr % GRANULE, 0);
            // No two live blocks overlap.
            for (o, _) in &live {
                assert!(b.ptr + b.bytes <= o.ptr || o.ptr + o.bytes <= b.ptr);
            }
            live.push((b, q));
        } else if !live.is_empty() {
            let i = (rnd() as usize) % live.len();
            let (b, _) = live.swap_remove(i);
            values[q] += 1;
            f.a.free(b.id, slots[q], values[q]);
        }
        // Queues complete their work at their own pace.
        let q = (rnd() % 4) as usize;
        let v = values[q].saturating_sub(rnd() % 3);
        if v > clocks[q].0.get() {
            clocks[q].0.set(v);
        }
    }
    let s = f.a.stats();
    assert_eq!(s.blocks, live.len() as u64);
    assert_eq!(s.in_use, live.iter().map(|(b, _)| b.bytes).sum::<u64>());
    assert_eq!(s.hits + s.misses, requests);
    assert_eq!(s.misses, u64::from(f.made));
    for (b, _) in live.drain(..) {
        f.a.free(b.id, NO_SLOT, 0);
    }
    for (c, v) in clocks.iter().zip(values) {
        c.0.set(v);
    }
    f.a.release_over(0);
    let s = f.a.stats();
    assert_eq!((s.reserved, s.chunks, s.in_use, s.blocks), (0, 0, 0, 0));
    assert_eq!(f.a.take_released().len() as u32, f.made);
    assert_eq!(f.a.pending().count(), 0);
}
