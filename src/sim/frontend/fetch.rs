//! Fetching: the GPFIFO entry at GP_GET, the segments fetched ahead while the channel is blocked, decoding a
//! segment's words, and dispatching each method to the host or the engine bound to its subchannel.

use super::super::headers::{c8b5 as copy, cbc0 as compute};
use super::decode::{Kind, Method, decode};
use super::{ChannelModel, Flow, GP_GET, GP_PUT, mmu};
use crate::gpfifo::GpEntry;
use crate::rm::sim::SimView;

use super::super::{Records, SimErrorKind};

/// Segments the front end fetches ahead of a blocked method.
const PREFETCH_ENTRIES: usize = 8;

impl ChannelModel {
    /// The GPFIFO entry at GP_GET, if GP_PUT (as this model fetches: from USERD, or as the last doorbell read it)
    /// is past it.
    pub(super) fn next_entry(&self, view: &SimView<'_>) -> Result<Option<GpEntry>, SimErrorKind> {
        let put = if self.fetch_on_doorbell {
            self.doorbell_put.unwrap_or(self.get)
        } else {
            view.read_u32(self.ch.userd_va + GP_PUT)
                .map_err(mmu("USERD"))?
        };
        if put >= self.ch.entries {
            return Err(SimErrorKind::BadGpPut {
                put,
                entries: self.ch.entries,
            });
        }
        if put == self.get {
            return Ok(None);
        }
        let slot = self.ch.ring_va + u64::from(self.get) * 8;
        Ok(Some(GpEntry(
            view.read_u64(slot).map_err(mmu("GPFIFO ring"))?,
        )))
    }

    /// Moves GP_GET past the entry [`next_entry`](Self::next_entry) returned, and tells USERD.
    pub(super) fn take_entry(&mut self, view: &SimView<'_>) -> Result<(), SimErrorKind> {
        self.get = (self.get + 1) % self.ch.entries;
        view.write_u32(self.ch.userd_va + GP_GET, self.get)
            .map_err(mmu("USERD"))?;
        self.stats.entries += 1;
        self.stats.gp_get = self.get;
        Ok(())
    }

    /// While the channel is blocked: fetches the segments of the entries after the current one, up to one marked
    /// to be fetched only after the methods before it.
    pub(super) fn prefetch(&mut self, view: &SimView<'_>) -> Result<(), SimErrorKind> {
        while self.prefetched.len() < PREFETCH_ENTRIES {
            let entry = match self.next_entry(view) {
                Ok(Some(e)) if !e.is_fetched_after_previous() => e,
                // A bad GP_PUT faults when the channel fetches next, not while it waits.
                Ok(_) | Err(SimErrorKind::BadGpPut { .. }) => return Ok(()),
                Err(e) => return Err(e),
            };
            self.take_entry(view)?;
            self.stats.prefetched += 1;
            let words = if entry.dwords() == 0 {
                Vec::new()
            } else {
                view.read_words(entry.va(), entry.dwords() as usize)
                    .map_err(mmu("pushbuffer segment"))?
            };
            self.prefetched.push_back(words);
        }
        Ok(())
    }

    /// Fetches and decodes the segment an entry points to.
    pub(super) fn load(&mut self, entry: GpEntry, view: &SimView<'_>) -> Result<(), SimErrorKind> {
        let dwords = entry.dwords();
        // A zero-length entry is a control entry (NOP); APEX never writes one, hardware skips it.
        if dwords == 0 {
            return Ok(());
        }
        let words = view
            .read_words(entry.va(), dwords as usize)
            .map_err(mmu("pushbuffer segment"))?;
        self.load_words(&words);
        Ok(())
    }

    /// Decodes a fetched segment's words as the methods to run next.
    pub(super) fn load_words(&mut self, words: &[u32]) {
        if words.is_empty() {
            self.pending.clear();
            self.next = 0;
            return;
        }
        self.next = 0;
        // The methods before a bad word are fetched and run, as on hardware; the error faults after them.
        let (methods, error) = decode(words);
        self.pending = methods;
        if let Some(e) = error {
            self.tail_error = Some(SimErrorKind::Decode(e));
        }
    }

    pub(super) fn execute(
        &mut self,
        m: &Method,
        view: &SimView<'_>,
        now: &dyn Fn() -> u64,
        rec: &mut Records,
    ) -> Result<Flow, SimErrorKind> {
        if m.kind == Kind::EndSegment {
            return Ok(Flow::Continue);
        }
        // Methods below 0x100 belong to the host (PBDMA) on every subchannel.
        if m.offset < 0x100 {
            return self.host_method(m, view, now);
        }
        let class = self.bound.get(usize::from(m.subchannel)).copied().flatten();
        match class {
            None => Err(SimErrorKind::UnboundSubchannel {
                subchannel: m.subchannel,
                method: m.offset,
            }),
            Some(compute::CLASS) if m.subchannel != 0 => self.compute_method(m, view, now, rec),
            Some(copy::CLASS) if m.subchannel != 0 => self.copy_method(m, view),
            Some(class) => Err(SimErrorKind::UnknownMethod {
                subchannel: m.subchannel,
                class,
                method: m.offset,
            }),
        }
    }
}
