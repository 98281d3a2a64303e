//! `cuMemAlloc` / `cuMemFree` served from a per-context cache of CUDA's own allocations (issue 30): a freed block is
//! kept and handed back to the next allocation of the same size in the same context, so a program that allocates
//! and frees in a loop (`cudaMalloc`/`cudaFree` per iteration) pays a lookup instead of RM and UVM work.
//!
//! The blocks are libcuda's own allocations, so every CUDA answer about them stays as it was: the address is valid
//! in CUDA's address space, `cuPointerGetAttribute` and `cuMemGetAddressRange` describe a block of the size asked
//! for (sizes are matched exactly), copies and IPC work. What `cuMemFree` promises is kept by the hook: it waits,
//! as libcuda's free does, for the context's work before the block can be handed out again. `cuMemGetInfo` counts the
//! cached bytes as free, and an allocation libcuda refuses for want of memory is retried after the context's cached
//! blocks are really freed.
//!
//! Which blocks to keep is predicted from the history of sizes: a block is kept only once its size has been asked
//! for more than once in its context (a loop's allocation), so a one-off allocation is freed at once and never held.
//! The bytes held are bounded (`APEX_PRELOAD_ALLOC_CACHE`, MiB, default 1024; `off` or `0` turns the cache off).

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// Default bound on the bytes held, in MiB.
const DEFAULT_CAP_MIB: usize = 1024;
/// Sizes whose history is remembered; past it the history starts again (a program of ever-new sizes has no loop
/// to predict, and the map must not grow without bound).
const HISTORY: usize = 4096;

/// What the hook does with a block the program frees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Freed {
    /// Kept for the next allocation of its size: libcuda is not called.
    Kept,
    /// Not kept (a one-off size, the cache full, freed from another context): libcuda frees it.
    Released,
    /// Not an allocation the cache saw made: libcuda answers for it.
    Unknown,
}

/// The cache's counters, for the preload's summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Allocations answered from the cache.
    pub hits: u64,
    /// Allocations that went to libcuda.
    pub misses: u64,
    /// Frees whose block was kept.
    pub kept: u64,
    /// The most bytes held at once.
    pub peak_bytes: u64,
    /// Bytes held now.
    pub held_bytes: u64,
}

/// The cache's state: free blocks by (context, size), the blocks handed out, and how often each size was asked for.
#[derive(Debug)]
pub struct AllocCache {
    cap: usize,
    free: HashMap<(usize, usize), Vec<u64>>,
    live: HashMap<u64, (usize, usize)>,
    asked: HashMap<(usize, usize), u32>,
    held: usize,
    stats: CacheStats,
}

impl AllocCache {
    /// A cache holding at most `cap` bytes (0: nothing is ever kept).
    pub fn new(cap: usize) -> AllocCache {
        AllocCache {
            cap,
            free: HashMap::new(),
            live: HashMap::new(),
            asked: HashMap::new(),
            held: 0,
            stats: CacheStats::default(),
        }
    }

    /// The cache `APEX_PRELOAD` and `APEX_PRELOAD_ALLOC_CACHE` ask for (`None`: off).
    pub fn from_env() -> Option<AllocCache> {
        if matches!(
            std::env::var("APEX_PRELOAD").as_deref(),
            Ok("off" | "0" | "false")
        ) {
            return None;
        }
        let mib = match std::env::var("APEX_PRELOAD_ALLOC_CACHE").as_deref() {
            Ok("off" | "false") => 0,
            Ok(v) => v.parse().unwrap_or(DEFAULT_CAP_MIB),
            Err(_) => DEFAULT_CAP_MIB,
        };
        (mib > 0).then(|| AllocCache::new(mib.saturating_mul(1 << 20)))
    }

    /// An allocation of `bytes` in context `ctx`: a kept block of that size, or `None` (then libcuda allocates and
    /// [`AllocCache::allocated`] records its answer).
    pub fn take(&mut self, ctx: usize, bytes: usize) -> Option<u64> {
        if self.asked.len() >= HISTORY && !self.asked.contains_key(&(ctx, bytes)) {
            self.asked.clear();
        }
        let n = self.asked.entry((ctx, bytes)).or_insert(0);
        *n = n.saturating_add(1);
        let Some(ptr) = self.free.get_mut(&(ctx, bytes)).and_then(Vec::pop) else {
            self.stats.misses += 1;
            return None;
        };
        self.held -= bytes;
        self.live.insert(ptr, (ctx, bytes));
        self.stats.hits += 1;
        Some(ptr)
    }

    /// libcuda allocated `ptr` of `bytes` in `ctx`.
    pub fn allocated(&mut self, ctx: usize, bytes: usize, ptr: u64) {
        self.live.insert(ptr, (ctx, bytes));
    }

    /// Whether `ptr` is a block the cache handed out or saw made (so a free of it may be kept).
    pub fn knows(&self, ptr: u64) -> bool {
        self.live.contains_key(&ptr)
    }

    /// The program frees `ptr` with context `ctx` current, after the context's work was waited for.
    pub fn freed(&mut self, ctx: usize, ptr: u64) -> Freed {
        let Some(&(owner, bytes)) = self.live.get(&ptr) else {
            return Freed::Unknown;
        };
        self.live.remove(&ptr);
        let repeated = self.asked.get(&(owner, bytes)).is_some_and(|&n| n > 1);
        if owner != ctx || !repeated || self.held + bytes > self.cap {
            return Freed::Released;
        }
        self.free.entry((owner, bytes)).or_default().push(ptr);
        self.held += bytes;
        self.stats.kept += 1;
        self.stats.peak_bytes = self.stats.peak_bytes.max(self.held as u64);
        Freed::Kept
    }

    /// `ptr` goes back to libcuda without being kept (freed while a graph capture runs, when the wait a kept block
    /// needs could disturb the capture).
    pub fn release(&mut self, ptr: u64) {
        self.live.remove(&ptr);
    }

    /// Takes every kept block of `ctx` out of the cache, for libcuda to free (it ran out of memory).
    pub fn drain(&mut self, ctx: usize) -> Vec<u64> {
        let keys: Vec<(usize, usize)> = self.free.keys().filter(|k| k.0 == ctx).copied().collect();
        let mut out = Vec::new();
        for k in keys {
            if let Some(v) = self.free.remove(&k) {
                self.held -= k.1 * v.len();
                out.extend(v);
            }
        }
        out
    }

    /// Bytes kept for context `ctx` (free to the program, though libcuda counts them used).
    pub fn held_in(&self, ctx: usize) -> usize {
        self.free
            .iter()
            .filter(|(k, _)| k.0 == ctx)
            .map(|(k, v)| k.1 * v.len())
            .sum()
    }

    /// A context went away: libcuda freed its blocks with it, so the cache forgets them (every context's, when
    /// `ctx` is `None`: a primary context reset names a device, not a context).
    pub fn forget(&mut self, ctx: Option<usize>) {
        let gone = |c: usize| ctx.is_none_or(|x| x == c);
        self.free.retain(|k, _| !gone(k.0));
        self.live.retain(|_, v| !gone(v.0));
        self.asked.retain(|k, _| !gone(k.0));
        self.held = self.free.iter().map(|(k, v)| k.1 * v.len()).sum();
    }

    /// The counters so far.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            held_bytes: self.held as u64,
            ..self.stats
        }
    }
}

/// The process's cache, made from the environment on first use (`None`: off).
fn global() -> Option<&'static Mutex<AllocCache>> {
    static CACHE: OnceLock<Option<Mutex<AllocCache>>> = OnceLock::new();
    CACHE
        .get_or_init(|| AllocCache::from_env().map(Mutex::new))
        .as_ref()
}

/// The process's cache, locked (a panic while it was held cannot leave it inconsistent for a lookup: every change
/// is one insert or remove per map).
pub fn lock() -> Option<MutexGuard<'static, AllocCache>> {
    global().map(|m| m.lock().unwrap_or_else(|e| e.into_inner()))
}

#[cfg(test)]
mod tests {
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
}
