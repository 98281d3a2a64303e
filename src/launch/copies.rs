//! Copy-only channels on the GPU's logical copy engines (LCEs), for bulk copies: peer copies over NVLink
//! above all, where one engine does not fill the link. A copy is split across the engines; each engine's
//! channel first waits (on the GPU) for the work its caller ordered before the copy, and the caller's queue
//! then waits for every engine's release, so copies keep queue order without the CPU in between. The caller's
//! queue may be on another GPU of the engines' peer domain (a copy between GPUs pushed by the source GPU's
//! engines and ordered on the destination's queue): each side's semaphores are then mapped on the other.

use std::sync::Arc;

use tracing::debug;

use crate::gpfifo::ChannelConfig;
use crate::pushbuf::{Acquire, Push, Queue, QueueConfig, Release, Signal};
use crate::rm::{GpuCore, MAX_LCES};

use super::{Error, Result};

/// Where, in a channel's semaphore page, the copy engine releases its 32-bit completion value.
pub(super) const COPY_SEMAPHORE_SLOT: usize = 1;

/// Records a linear copy that completes submission `v` of a channel: the copy engine releases the low 32 bits
/// of `v` at `copy_sem`, and the channel's host turns that into its 64-bit timeline value at `timeline`.
pub(super) fn record_copy(
    p: &mut Push<'_>,
    src: u64,
    dst: u64,
    bytes: u64,
    copy_sem: u64,
    timeline: u64,
    v: u64,
) {
    p.copy_linear(src, dst, bytes, Some((copy_sem, v as u32)));
    p.sem_acquire(
        copy_sem,
        u64::from(v as u32),
        Acquire::CircularGeq,
        false,
        false,
    );
    p.sem_release(
        timeline,
        v,
        Release {
            wfi: false,
            wide: true,
            timestamp: false,
        },
    );
}

/// Below this, a copy goes to one engine: splitting costs a submission per engine and gains nothing.
const SPLIT_MIN_BYTES: u64 = 8 << 20;

/// Parts of a split copy start on this alignment (the engines read and write whole 64 KiB big pages).
const PART_ALIGN: u64 = 64 << 10;

/// The most engines one copy is split across (a Hopper has at most 10 LCEs usable for copies).
pub const MAX_COPY_ENGINES: usize = 16;

/// Every LCE RM has a name for: [`CopyEngines::new`] keeps those the GPU can schedule copy-only channels on.
pub const ALL_LCES: u64 = (1 << MAX_LCES) - 1;

/// A set of copy-only channels, one per logical copy engine.
#[derive(Debug)]
pub struct CopyEngines {
    gpu: Arc<GpuCore>,
    engines: Vec<(u32, Queue)>,
    /// Each engine's share of a split copy: its physical copy engines (PCEs), at least 1.
    weights: Vec<u32>,
    /// The (semaphore address, value) each engine releases for the last copy, for the caller to wait on.
    pending: [(u64, u64); MAX_COPY_ENGINES],
    pending_len: usize,
    /// Round-robin start for copies that go to one engine.
    next: usize,
}

impl CopyEngines {
    /// One copy channel on each LCE of `lces` (bit `n` set: LCE `n`). Engines RM refuses (absent, or
    /// reserved) are left out; an error only when none of them can be used.
    pub fn new(gpu: &Arc<GpuCore>, lces: u64) -> Result<CopyEngines> {
        // Only engines the GPU has (when RM says which): asking RM for a copy object on an absent one works as a
        // refusal but leaves an assertion in the kernel log.
        let lces = match gpu.copy_engines_present() {
            Ok(present) if lces & present != 0 => lces & present,
            Ok(_) => lces,
            Err(e) => {
                debug!(error = %e, "the GPU's engine list is unavailable; trying every LCE asked for");
                lces
            }
        };
        let mut engines = Vec::new();
        let mut last = None;
        for lce in (0..64u32).filter(|n| lces & (1 << n) != 0) {
            if engines.len() == MAX_COPY_ENGINES {
                break;
            }
            let config = QueueConfig {
                channel: ChannelConfig {
                    entries: 256,
                    ..ChannelConfig::copy_engine(lce)
                },
                push_bytes: 256 << 10,
                ..QueueConfig::default()
            };
            match Queue::new(gpu, config) {
                Ok(q) => engines.push((lce, q)),
                Err(e) => {
                    debug!(lce, error = %e, "copy engine not usable");
                    last = Some(e);
                }
            }
        }
        if engines.is_empty() {
            return Err(match last {
                Some(e) => e.into(),
                None => {
                    Error::Unsupported(format!("copy engines from an empty LCE mask ({lces:#x})"))
                }
            });
        }
        // LCEs differ in how many PCEs back them (an H100: 45 GB/s on LCE 2, 267 GB/s on LCE 4), so a copy is split
        // by PCE count; equal shares when RM does not say.
        let weights: Vec<u32> = engines
            .iter()
            .map(|(lce, _)| {
                gpu.copy_engine_pces(*lce)
                    .map_or(1, |m| m.count_ones().max(1))
            })
            .collect();
        debug!(lces = ?engines.iter().map(|(l, _)| *l).collect::<Vec<_>>(), ?weights, "copy engines ready");
        Ok(CopyEngines {
            gpu: gpu.clone(),
            engines,
            weights,
            pending: [(0, 0); MAX_COPY_ENGINES],
            pending_len: 0,
            next: 0,
        })
    }

    /// Copy engines of `src` for copies into `dst`'s memory (mapped on `src`): the LCEs RM names optimal for
    /// `src` writing `dst` (`p2pOptimalWriteCEs`), or every LCE `src` can use when RM names none or none of them
    /// can be used. `dst` may be `src` itself (every usable LCE). An error saying why when the GPUs have no peer
    /// path or do not share an address space.
    pub fn for_peer(src: &Arc<GpuCore>, dst: &Arc<GpuCore>) -> Result<CopyEngines> {
        let caps = src.enable_peer(dst)?;
        let optimal = u64::from(caps.optimal_write_ces);
        if optimal != 0 {
            match CopyEngines::new(src, optimal) {
                Ok(e) => return Ok(e),
                Err(e) => debug!(
                    optimal = format_args!("{optimal:#x}"),
                    error = %e,
                    "no optimal write CE usable; trying every LCE"
                ),
            }
        }
        CopyEngines::new(src, ALL_LCES)
    }

    /// Maps the engines' semaphores on `gpu` (once; a no-op on their own GPU), so a queue of `gpu` can wait for
    /// their copies.
    pub fn map_semaphores_on(&self, gpu: &Arc<GpuCore>) -> Result<()> {
        for (_, q) in &self.engines {
            q.timeline().semaphores().memory().map_on(gpu)?;
        }
        Ok(())
    }

    /// The GPU the engines belong to.
    pub fn gpu(&self) -> &Arc<GpuCore> {
        &self.gpu
    }

    /// The LCE indices in use.
    pub fn lces(&self) -> impl Iterator<Item = u32> + '_ {
        self.engines.iter().map(|(l, _)| *l)
    }

    /// How the copy of `bytes` is split: `(engine, offset, length)` for each part, starting with engine `first`
    /// and going round, each engine's share in proportion to its weight, every part but the last a multiple of
    /// 64 KiB. Below 8 MiB the whole copy goes to `first`.
    pub(crate) fn split(
        bytes: u64,
        weights: &[u32],
        first: usize,
    ) -> impl Iterator<Item = (usize, u64, u64)> + '_ {
        let n = weights.len().max(1);
        let whole = bytes < SPLIT_MIN_BYTES;
        let count = if whole { 1 } else { n };
        let weight = move |e: usize| u64::from(weights.get(e).copied().unwrap_or(1).max(1));
        let total: u64 = if whole { 1 } else { (0..n).map(weight).sum() };
        let (mut start, mut acc) = (0u64, 0u64);
        (0..count).filter_map(move |i| {
            let engine = (first + i) % n;
            acc += if whole { 1 } else { weight(engine) };
            let end = if i + 1 == count {
                bytes
            } else {
                let share = (u128::from(bytes) * u128::from(acc) / u128::from(total)) as u64;
                (share / PART_ALIGN * PART_ALIGN).clamp(start, bytes)
            };
            let part = (start, end - start);
            start = end;
            (part.1 > 0).then_some((engine, part.0, part.1))
        })
    }

    /// Copies `bytes` from `src` to `dst` (GPU addresses mapped on this GPU), split across the engines, each
    /// starting once the 64-bit semaphore `after.0` has reached `after.1` (when given). Returns the
    /// `(address, value)` pairs the engines release when their parts are done, for the caller to wait on.
    pub fn copy(
        &mut self,
        src: u64,
        dst: u64,
        bytes: u64,
        after: Option<(u64, u64)>,
    ) -> Result<&[(u64, u64)]> {
        if bytes == 0 {
            return Err(Error::InvalidLaunch {
                kernel: "copy".into(),
                why: "a copy of 0 bytes".into(),
            });
        }
        let first = self.next;
        self.next = (self.next + 1) % self.engines.len();
        self.pending_len = 0;
        for (engine, off, len) in Self::split(bytes, &self.weights, first) {
            let q = &mut self.engines[engine].1;
            let copy_sem = q.channel().semaphores().va(COPY_SEMAPHORE_SLOT);
            let timeline = q.timeline().va();
            let chunks = len.div_ceil(crate::pushbuf::Push::MAX_COPY_CHUNK) as usize;
            let fence = q.submit(chunks * 12 + 40, Signal::Recorded, |p, v| {
                if let Some((va, value)) = after {
                    // Spin, without yielding the runlist: copy channels run only on LCEs of their own runlists
                    // (RM refuses the graphics-runlist CEs), and a copy channel that yielded on a failed acquire
                    // was not rescheduled when the value arrived (H100: split copies ordered after earlier work
                    // timed out).
                    p.sem_acquire(va, value, Acquire::CircularGeq, true, false);
                }
                record_copy(p, src + off, dst + off, len, copy_sem, timeline, v);
            })?;
            self.pending[self.pending_len] = (timeline, fence.value());
            self.pending_len += 1;
        }
        Ok(&self.pending[..self.pending_len])
    }

    /// Waits (on the CPU) until every engine is idle.
    pub fn synchronize(&self) -> Result<()> {
        for (_, q) in &self.engines {
            q.wait_idle(q.timeout())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::CopyEngines;

    #[test]
    fn small_copies_take_one_engine_in_turn_and_large_ones_split_aligned() {
        let one: Vec<_> = CopyEngines::split(4096, &[1; 4], 2).collect();
        assert_eq!(one, vec![(2, 0, 4096)]);
        let parts: Vec<_> = CopyEngines::split(256 << 20, &[1; 4], 1).collect();
        assert_eq!(parts.len(), 4);
        assert_eq!(parts[0], (1, 0, 64 << 20));
        assert_eq!(parts[3], (0, 192 << 20, 64 << 20));
        // Uneven: parts are 64 KiB aligned and cover the copy exactly once.
        let bytes = (100 << 20) + 12345;
        let parts: Vec<_> = CopyEngines::split(bytes, &[1; 3], 0).collect();
        let mut at = 0;
        for (i, &(e, off, len)) in parts.iter().enumerate() {
            assert_eq!(e, i % 3);
            assert_eq!(off, at);
            assert_eq!(off % (64 << 10), 0);
            at += len;
        }
        assert_eq!(at, bytes);
    }

    #[test]
    fn split_shares_follow_the_engines_weights() {
        // An H100's LCEs 2, 3 and 4: one PCE, one PCE, six.
        let bytes = 256u64 << 20;
        let parts: Vec<_> = CopyEngines::split(bytes, &[1, 1, 6], 1).collect();
        let share = |e: usize| parts.iter().find(|p| p.0 == e).map_or(0, |p| p.2);
        assert_eq!(parts.iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 2, 0]);
        assert_eq!(share(2), bytes * 6 / 8);
        assert_eq!(share(0), bytes / 8);
        assert_eq!(share(1), bytes / 8);
        let mut at = 0;
        for &(_, off, len) in &parts {
            assert_eq!(off, at);
            at += len;
        }
        assert_eq!(at, bytes);
        // A zero weight counts as one; a copy too small to split goes whole to the first engine.
        let parts: Vec<_> = CopyEngines::split(bytes, &[0, 1], 0).collect();
        assert_eq!(parts, vec![(0, 0, bytes / 2), (1, bytes / 2, bytes / 2)]);
        assert_eq!(
            CopyEngines::split(1 << 20, &[1, 6], 1).collect::<Vec<_>>(),
            vec![(1, 0, 1 << 20)]
        );
    }
}
