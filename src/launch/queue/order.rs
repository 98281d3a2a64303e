//! How launches are ordered on a queue: stream order, unordered launches, and programmatic launches through
//! the slot gates and their latches.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use tracing::debug;

use crate::launch::qmd::{self, QMD_WORDS, QmdVersion};
use crate::launch::{Error, Result};
use crate::module::Kernel;
use crate::rm::{GpuCore, Memory, MemoryDesc, Placement};

use super::{ComputeQueue, SLOT_BYTES};

/// Bytes per slot gate ([`Gates`]): a QMD, on the 256-byte alignment SEND_PCAS and dependent pointers address.
const GATE_BYTES: u64 = 512;

/// Latch ids of eager programmatic launches and of programmatic chain links: above the ids graphs number their
/// producers with (node + 1), counting up per launch as libcuda numbers them, from one counter for the whole
/// process so that launches of different
/// queues (whose channels may share latches: their scope is not documented) do not share an id until 2^23 launches
/// later.
const EAGER_LATCH_FIRST: u32 = 0x0080_0000;
const EAGER_LATCH_SPAN: u32 = 0x0080_0000;
static NEXT_EAGER_LATCH: AtomicU32 = AtomicU32::new(0);

/// The `n`th eager latch id: in `EAGER_LATCH_FIRST..EAGER_LATCH_FIRST + EAGER_LATCH_SPAN` (24-bit ids), consecutive
/// `n` (wrapping at 2^32 included) giving different ids.
fn eager_latch(n: u32) -> u32 {
    EAGER_LATCH_FIRST + (n & (EAGER_LATCH_SPAN - 1))
}

/// Eager programmatic launches (CUDA's programmatic stream serialization): one gate per launch slot, a null grid
/// that the slot's programmatic launch counts down when it pre-exits and the front end counts down when the launch
/// after it is programmatic too; the gate then schedules that launch (in the next slot). Built when a queue first
/// launches programmatically.
pub(super) struct Gates {
    mem: Memory,
    /// The last launch sent with its gate armed: (slot, timeline value, latch it arrives at).
    last: Option<(usize, u64, u32)>,
}

impl Gates {
    /// Gates for `slots` launch slots starting at `slots_va`, built from `template` (any launch's QMD of this
    /// queue: only its scheduling fields matter once it is a null grid).
    fn new(
        gpu: &Arc<GpuCore>,
        version: QmdVersion,
        template: &[u32; QMD_WORDS],
        slots_va: u64,
        slots: usize,
    ) -> Result<Gates> {
        let mem = Memory::alloc(
            gpu,
            MemoryDesc::video(GATE_BYTES * slots as u64)
                .with_cpu()
                .low(),
        )?;
        for s in 0..slots {
            let next = slots_va + ((s + 1) % slots) as u64 * SLOT_BYTES;
            let mut g = *template;
            if !qmd::set_gate(version, &mut g, next)? {
                return Err(Error::Unsupported(format!(
                    "programmatic launches on QMD {version:?}"
                )));
            }
            mem.write_words(s as u64 * GATE_BYTES, &g[..version.size_bytes() / 4])?;
        }
        debug!(
            slots,
            "launch gates ready: programmatic launches on this queue"
        );
        Ok(Gates { mem, last: None })
    }

    fn va(&self, slot: usize) -> u64 {
        self.mem.va() + slot as u64 * GATE_BYTES
    }
}

/// A fresh latch id for an eager programmatic launch or a programmatic chain link ([`eager_latch`]).
pub(super) fn take_latch() -> u32 {
    eager_latch(NEXT_EAGER_LATCH.fetch_add(1, Ordering::Relaxed))
}

/// How a launch is ordered against the work before it on its queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Order {
    /// Not at all (until a join).
    Unordered,
    /// After the work before it has completed.
    Stream,
    /// Scheduled once the launch right before it has pre-exited (all its blocks exited or ran
    /// `griddepcontrol.launch_dependents`); its `griddepcontrol.wait` waits for that launch's completion.
    Programmatic,
}

impl Order {
    /// Stream order, or programmatic when `programmatic`: the two orders a launch call offers.
    pub(super) fn stream_or(programmatic: bool) -> Order {
        if programmatic {
            Order::Programmatic
        } else {
            Order::Stream
        }
    }
}

/// How a programmatic launch goes through the gates: the gate of its own slot, armed before it is sent, and the
/// gate of the slot before when that slot's programmatic launch schedules it (counted down instead of waiting).
#[derive(Clone, Copy, Debug)]
pub(super) struct GateSend {
    pub(super) own: u64,
    pub(super) after: Option<u64>,
}

/// The timeline release a launch's QMD carries.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Release {
    /// None: an unordered launch.
    None,
    /// The value the launch's own submission will have (after a join of unordered launches, if one is pending).
    Next,
    /// Set when the chain it belongs to ends.
    Later,
}

impl Release {
    pub(super) fn next_if(ordered: bool) -> Release {
        if ordered {
            Release::Next
        } else {
            Release::None
        }
    }
}

impl ComputeQueue {
    /// Gives the QMD `q` of a programmatic launch in `slot` its gate fields: it arms its slot's gate (built here by
    /// the queue's first programmatic launch, from `q`), so that a programmatic launch after it may be scheduled by
    /// that gate; and when it comes right after such a launch in the slot before, it waits for that one's latch and
    /// is scheduled by that one's gate. Returns the latch the launch arrives at and the slot whose gate schedules
    /// it, for [`send_ordered`](Self::send_ordered); `None` for any other launch, and on queues that cannot have
    /// gates.
    ///
    /// Only programmatic launches are gated: a gate costs the GPU about 0.3 µs per launch (the GPT-2 step's plain
    /// launches took 788 instead of 744 µs per token with gates, H100), which a launch that lets nothing overlap it
    /// should not pay. A programmatic launch after a plain one is therefore ordered as an ordinary launch.
    pub(super) fn gate(
        &mut self,
        order: Order,
        slot: usize,
        q: &mut [u32; QMD_WORDS],
    ) -> Result<Option<(u32, Option<usize>)>> {
        if order != Order::Programmatic || !self.can_gate() {
            return Ok(None);
        }
        if self.gates.is_none() {
            self.gates = Some(Gates::new(
                &self.gpu,
                self.version,
                q,
                self.slots.va(),
                self.slot_values.len(),
            )?);
            // The gates are written through the write-combined BAR1 mapping: doorbells must drain it first, also
            // on a queue whose ring, pushbuffer and slots are in host memory.
            self.queue.note_write_combined(Placement::Video);
        }
        let last_submitted = self.queue.last_submitted();
        let n = self.slot_values.len();
        let pending = self.unordered_pending;
        let Some(g) = &mut self.gates else {
            return Ok(None);
        };
        let latch = take_latch();
        qmd::set_gated_producer(self.version, q, g.va(slot), latch)?;
        let after = match g.last {
            Some((s, value, l)) if !pending && value == last_submitted && (s + 1) % n == slot => {
                qmd::set_latch_wait(self.version, q, l)?;
                Some(s)
            }
            _ => None,
        };
        Ok(Some((latch, after)))
    }

    /// Whether this queue can have gates: its QMDs are fetched (an inline QMD cannot be scheduled later) and it has
    /// two slots or more (with one, the next launch's gate would be the one its producer counts down).
    pub(super) fn can_gate(&self) -> bool {
        !self.inline_qmd && self.slot_values.len() >= 2
    }

    /// Sends the launch staged in `slot`: through the gates when [`gate`](Self::gate) gave it gate fields, else
    /// as [`send_launch`](Self::send_launch) does.
    pub(super) fn send_ordered(
        &mut self,
        slot: usize,
        kernel: &Kernel,
        ordered: bool,
        gated: Option<(u32, Option<usize>)>,
    ) -> Result<u64> {
        let Some((latch, after)) = gated else {
            return self.send_launch(slot, kernel, ordered, None);
        };
        let gate = self.gates.as_ref().map(|g| GateSend {
            own: g.va(slot),
            after: after.map(|s| g.va(s)),
        });
        let value = self.send_launch(slot, kernel, true, gate)?;
        if let Some(g) = &mut self.gates {
            g.last = Some((slot, value, latch));
        }
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::{EAGER_LATCH_FIRST, EAGER_LATCH_SPAN, eager_latch};

    #[test]
    fn eager_latches_stay_in_their_range_and_differ_for_consecutive_launches() {
        let last = EAGER_LATCH_FIRST + EAGER_LATCH_SPAN - 1;
        assert_eq!(eager_latch(0), EAGER_LATCH_FIRST);
        assert_eq!(eager_latch(EAGER_LATCH_SPAN - 1), last);
        assert_eq!(last, 0x00ff_ffff, "latch ids have 24 bits");
        // Around the range's end and the counter's wrap at 2^32.
        for n in [EAGER_LATCH_SPAN - 2, u32::MAX - 1, u32::MAX] {
            let (a, b) = (eager_latch(n), eager_latch(n.wrapping_add(1)));
            assert_ne!(a, b, "{n}");
            for l in [a, b] {
                assert!((EAGER_LATCH_FIRST..=last).contains(&l), "{l:#x}");
            }
        }
        assert_eq!(eager_latch(u32::MAX), last);
        assert_eq!(
            eager_latch(0u32.wrapping_add(EAGER_LATCH_SPAN)),
            EAGER_LATCH_FIRST
        );
    }
}
