//! Our own GPFIFO channel: the ring, USERD and the doorbell, and submission through them.
//!
//! The channel's code is split by concern: `config` (how a channel is built: `ChannelConfig`, `ChannelClasses`),
//! `build` (`Channel::new`: its channel group, subcontext, engine objects and UVM registration), `fault` (the
//! error notifier, `FaultWatch`, MMU faults and SM error states) and `store_order` (write-combined stores, the
//! store fences before the doorbell, write prefetch). This file holds the channel itself: its state, accessors,
//! and submission (`push`, `kick`).

mod build;
mod config;
mod fault;
mod store_order;
#[cfg(test)]
mod tests;

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use crate::rm::{GpuCore, Memory, Object, Placement, sys};

use super::timeline::{Semaphores, Timeline, wait_until};
use super::{Error, GpEntry, Result, RingState};

use build::UvmChannel;
pub use config::{ChannelClasses, ChannelConfig};
pub use fault::{FaultWatch, MmuFault};
use fault::{mark_group_faulted, read_fault};
pub use store_order::prefetch_for_write;
use store_order::{cached_store_order, is_write_combined, store_fence};

const USERD_SIZE: u64 = 0x200;

/// A GPFIFO channel of our own with a subcontext of its own: on the graphics engine in the channel group this GPU's
/// channels share (so their kernels run side by side) or, with [`ChannelConfig::own_group`], in a group of its own;
/// on a copy engine in a group on that engine's runlist; on a GPU attached to a CUDA context, in CUDA's channel
/// group and address space.
///
/// Fields drop in order: UVM registration, engine objects, channel, group; then the memory they used.
#[derive(Debug)]
pub struct Channel {
    uvm: Option<UvmChannel>,
    /// GT200_DEBUGGER on the compute object: lets a fault report name the SM and its error state.
    debugger: Option<Arc<Object>>,
    compute: Option<Object>,
    copy: Option<Object>,
    channel: Arc<Object>,
    _ctxshare: Option<Arc<Object>>,
    tsg: Arc<Object>,
    ring_mem: Memory,
    notifier: Arc<Memory>,
    sems: Arc<Semaphores>,
    ring: NonNull<u64>,
    userd: NonNull<u32>,
    doorbell: NonNull<u32>,
    token: u32,
    state: RingState,
    /// GP_PUT as the last doorbell published it.
    published: u32,
    /// Doorbells rung so far: lets layers above tell whether recorded work may already be visible to the GPU.
    kicks: u64,
    /// Whether anything the GPU fetches for this channel's work is written through a write-combined mapping, whose
    /// stores only a store fence orders before the doorbell.
    write_combined: bool,
    classes: ChannelClasses,
    core: Arc<GpuCore>,
    /// For a channel of the shared group: the group's fault mark, set when this channel is seen faulted (RM ends
    /// the whole group), so that later channels found a new group instead of joining a dead one.
    group_faulted: Option<Arc<AtomicBool>>,
}

// SAFETY: the raw pointers point into mappings owned by this struct (ring, USERD) or by the GpuCore it holds
// (doorbell); `&mut self` serialises every write through them.
unsafe impl Send for Channel {}

impl Channel {
    /// The classes the channel was built with.
    pub fn classes(&self) -> ChannelClasses {
        self.classes
    }

    /// The GPU the channel runs on.
    pub fn gpu(&self) -> &Arc<GpuCore> {
        &self.core
    }

    /// The work-submit token this channel rings the doorbell with.
    pub fn token(&self) -> u32 {
        self.token
    }

    /// GPU address of the GPFIFO ring.
    pub fn ring_va(&self) -> u64 {
        self.ring_mem.va()
    }

    /// Where the CPU's put and the GPU's last seen get stand in the ring.
    pub fn ring_state(&self) -> RingState {
        self.state
    }

    /// The channel's semaphore page (slot 0 is free for the layer above to use as its timeline).
    pub fn semaphores(&self) -> &Arc<Semaphores> {
        &self.sems
    }

    /// A timeline on semaphore slot `slot` of the channel's semaphore page.
    pub fn timeline(&self, slot: usize) -> Timeline {
        Timeline::new(self.sems.clone(), slot)
    }

    fn userd_word(&self, byte_offset: usize) -> *mut u32 {
        // SAFETY (for callers' dereference): byte_offset is one of USERD's fields, inside the 512-byte USERD.
        debug_assert!(byte_offset + 4 <= USERD_SIZE as usize);
        self.userd.as_ptr().wrapping_add(byte_offset / 4)
    }

    /// GP_GET as the GPU last wrote it to USERD.
    pub fn read_gp_get(&self) -> u32 {
        let off = std::mem::offset_of!(sys::HopperAControlGPFifo, GPGet);
        // SAFETY: USERD is mapped for the channel's lifetime; the GPU updates this word, so it is read volatile.
        unsafe { self.userd_word(off).read_volatile() }
    }

    /// GP_PUT as this channel last published it (what the GPU fetches up to once the doorbell is rung).
    pub fn published_put(&self) -> u32 {
        self.published
    }

    /// Re-reads GP_GET and returns the free entries.
    pub fn refresh(&mut self) -> u32 {
        let get = self.read_gp_get();
        self.state.observe_get(get);
        self.state.free()
    }

    /// Whether the channel is in the graphics-engine group this GPU's channels share
    /// ([`ChannelConfig::own_group`]): an acquire that yields its group (`ACQUIRE_SWITCH_TSG`) would then yield
    /// every channel of it.
    pub fn shares_group(&self) -> bool {
        self.group_faulted.is_some()
    }

    /// Writes an entry for `[va, va + 4*dwords)` without ringing the doorbell. Waits up to `timeout` for a free
    /// slot when the ring is full; never overwrites an entry the GPU has not fetched.
    pub fn push(&mut self, va: u64, dwords: u64, timeout: Duration) -> Result<()> {
        self.push_entry(GpEntry::segment(va, dwords)?, timeout)
    }

    /// As [`push`](Self::push), for an entry built by the caller (for example one the front end fetches only
    /// after the methods before it have run, [`GpEntry::fetched_after_previous`]).
    pub fn push_entry(&mut self, entry: GpEntry, timeout: Duration) -> Result<()> {
        if self.state.free() == 0 && self.refresh() == 0 {
            if let Some(f) = self.fault() {
                return Err(Error::Fault(f));
            }
            // Ring the doorbell first so the GPU is fetching what we wait for.
            self.kick();
            let notifier = &self.notifier;
            let userd = self.userd_word(std::mem::offset_of!(sys::HopperAControlGPFifo, GPGet));
            let state = &mut self.state;
            wait_until(
                "a free GPFIFO entry",
                timeout,
                || {
                    // SAFETY: as in `read_gp_get`.
                    let get = unsafe { userd.read_volatile() };
                    state.observe_get(get);
                    state.free() > 0
                },
                || read_fault(&**notifier),
            )?;
        }
        let slot = self.state.push().expect("a free slot was ensured above");
        // SAFETY: slot < entries and the ring mapping holds `entries` u64s; the GPU reads it, so volatile.
        unsafe {
            self.ring
                .as_ptr()
                .add(slot as usize)
                .write_volatile(entry.0)
        };
        Ok(())
    }

    /// Publishes every pushed entry: store fence, GPPut to USERD, store fence, the token to the doorbell.
    #[inline]
    pub fn kick(&mut self) {
        self.kicks = self.kicks.wrapping_add(1);
        let put = self.state.put();
        self.published = put;
        // What GP_PUT publishes (entries, pushbuffers, QMDs, constant banks) must be in memory before GP_PUT is: the
        // front end of a channel that is running rereads GP_PUT without waiting for the doorbell, and would fetch a
        // write-combined word still in the CPU's buffers stale (an illegal method or QMD: the GPT-2 example faulted
        // this way once no fence's reference count, a locked instruction, happened to sit between them).
        self.order_stores();
        // SAFETY: GPPut lies inside USERD, mapped for the channel's lifetime.
        unsafe {
            self.userd_word(std::mem::offset_of!(sys::HopperAControlGPFifo, GPPut))
                .write_volatile(put)
        };
        // And GP_PUT before the doorbell. Cached stores are ordered before the uncached doorbell store by the CPU
        // itself (x86: stores are not reordered with older stores); write-combined ones need the store fence.
        self.order_stores();
        // SAFETY: the doorbell word lies inside the usermode page, which the GpuCore we hold keeps mapped.
        unsafe { self.doorbell.as_ptr().write_volatile(self.token) };
    }

    /// Orders every store made so far before the next one, for a store the GPU acts on without a doorbell (a
    /// gate word the front end polls): a store fence where something it fetches is written write-combined, else
    /// only the compiler's order (x86 keeps cached stores in order).
    #[inline]
    pub fn order_stores(&self) {
        if self.write_combined {
            store_fence();
        } else {
            cached_store_order();
        }
    }

    /// Says that work of this channel is also written through a write-combined mapping (a pushbuffer or launch
    /// slots in video memory or write-combined system memory), so every doorbell needs a store fence before it.
    pub fn note_write_combined(&mut self, placement: Placement) {
        self.write_combined |= is_write_combined(placement);
    }

    /// Whether each doorbell is preceded by a store fence (something the GPU fetches is written write-combined).
    pub fn needs_store_fence(&self) -> bool {
        self.write_combined || cfg!(not(target_arch = "x86_64"))
    }

    /// Prefetches for writing the ring line the next entry goes into ([`prefetch_for_write`]).
    #[inline]
    pub fn prefetch_next_entry(&self) {
        prefetch_for_write(
            self.ring
                .as_ptr()
                .wrapping_add(self.state.put() as usize)
                .cast(),
        );
    }

    /// Whether entries were pushed since the last doorbell (the GPU does not know of them yet).
    #[inline]
    pub fn has_unpublished(&self) -> bool {
        self.published != self.state.put()
    }

    /// Doorbells rung so far (by [`kick`](Self::kick), also when [`push`](Self::push) waits on a full ring).
    pub fn kicks(&self) -> u64 {
        self.kicks
    }

    /// `push` then `kick`.
    pub fn submit(&mut self, va: u64, dwords: u64, timeout: Duration) -> Result<()> {
        self.push(va, dwords, timeout)?;
        self.kick();
        Ok(())
    }

    /// Waits until the GPU has fetched every entry written so far.
    pub fn wait_fetched(&mut self, timeout: Duration) -> Result<()> {
        let target = self.state.put();
        let userd = self.userd_word(std::mem::offset_of!(sys::HopperAControlGPFifo, GPGet));
        let notifier = &self.notifier;
        let state = &mut self.state;
        wait_until(
            "the GPU to fetch the GPFIFO ring",
            timeout,
            || {
                // SAFETY: as in `read_gp_get`.
                state.observe_get(unsafe { userd.read_volatile() });
                state.get() == target
            },
            || read_fault(&**notifier),
        )
    }

    /// RM handles, for tools that correlate with RM's view.
    pub fn handles(&self) -> (u32, u32) {
        (self.tsg.handle(), self.channel.handle())
    }

    /// Whether a compute object is bound (subchannel 1).
    pub fn has_compute(&self) -> bool {
        self.compute.is_some()
    }

    /// Whether a copy object is bound (subchannel 4).
    pub fn has_copy(&self) -> bool {
        self.copy.is_some()
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // A fault nobody asked about still ends the shared group: no channel may join it after this one.
        if read_fault(&*self.notifier).is_some() {
            mark_group_faulted(self.group_faulted.as_deref());
        }
        // Objects go before the memory they reference; fields below handle the rest in declaration order.
        self.uvm = None;
        self.debugger = None;
        self.compute = None;
        self.copy = None;
    }
}
