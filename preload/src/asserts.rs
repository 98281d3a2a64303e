//! Device asserts of kernels launched through APEX, reported as libcuda reports its own.
//!
//! Under the preload, APEX's `__assertfail` records the failure and ends the failing thread
//! ([`apex::AssertAction::EndThread`]): a trap would fault the channel group, which is the program's CUDA context, and
//! CUDA would report that fault, not an assert. At the program's next synchronization the preload takes the records
//! and launches a replay kernel through libcuda (preload/kernels/assert_replay.cu) in which the same blocks and
//! threads call libcuda's own `__assertfail` with the same message, file, line and function: the program gets
//! exactly CUDA's messages on stderr and `CUDA_ERROR_ASSERT`, sticky, from then on.
//!
//! [`ReplayPlan`] lays out the replay: its grid and block hold every recorded block and thread, and each record is
//! found by a key that is the thread's linear block and thread index in that launch.

use std::collections::HashMap;

use apex::AssertFailure;

/// Most records replayed at once (CUDA's own report is bounded by its printf buffer too).
pub const MAX_REPLAYED: usize = 4096;
/// Most threads in a block.
const MAX_BLOCK_THREADS: u64 = 1024;
/// One record of the replay kernel's table: key, line, pad, message, file, function, char size.
const RECORD_BYTES: usize = 48;

/// The replay launch: its shape, and the failures it replays, sorted by key.
#[derive(Debug)]
pub struct ReplayPlan<'a> {
    grid: [u32; 3],
    block: [u32; 3],
    /// (key, failure), sorted by key, keys distinct.
    records: Vec<(u64, &'a AssertFailure)>,
}

impl<'a> ReplayPlan<'a> {
    /// The plan for `failures` (at most [`MAX_REPLAYED`], at most one per block and thread; failures whose thread
    /// would not fit a block beside the ones before are left out). `None` for no failures.
    pub fn new(failures: &'a [AssertFailure]) -> Option<ReplayPlan<'a>> {
        let mut block = [0u32; 3];
        let mut grid = [0u32; 3];
        let mut kept: Vec<&AssertFailure> = Vec::new();
        for f in failures {
            if kept.len() >= MAX_REPLAYED {
                break;
            }
            let b: [u32; 3] = std::array::from_fn(|i| block[i].max(f.thread[i].saturating_add(1)));
            if b.iter().map(|&d| u64::from(d)).product::<u64>() > MAX_BLOCK_THREADS {
                continue;
            }
            block = b;
            for (g, bi) in grid.iter_mut().zip(f.block) {
                *g = (*g).max(bi.saturating_add(1));
            }
            kept.push(f);
        }
        if kept.is_empty() {
            return None;
        }
        let mut records: Vec<(u64, &AssertFailure)> = kept
            .into_iter()
            .map(|f| (key(grid, block, f.block, f.thread), f))
            .collect();
        records.sort_by_key(|r| r.0);
        records.dedup_by_key(|r| r.0);
        Some(ReplayPlan {
            grid,
            block,
            records,
        })
    }

    /// The replay's grid.
    pub fn grid(&self) -> [u32; 3] {
        self.grid
    }

    /// The replay's block.
    pub fn block(&self) -> [u32; 3] {
        self.block
    }

    /// Records in the table.
    pub fn records(&self) -> usize {
        self.records.len()
    }

    /// The keys, in table order.
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.records.iter().map(|r| r.0)
    }

    /// Bytes of [`blob`](Self::blob).
    pub fn blob_len(&self) -> usize {
        self.layout().1
    }

    /// Where each distinct string goes (after the table), and the blob's length.
    fn layout(&self) -> (HashMap<&'a str, usize>, usize) {
        let mut at = self.records.len() * RECORD_BYTES;
        let mut strings = HashMap::new();
        for (_, f) in &self.records {
            for s in [f.message.as_str(), f.file.as_str(), f.function.as_str()] {
                strings.entry(s).or_insert_with(|| {
                    let here = at;
                    at += (s.len() + 1).next_multiple_of(8);
                    here
                });
            }
        }
        (strings, at)
    }

    /// The replay kernel's table followed by its strings, for device memory at `base`.
    pub fn blob(&self, base: u64) -> Vec<u8> {
        let (strings, len) = self.layout();
        let mut blob = vec![0u8; len];
        for (&s, &at) in &strings {
            blob[at..at + s.len()].copy_from_slice(s.as_bytes());
        }
        let addr = |s: &str| base + strings[s] as u64;
        for (i, (key, f)) in self.records.iter().enumerate() {
            let r = &mut blob[i * RECORD_BYTES..(i + 1) * RECORD_BYTES];
            r[0..8].copy_from_slice(&key.to_le_bytes());
            r[8..12].copy_from_slice(&f.line.to_le_bytes());
            r[16..24].copy_from_slice(&addr(&f.message).to_le_bytes());
            r[24..32].copy_from_slice(&addr(&f.file).to_le_bytes());
            r[32..40].copy_from_slice(&addr(&f.function).to_le_bytes());
            // charSize: nvcc passes sizeof(char).
            r[40..48].copy_from_slice(&1u64.to_le_bytes());
        }
        blob
    }
}

/// The key the replay kernel computes for block `b`, thread `t` in a launch of `grid` × `block`.
fn key(grid: [u32; 3], block: [u32; 3], b: [u32; 3], t: [u32; 3]) -> u64 {
    let (g, bl) = (grid.map(u64::from), block.map(u64::from));
    let linear_block = u64::from(b[0]) + g[0] * (u64::from(b[1]) + g[1] * u64::from(b[2]));
    let linear_thread = u64::from(t[0]) + bl[0] * (u64::from(t[1]) + bl[1] * u64::from(t[2]));
    linear_block * MAX_BLOCK_THREADS + linear_thread
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(block: [u32; 3], thread: [u32; 3], message: &str) -> AssertFailure {
        AssertFailure {
            message: message.into(),
            file: "k.cu".into(),
            line: 7,
            function: "void k(int *)".into(),
            block,
            thread,
        }
    }

    fn u64_at(b: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
    }

    fn cstr_at(b: &[u8], at: usize) -> &str {
        let end = b[at..].iter().position(|&c| c == 0).unwrap();
        std::str::from_utf8(&b[at..at + end]).unwrap()
    }

    #[test]
    fn the_launch_holds_every_block_and_thread_and_keys_match_the_kernel() {
        let f = [
            failure([2, 0, 0], [9, 0, 0], "b"),
            failure([2, 0, 0], [5, 0, 0], "a"),
            failure([0, 3, 1], [0, 1, 0], "c"),
        ];
        let p = ReplayPlan::new(&f).unwrap();
        assert_eq!(p.grid(), [3, 4, 2]);
        assert_eq!(p.block(), [10, 2, 1]);
        // The kernel: block = x + gx * (y + gy * z); thread = x + bx * (y + by * z); key = block * 1024 + thread.
        let keys: Vec<u64> = p.keys().collect();
        assert_eq!(
            keys,
            vec![2 * 1024 + 5, 2 * 1024 + 9, (3 * 3 + 12) * 1024 + 10]
        );
        assert!(
            keys.windows(2).all(|w| w[0] < w[1]),
            "sorted for the binary search"
        );
    }

    #[test]
    fn the_blob_points_each_record_at_its_strings() {
        let f = [
            failure([1, 0, 0], [0, 0, 0], "x == 0"),
            failure([0, 0, 0], [3, 0, 0], "x == 0"),
        ];
        let p = ReplayPlan::new(&f).unwrap();
        let base = 0x7f00_0000_0000u64;
        let blob = p.blob(base);
        assert_eq!(blob.len(), p.blob_len());
        assert_eq!(blob.len() % 8, 0);
        for i in 0..2 {
            let r = i * RECORD_BYTES;
            assert_eq!(u64_at(&blob, r + 8) & 0xffff_ffff, 7, "line");
            let at = |off: usize| (u64_at(&blob, r + off) - base) as usize;
            assert_eq!(cstr_at(&blob, at(16)), "x == 0");
            assert_eq!(cstr_at(&blob, at(24)), "k.cu");
            assert_eq!(cstr_at(&blob, at(32)), "void k(int *)");
            assert_eq!(u64_at(&blob, r + 40), 1);
        }
        // Shared strings are stored once.
        assert_eq!(u64_at(&blob, 16), u64_at(&blob, RECORD_BYTES + 16));
        // Record 0 is block 0 thread 3 (smaller key).
        assert_eq!(u64_at(&blob, 0), 3);
    }

    #[test]
    fn threads_that_do_not_fit_one_block_are_left_out_and_duplicates_once() {
        let f = [
            failure([0, 0, 0], [1023, 0, 0], "wide"),
            failure([0, 0, 0], [0, 0, 63], "deep"),
            failure([1, 0, 0], [1023, 0, 0], "again"),
            failure([1, 0, 0], [1023, 0, 0], "twice"),
        ];
        let p = ReplayPlan::new(&f).unwrap();
        assert_eq!(p.block(), [1024, 1, 1]);
        assert_eq!(p.records(), 2);
        assert!(ReplayPlan::new(&[]).is_none());
    }
}
