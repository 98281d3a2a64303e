//! How a channel is built ([`ChannelConfig`]) and the classes it was built with ([`ChannelClasses`]).

use crate::rm::Placement;

/// How to build a channel: start from [`ChannelConfig::default`] (or [`ChannelConfig::copy_engine`]) and change it
/// with the `with_*` methods (`#[non_exhaustive]`, so new options are not breaking changes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChannelConfig {
    /// GPFIFO entries (a power of two, 2 to 65536).
    pub entries: u32,
    /// Where the ring and USERD live. Video memory, mapped write-combined through BAR1, is what libcuda uses.
    pub ring_placement: Placement,
    /// Bind the compute class (subchannel 1) and the copy class (subchannel 4) to the channel.
    pub compute: bool,
    /// See `compute`: with `copy`, the copy class is bound on subchannel 4.
    pub copy: bool,
    /// Build a copy-only channel on this logical copy engine (LCE index) instead of one on the graphics engine,
    /// whose copy engine (the GRCE) is shared with compute and slower. Needs `compute: false, copy: true`.
    pub copy_engine: Option<u32>,
    /// Build the graphics-engine channel in a channel group of its own instead of the group this GPU's other
    /// channels share. Channels of one group run their kernels side by side, as CUDA's streams of one context
    /// do; groups take turns on the engine. A channel that yields its group while it waits
    /// (`ACQUIRE_SWITCH_TSG`, as a polled queue's gate does) needs a group of its own, or it would yield the
    /// others' too. Copy-engine channels always have their own.
    pub own_group: bool,
}

impl Default for ChannelConfig {
    fn default() -> ChannelConfig {
        ChannelConfig {
            entries: 1024,
            ring_placement: Placement::Video,
            compute: true,
            copy: true,
            copy_engine: None,
            own_group: false,
        }
    }
}

impl ChannelConfig {
    /// A copy-only channel on logical copy engine `lce`.
    pub fn copy_engine(lce: u32) -> ChannelConfig {
        ChannelConfig {
            compute: false,
            copy: true,
            copy_engine: Some(lce),
            ..ChannelConfig::default()
        }
    }

    /// Sets [`entries`](Self::entries).
    pub fn with_entries(mut self, entries: u32) -> ChannelConfig {
        self.entries = entries;
        self
    }

    /// Sets [`ring_placement`](Self::ring_placement).
    pub fn with_ring_placement(mut self, placement: Placement) -> ChannelConfig {
        self.ring_placement = placement;
        self
    }

    /// Sets [`compute`](Self::compute).
    pub fn with_compute(mut self, compute: bool) -> ChannelConfig {
        self.compute = compute;
        self
    }

    /// Sets [`copy`](Self::copy).
    pub fn with_copy(mut self, copy: bool) -> ChannelConfig {
        self.copy = copy;
        self
    }

    /// Sets [`copy_engine`](Self::copy_engine) (see also [`ChannelConfig::copy_engine`], which makes a copy-only
    /// channel).
    pub fn with_copy_engine(mut self, lce: Option<u32>) -> ChannelConfig {
        self.copy_engine = lce;
        self
    }

    /// Sets [`own_group`](Self::own_group).
    pub fn with_own_group(mut self, own: bool) -> ChannelConfig {
        self.own_group = own;
        self
    }
}

/// The classes a channel was built with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChannelClasses {
    /// The GPFIFO (host) class of the channel (`0xc86f` on Hopper).
    pub gpfifo: u32,
    /// The compute class bound on subchannel 1, if any.
    pub compute: Option<u32>,
    /// The copy class bound on subchannel 4, if any.
    pub copy: Option<u32>,
}
