//! A channel's faults: what RM posts to its error notifier ([`ChannelFault`]), the MMU fault and SM error state
//! RM reports on request, and [`FaultWatch`], which reads the notifier for waiters that do not hold the channel.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::rm::{Memory, NotifierWords, Object, sys};

use super::{Channel, Result};
use crate::gpfifo::fault::{ChannelFault, SmError};

impl Channel {
    /// The error RM posted to the channel's notifier, if any.
    pub fn fault(&self) -> Option<ChannelFault> {
        let f = read_fault(&*self.notifier);
        if f.is_some() {
            mark_group_faulted(self.group_faulted.as_deref());
        }
        f
    }

    /// The MMU fault RM recorded for this channel (address, fault type and RM's name for it), if any. RM clears
    /// it once read. An RM call: for after a fault, not for the launch path.
    pub fn mmu_fault(&self) -> Result<Option<MmuFault>> {
        let mut p = sys::NV906F_CTRL_GET_MMU_FAULT_INFO_PARAMS::default();
        self.channel.ctrl(&mut p)?;
        let address = (u64::from(p.addrHi) << 32) | u64::from(p.addrLo);
        let kind: String = p
            .faultString
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8 as char)
            .collect();
        if address == 0 && p.faultType == 0 && kind.is_empty() {
            return Ok(None);
        }
        Ok(Some(MmuFault {
            address,
            fault_type: p.faultType,
            kind,
            shader_program_va: p.shaderProgramVA,
        }))
    }

    /// A handle that reads the channel's error notifier, for waiters that do not hold the channel.
    pub fn fault_watch(&self) -> FaultWatch {
        FaultWatch(Arc::new(FaultState {
            notifier: self.notifier.clone(),
            channel: Arc::downgrade(&self.channel),
            debugger: self.debugger.as_ref().map(Arc::downgrade),
            sm_count: self.core.info.sm_count,
            group_faulted: self.group_faulted.clone(),
            mmu: std::sync::OnceLock::new(),
            sm: std::sync::OnceLock::new(),
        }))
    }
}

/// An MMU fault as RM reports it for a channel (NV906F_CTRL_CMD_GET_MMU_FAULT_INFO).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MmuFault {
    /// The faulting GPU virtual address.
    pub address: u64,
    /// RM's fault type code, named in `kind`.
    pub fault_type: u32,
    /// RM's name for the fault type (e.g. "FAULT_PDE").
    pub kind: String,
    /// Program addresses of the faulting shaders, by pipeline stage (compute is index 6).
    pub shader_program_va: [u64; 7],
}

/// Reads a channel's error notifier (cheap: four volatile loads from cached system memory).
#[derive(Clone, Debug)]
pub struct FaultWatch(Arc<FaultState>);

#[derive(Debug)]
struct FaultState {
    notifier: Arc<Memory>,
    // Weak: a fence that outlives its queue must not keep the channel allocated (and scheduled) after the ring and
    // USERD it points at are gone. RM is asked about faults only while the channel exists.
    channel: Weak<Object>,
    debugger: Option<Weak<Object>>,
    sm_count: u32,
    /// The shared group's fault mark (see `Channel::group_faulted`).
    group_faulted: Option<Arc<AtomicBool>>,
    /// Asked of RM once on the fault path, then kept for every waiter.
    mmu: std::sync::OnceLock<Option<(u64, u32)>>,
    sm: std::sync::OnceLock<Option<SmError>>,
}

impl FaultWatch {
    /// The channel's fault, if RM has posted one. For an MMU fault, the faulting address is asked of RM once
    /// (an RM call, only on this error path).
    pub fn check(&self) -> Option<ChannelFault> {
        let mut f = read_fault(&*self.0.notifier)?;
        mark_group_faulted(self.0.group_faulted.as_deref());
        if f.info32 == XID_MMU_FAULT {
            f.mmu = *self.0.mmu.get_or_init(|| {
                let mut p = sys::NV906F_CTRL_GET_MMU_FAULT_INFO_PARAMS::default();
                self.0.channel.upgrade()?.ctrl(&mut p).ok().map(|()| {
                    (
                        (u64::from(p.addrHi) << 32) | u64::from(p.addrLo),
                        p.faultType,
                    )
                })
            });
        }
        if f.info32 == XID_GRAPHICS_EXCEPTION {
            f.sm = *self.0.sm.get_or_init(|| self.first_sm_error());
        }
        Some(f)
    }

    fn first_sm_error(&self) -> Option<SmError> {
        let debugger = self.0.debugger.as_ref()?.upgrade()?;
        let channel = self.0.channel.upgrade()?;
        let per_call = sys::NV83DE_CTRL_DEBUG_MAX_SMS_PER_CALL;
        let mut start = 0;
        while start < self.0.sm_count {
            let mut p = Box::new(sys::NV83DE_CTRL_DEBUG_READ_ALL_SM_ERROR_STATES_PARAMS {
                hTargetChannel: channel.handle(),
                numSMsToRead: per_call.min(self.0.sm_count - start),
                startingSM: start,
                ..Default::default()
            });
            debugger.ctrl(&mut *p).ok()?;
            let n = p.numSMsToRead.min(per_call) as usize;
            if let Some((i, r)) = p.smErrorStateArray[..n]
                .iter()
                .enumerate()
                .find(|(_, r)| r.hwwGlobalEsr != 0 || r.hwwWarpEsr != 0)
            {
                return Some(SmError {
                    sm: start + i as u32,
                    global_esr: r.hwwGlobalEsr,
                    warp_esr: r.hwwWarpEsr,
                    warp_pc: r.hwwWarpEsrPc64,
                });
            }
            start += per_call;
        }
        None
    }
}

/// The error codes RM posts for an MMU fault (Xid 31) and a graphics exception (Xid 13).
const XID_MMU_FAULT: u32 = 31;
const XID_GRAPHICS_EXCEPTION: u32 = 13;

/// Marks a shared channel group as ended by a fault (RM tears the whole group down), so that no new channel joins it.
pub(super) fn mark_group_faulted(mark: Option<&AtomicBool>) {
    if let Some(m) = mark {
        m.store(true, Ordering::Release);
    }
}

pub(super) fn read_fault(notifier: &(impl NotifierWords + ?Sized)) -> Option<ChannelFault> {
    let off_info = std::mem::offset_of!(sys::NvNotificationRec, info32) as u64;
    // The status word first: once it is set, the rest of the record is being written.
    let last = notifier.read_u32_volatile(off_info + 4).ok()?;
    let (info16, status) = (last as u16, (last >> 16) as u16);
    if status == 0 {
        return None;
    }
    // RM may set the status before the error code: a reader in between saw "error code 0" once (a polled queue's
    // fault test, H100). Give the code a moment to land; a real error is never code 0.
    let start = Instant::now();
    let mut info32 = notifier.read_u32_volatile(off_info).ok()?;
    while info32 == 0 && start.elapsed() < Duration::from_millis(10) {
        std::hint::spin_loop();
        info32 = notifier.read_u32_volatile(off_info).ok()?;
    }
    let w0 = notifier.read_u32_volatile(0).ok()?;
    let w1 = notifier.read_u32_volatile(4).ok()?;
    Some(ChannelFault {
        mmu: None,
        sm: None,
        status,
        info32,
        info16,
        timestamp_ns: u64::from(w0) | (u64::from(w1) << 32),
    })
}
