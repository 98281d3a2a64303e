//! What RM posts when a channel faults ([`ChannelFault`], [`SmError`]): plain data, apart from the channel that
//! reads it (`channel/fault.rs`), so that the error type can carry it.

use std::fmt;

/// What RM wrote to the channel's error notifier when the channel faulted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChannelFault {
    /// Non-zero once RM has posted an error.
    pub status: u16,
    /// The error code (the Xid RM logs, e.g. 13 graphics exception, 31 MMU fault, 43 reset channel).
    pub info32: u32,
    /// The notifier's 16-bit detail word; what it holds depends on the error.
    pub info16: u16,
    /// When RM posted the error, nanoseconds on the GPU's clock.
    pub timestamp_ns: u64,
    /// For an MMU fault, the faulting GPU address and RM's fault type, when RM reported them.
    pub mmu: Option<(u64, u32)>,
    /// For a graphics exception, the first SM that reported an error, as the debugger object reads it.
    pub sm: Option<SmError>,
}

/// One SM's error state (NV83DE_CTRL_CMD_DEBUG_READ_ALL_SM_ERROR_STATES).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SmError {
    /// The SM's index.
    pub sm: u32,
    /// The SM's global and warp error status registers.
    pub global_esr: u32,
    /// The faulting warp's error status register.
    pub warp_esr: u32,
    /// Program counter of the faulting warp.
    pub warp_pc: u64,
}

impl fmt::Display for ChannelFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.info32 {
            13 => {
                "graphics engine exception (illegal instruction, trap, or out-of-range access in a kernel)"
            }
            31 => "GPU memory management unit fault (access to an unmapped address)",
            43 => "channel stopped by RM",
            45 => "channel preempted and removed",
            _ => "channel error",
        };
        write!(
            f,
            "{kind}: error code {} (info16 {:#x}, notifier status {:#x})",
            self.info32, self.info16, self.status
        )?;
        if let Some((address, ty)) = self.mmu {
            write!(f, ", faulting address {address:#x} (MMU fault type {ty})")?;
        }
        if let Some(e) = self.sm {
            write!(
                f,
                ", SM {}: global ESR {:#x}, warp ESR {:#x} at pc {:#x}",
                e.sm, e.global_esr, e.warp_esr, e.warp_pc
            )?;
        }
        Ok(())
    }
}
