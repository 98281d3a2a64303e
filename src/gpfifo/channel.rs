use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::hw::Generation;
use crate::hw::host::c361;
use crate::rm::{
    COPY_ALLOC_VERSION_ENGINE_TYPE, ChannelGroupSchedule, CopyAllocParams, GpuCore, MAX_LCES,
    Memory, MemoryDesc, Object, Placement, copy_engine_type, sys,
};

use super::timeline::{Semaphores, Timeline, wait_until};
use super::{Error, GpEntry, Result, RingState};

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

const USERD_SIZE: u64 = 0x200;
const NOTIFIER_SIZE: u64 = 0x1000;
/// VA that UVM_REGISTER_CHANNEL reserves for the channel's context buffers (libcuda passes the GR context size).
const CHANNEL_VA_SIZE: u64 = 64 << 20;

/// Unregisters the channel from UVM and returns its context VA, before the channel object is freed.
#[derive(Debug)]
struct UvmChannel {
    core: Arc<GpuCore>,
    channel: u32,
    va: u64,
}

impl Drop for UvmChannel {
    fn drop(&mut self) {
        let mut p = sys::UVM_UNREGISTER_CHANNEL_PARAMS {
            gpuUuid: sys::NvProcessorUuid {
                uuid: self.core.info.uuid_bytes,
            },
            hClient: self.core.client.handle(),
            hChannel: self.channel,
            rmStatus: 0,
        };
        if let Err(e) = self.core.client.uvm_call(
            sys::UVM_UNREGISTER_CHANNEL,
            &mut p,
            "UVM_UNREGISTER_CHANNEL",
            |p| p.rmStatus,
        ) {
            warn!(error = %e, "UVM_UNREGISTER_CHANNEL failed");
        }
        self.core.low.free(self.va, CHANNEL_VA_SIZE);
    }
}

/// The memory a channel is built on.
struct ChannelMemory<'a> {
    ring: &'a Memory,
    ring_bytes: u64,
    entries: u32,
    notifier: &'a Memory,
}

/// A channel's RM objects, before it is scheduled.
struct ChannelObjects {
    uvm: Option<UvmChannel>,
    debugger: Option<Arc<Object>>,
    compute: Option<Object>,
    copy: Option<Object>,
    channel: Arc<Object>,
    ctxshare: Option<Arc<Object>>,
    tsg: Arc<Object>,
    token: u32,
}

impl ChannelObjects {
    /// Schedules the channel by itself, in a group that already runs (the shared group, or CUDA's).
    fn schedule_alone(&self) -> Result<()> {
        let mut sched = sys::NVA06F_CTRL_GPFIFO_SCHEDULE_PARAMS {
            bEnable: 1,
            ..Default::default()
        };
        Ok(self.channel.ctrl(&mut sched)?)
    }

    /// A subcontext on `vaspace` in `tsg`, the channel with its engine objects, its work-submit token and its UVM
    /// registration. `debugger`: also a GT200_DEBUGGER for fault reports (not in a group shared with CUDA, whose
    /// own debugger session must not be disturbed).
    fn build(
        core: &Arc<GpuCore>,
        tsg: &Arc<Object>,
        vaspace: &Arc<Object>,
        classes: ChannelClasses,
        mem: &ChannelMemory<'_>,
        debugger: bool,
        engine_type: u32,
    ) -> Result<ChannelObjects> {
        let client = core.client();
        let graphics = engine_type == sys::NV2080_ENGINE_TYPE_GRAPHICS;
        // Subcontexts are a graphics-engine feature: a copy-engine channel takes its group's VA space through
        // RM's legacy context share (a channel in a group may not name a VA space itself).
        let ctxshare = if graphics {
            let mut cs = sys::NV_CTXSHARE_ALLOCATION_PARAMETERS {
                hVASpace: vaspace.handle(),
                flags: sys::NV_CTXSHARE_ALLOCATION_FLAGS_SUBCONTEXT_ASYNC,
                subctxId: 0,
            };
            Some(Arc::new(Object::alloc(
                client,
                Some(tsg),
                sys::FERMI_CONTEXT_SHARE_A,
                Some(&mut cs),
                "FERMI_CONTEXT_SHARE_A",
            )?))
        } else {
            None
        };
        let mut cp = sys::NV_CHANNEL_ALLOC_PARAMS {
            hObjectError: mem.notifier.handle(),
            hObjectBuffer: mem.ring.handle(),
            gpFifoOffset: mem.ring.va(),
            gpFifoEntries: mem.entries,
            hContextShare: ctxshare.as_ref().map_or(0, |c| c.handle()),
            // Left 0 on graphics channels, as before; a copy channel names its engine as its group does.
            engineType: if graphics { 0 } else { engine_type },
            ..Default::default()
        };
        cp.hUserdMemory[0] = mem.ring.handle();
        cp.userdOffset[0] = mem.ring_bytes;
        let channel = Arc::new(Object::alloc(
            client,
            Some(tsg),
            classes.gpfifo,
            Some(&mut cp),
            "GPFIFO channel",
        )?);
        let compute = classes
            .compute
            .map(|c| Object::alloc::<()>(client, Some(&channel), c, None, "compute class"))
            .transpose()?;
        let copy = match (classes.copy, graphics) {
            (None, _) => None,
            (Some(c), true) => Some(Object::alloc::<()>(
                client,
                Some(&channel),
                c,
                None,
                "copy class",
            )?),
            // Without parameters RM binds the copy object to CE instance 0, whose runlist is not this
            // channel's group's: the group then cannot be scheduled (NV_ERR_INVALID_STATE, measured).
            (Some(c), false) => {
                let mut cp = CopyAllocParams {
                    version: COPY_ALLOC_VERSION_ENGINE_TYPE,
                    engine_type,
                };
                Some(Object::alloc(
                    client,
                    Some(&channel),
                    c,
                    Some(&mut cp),
                    "copy class",
                )?)
            }
        };
        // Optional: without it, faults are still reported, only without the SM state.
        let debugger = compute.as_ref().filter(|_| debugger).and_then(|c| {
            let mut dp = sys::NV83DE_ALLOC_PARAMETERS {
                hDebuggerClient_Obsolete: 0,
                hAppClient: client.handle(),
                hClass3dObject: c.handle(),
            };
            Object::alloc(
                client,
                Some(core.device()),
                sys::GT200_DEBUGGER,
                Some(&mut dp),
                "GT200_DEBUGGER",
            )
            .map_err(|e| debug!(error = %e, "no debugger object; faults will not carry SM state"))
            .ok()
            .map(Arc::new)
        });

        let mut tok = sys::NVC36F_CTRL_CMD_GPFIFO_GET_WORK_SUBMIT_TOKEN_PARAMS {
            workSubmitToken: u32::MAX,
        };
        channel.ctrl(&mut tok)?;

        // RM schedules no graphics channel on a UVM-owned VA space before UVM has bound its context buffers
        // (kchannelIsSchedulable). Copy channels, as libcuda's, stay unregistered: UVM_REGISTER_CHANNEL refuses
        // them (NV_ERR_INVALID_OBJECT, measured on H100 and H200) and RM schedules them without it.
        let uvm = if graphics {
            Some(register_with_uvm(core, channel.handle())?)
        } else {
            None
        };
        Ok(ChannelObjects {
            uvm,
            debugger,
            compute,
            copy,
            channel,
            ctxshare,
            tsg: tsg.clone(),
            token: tok.workSubmitToken,
        })
    }
}

/// A channel with a subcontext of its own in `group`, the graphics-engine group this GPU's channels share,
/// scheduled by itself (the group already is). No debugger object: the group's founder holds the one it binds to
/// the context, so a fault on this channel is reported without the SM's error state.
fn join_group(
    core: &Arc<GpuCore>,
    group: &Arc<Object>,
    classes: ChannelClasses,
    mem: &ChannelMemory<'_>,
    engine_type: u32,
) -> Result<ChannelObjects> {
    let o = ChannelObjects::build(
        core,
        group,
        core.vaspace(),
        classes,
        mem,
        false,
        engine_type,
    )?;
    o.schedule_alone()?;
    Ok(o)
}

/// Registers a graphics channel with UVM, which reserves `CHANNEL_VA_SIZE` of our low region for its context
/// buffers.
fn register_with_uvm(core: &Arc<GpuCore>, channel: u32) -> Result<UvmChannel> {
    let client = core.client();
    let uvm_va = core.low.alloc(CHANNEL_VA_SIZE, 2 << 20)?;
    let mut rc = sys::UVM_REGISTER_CHANNEL_PARAMS {
        gpuUuid: sys::NvProcessorUuid {
            uuid: core.info.uuid_bytes,
        },
        rmCtrlFd: client.ctl_raw_fd(),
        hClient: client.handle(),
        hChannel: channel,
        base: uvm_va,
        length: CHANNEL_VA_SIZE,
        rmStatus: 0,
    };
    if let Err(e) = client.uvm_call(
        sys::UVM_REGISTER_CHANNEL,
        &mut rc,
        "UVM_REGISTER_CHANNEL",
        |p| p.rmStatus,
    ) {
        core.low.free(uvm_va, CHANNEL_VA_SIZE);
        return Err(e.into());
    }
    Ok(UvmChannel {
        core: core.clone(),
        channel,
        va: uvm_va,
    })
}

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
    /// Builds a channel on `core` as `config` asks: its group (or a subcontext in CUDA's, on an attached GPU),
    /// the ring, USERD and error notifier in memory of ours, the engine objects, its UVM registration and its
    /// work-submit token. Nothing is submitted yet.
    pub fn new(core: &Arc<GpuCore>, config: ChannelConfig) -> Result<Channel> {
        let state = RingState::new(config.entries)
            .filter(|_| config.entries <= 65536)
            .ok_or_else(|| {
                Error::InvalidConfig(format!(
                    "{} GPFIFO entries: need a power of two from 2 to 65536",
                    config.entries
                ))
            })?;
        let engine_type = match config.copy_engine {
            None => sys::NV2080_ENGINE_TYPE_GRAPHICS,
            Some(lce) => match copy_engine_type(lce) {
                Some(t) if !config.compute && config.copy => t,
                _ => {
                    return Err(Error::InvalidConfig(format!(
                        "a channel on copy engine {lce}: needs an LCE index below {MAX_LCES} and a copy-only \
                         channel (compute: false, copy: true)"
                    )));
                }
            },
        };
        if engine_type != sys::NV2080_ENGINE_TYPE_GRAPHICS && core.attachment().is_some() {
            return Err(Error::InvalidConfig(
                "copy-engine channels are not built on a GPU attached to a CUDA context (its channel group runs \
                 on the graphics engine); use the queue's own copies"
                    .into(),
            ));
        }
        // The GPU's row of the generation table names the classes; an SM version without one is refused rather
        // than driven with another generation's.
        let generation = Generation::lookup(core.info().sm_version)?;
        let classes = generation.classes.ok_or(Error::NoClasses {
            generation: generation.chips,
        })?;
        let gpfifo = core.pick_class("GPFIFO channel", &[classes.gpfifo])?;
        let compute_class = if config.compute {
            Some(core.pick_class("compute", &[classes.compute])?)
        } else {
            None
        };
        let copy_class = if config.copy {
            Some(core.pick_class("copy engine", &[classes.copy])?)
        } else {
            None
        };
        let client = core.client();

        // Ring, then USERD in the same allocation right after it (as libcuda and tinygrad place them).
        // USERD follows the ring, 512-byte aligned as RM requires.
        let ring_bytes = (u64::from(config.entries) * 8).next_multiple_of(512);
        let ring_desc = MemoryDesc {
            size: ring_bytes + 0x1000,
            placement: config.ring_placement,
            cpu_mapped: true,
            low: true,
            contiguous: true,
        };
        let ring_mem = Memory::alloc(core, ring_desc)?;
        ring_mem.fill(0, ring_mem.size(), 0)?;
        let notifier = Arc::new(Memory::alloc(
            core,
            MemoryDesc::video(NOTIFIER_SIZE)
                .placement(Placement::SystemCached)
                .with_cpu()
                .low(),
        )?);
        notifier.fill(0, NOTIFIER_SIZE, 0)?;
        let sems = Semaphores::new(core)?;
        let classes = ChannelClasses {
            gpfifo,
            compute: compute_class,
            copy: copy_class,
        };
        let mem = ChannelMemory {
            ring: &ring_mem,
            ring_bytes,
            entries: config.entries,
            notifier: &notifier,
        };

        let share = engine_type == sys::NV2080_ENGINE_TYPE_GRAPHICS && !config.own_group;
        // Held while a channel joins or founds the shared group, so that two threads do not found two.
        let mut shared = share.then(|| {
            core.graphics_group
                .lock()
                .unwrap_or_else(|e| e.into_inner())
        });
        let joinable = shared.as_deref_mut().and_then(|g| {
            g.notifiers.retain(|n| n.strong_count() > 0);
            if g.notifiers
                .iter()
                .any(|n| n.upgrade().is_some_and(|n| read_fault(&n).is_some()))
            {
                g.faulted.store(true, Ordering::Release);
            }
            g.group
                .upgrade()
                .filter(|_| !g.faulted.load(Ordering::Acquire))
                .map(|group| (group, g.faulted.clone()))
        });
        let joined = match (core.attachment(), joinable) {
            (None, Some((group, faulted))) => {
                match join_group(core, &group, classes, &mem, engine_type) {
                    Ok(o) => Some((o, faulted)),
                    Err(e) => {
                        // A group RM will not add to (its subcontexts used up, say): found another. Queues in
                        // different groups take turns on the engine instead of running side by side.
                        warn!(error = %e, "joining the shared channel group failed; founding a new one");
                        None
                    }
                }
            }
            _ => None,
        };
        let (objects, group_faulted) = match (joined, core.attachment()) {
            (Some((o, faulted)), _) => (o, Some(faulted)),
            (None, None) => {
                let mut gp = sys::NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS {
                    engineType: engine_type,
                    // A copy-engine group has no subcontexts: its VA space is the group's.
                    hVASpace: if engine_type == sys::NV2080_ENGINE_TYPE_GRAPHICS {
                        0
                    } else {
                        core.vaspace().handle()
                    },
                    ..Default::default()
                };
                let tsg = Arc::new(Object::alloc(
                    client,
                    Some(core.device()),
                    sys::KEPLER_CHANNEL_GROUP_A,
                    Some(&mut gp),
                    "KEPLER_CHANNEL_GROUP_A",
                )?);
                let o = ChannelObjects::build(
                    core,
                    &tsg,
                    core.vaspace(),
                    classes,
                    &mem,
                    true,
                    engine_type,
                )?;
                let mut sched = ChannelGroupSchedule(sys::NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS {
                    bEnable: 1,
                    ..Default::default()
                });
                tsg.ctrl(&mut sched)?;
                if engine_type == sys::NV2080_ENGINE_TYPE_GRAPHICS {
                    set_compute_preemption_cilp(core, &tsg);
                }
                let faulted = shared.as_deref_mut().map(|g| {
                    g.group = Arc::downgrade(&tsg);
                    g.faulted = Arc::new(AtomicBool::new(false));
                    g.notifiers.clear();
                    g.faulted.clone()
                });
                (o, faulted)
            }
            (None, Some(att)) => {
                // A subcontext of our own in CUDA's running group: the channel is scheduled alone. UVM accepts
                // the channel only on the VA space its descriptor owns, which is the context's: try each.
                let mut last = None;
                let mut built = None;
                for vas in &att.vaspaces {
                    match ChannelObjects::build(
                        core,
                        &att.group,
                        vas,
                        classes,
                        &mem,
                        false,
                        engine_type,
                    ) {
                        Ok(o) => {
                            built = Some(o);
                            break;
                        }
                        Err(e) => {
                            debug!(error = %e, vaspace = format_args!("{:#x}", vas.handle()), "not this VA space");
                            last = Some(e);
                        }
                    }
                }
                let o = match (built, last) {
                    (Some(o), _) => o,
                    (None, Some(e)) => return Err(e),
                    (None, None) => {
                        return Err(Error::InvalidConfig(
                            "the attached context has no VA space".into(),
                        ));
                    }
                };
                o.schedule_alone()?;
                (o, None)
            }
        };
        if let Some(g) = shared.as_deref_mut().filter(|_| group_faulted.is_some()) {
            g.notifiers.push(Arc::downgrade(&notifier));
        }
        drop(shared);
        let ChannelObjects {
            uvm,
            debugger,
            compute,
            copy,
            channel,
            ctxshare,
            tsg,
            token,
        } = objects;
        let tok = sys::NVC36F_CTRL_CMD_GPFIFO_GET_WORK_SUBMIT_TOKEN_PARAMS {
            workSubmitToken: token,
        };

        let base = ring_mem.cpu_ptr().ok_or(crate::rm::Error::NotCpuMapped {
            size: ring_mem.size(),
        })?;
        let ring = base.cast::<u64>();
        // SAFETY: USERD starts `ring_bytes` into the CPU mapping of `ring_mem`, which is ring_bytes + 4 KiB long.
        let userd = unsafe { base.add(ring_bytes as usize) }.cast::<u32>();
        let doorbell = NonNull::new(core.usermode_ptr()).ok_or(Error::InvalidConfig(
            "the GPU has no usermode mapping".into(),
        ))?;
        // SAFETY: the usermode mapping is USERMODE_SIZE (64 KiB) long; the doorbell offset is inside it.
        let doorbell = unsafe { doorbell.add(c361::NOTIFY_CHANNEL_PENDING as usize) }.cast::<u32>();
        debug!(
            token = format_args!("{:#x}", tok.workSubmitToken),
            ?classes,
            ring = format_args!("{:#x}", ring_mem.va()),
            "channel ready"
        );
        Ok(Channel {
            uvm,
            debugger,
            compute,
            copy,
            channel,
            _ctxshare: ctxshare,
            tsg,
            ring_mem,
            notifier,
            sems,
            ring,
            userd,
            doorbell,
            token: tok.workSubmitToken,
            state,
            published: 0,
            kicks: 0,
            write_combined: is_write_combined(config.ring_placement),
            classes,
            core: core.clone(),
            group_faulted,
        })
    }

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

    /// The error RM posted to the channel's notifier, if any.
    pub fn fault(&self) -> Option<ChannelFault> {
        let f = read_fault(&self.notifier);
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
                || read_fault(notifier),
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
            || read_fault(notifier),
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
        if read_fault(&self.notifier).is_some() {
            mark_group_faulted(self.group_faulted.as_deref());
        }
        // Objects go before the memory they reference; fields below handle the rest in declaration order.
        self.uvm = None;
        self.debugger = None;
        self.compute = None;
        self.copy = None;
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
        let mut f = read_fault(&self.0.notifier)?;
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

/// Has the graphics engine preempt the group's kernels at instruction level (CILP), as libcuda sets it for each
/// context's group, instead of RM's default, which waits for the running grid to end. With that default, RM ended a
/// grid of 8 s (many short blocks) with a context-switch timeout (Xid 109) 4.3 s after another process began
/// launching; with CILP the grid was switched out and back, finished (8.8 s), and the other process's launches
/// took 2.3 ms each, its turns (H100). Where RM refuses the mode, the group keeps RM's default (logged).
fn set_compute_preemption_cilp(core: &GpuCore, group: &Object) {
    let mut p = sys::NV2080_CTRL_GR_SET_CTXSW_PREEMPTION_MODE_PARAMS {
        flags: sys::NV2080_CTRL_GR_SET_CTXSW_PREEMPTION_MODE_FLAGS_CILP_SET,
        hChannel: group.handle(),
        cilpPreemptMode: sys::NV2080_CTRL_SET_CTXSW_PREEMPTION_MODE_COMPUTE_CILP,
        ..Default::default()
    };
    if let Err(e) = core.subdevice().ctrl(&mut p) {
        warn!(error = %e, "compute preemption at instruction level refused; the channel group keeps RM's default");
    }
}

/// Marks a shared channel group as ended by a fault (RM tears the whole group down), so that no new channel joins it.
fn mark_group_faulted(mark: Option<&AtomicBool>) {
    if let Some(m) = mark {
        m.store(true, Ordering::Release);
    }
}

fn read_fault(notifier: &Memory) -> Option<ChannelFault> {
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

/// Whether the CPU writes memory of `placement` through a write-combined mapping.
pub fn is_write_combined(placement: Placement) -> bool {
    matches!(placement, Placement::Video | Placement::SystemWriteCombined)
}

/// Asks the CPU for the cache line at `p` with write ownership ahead of a store to it (`PREFETCHW`): a line the GPU
/// has read since the CPU last wrote it is shared, and the store would otherwise wait for the ownership request.
/// A hint: it never faults, it does nothing on CPUs that do not report the instruction, and off x86-64.
#[inline(always)]
pub fn prefetch_for_write(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    if write_prefetch_supported() {
        // SAFETY: the CPU reports PREFETCHW (CPUID.80000001H:ECX.PRFCHW), which only hints the cache: it does not
        // access memory architecturally, raises no page or protection fault for any address, and is ignored for
        // memory that is not write-back cacheable.
        unsafe {
            std::arch::asm!("prefetchw [{0}]", in(reg) p, options(nostack, preserves_flags, readonly));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Whether the CPU reports `PREFETCHW` (CPUID.80000001H:ECX bit 8), read once.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn write_prefetch_supported() -> bool {
    use std::sync::atomic::{AtomicU8, Ordering};
    // 0: not read yet, 1: supported, 2: not supported.
    static SUPPORTED: AtomicU8 = AtomicU8::new(0);
    match SUPPORTED.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => {
            // Leaf 0x80000000 gives the highest extended leaf; 0x80000001 is asked only when the CPU has it.
            // SAFETY: CPUID exists on every x86-64 CPU. (`__cpuid` is a safe function on newer toolchains and an
            // unsafe one on the minimum supported Rust version, hence the allowance.)
            #[allow(unused_unsafe)]
            let max = unsafe { std::arch::x86_64::__cpuid(0x8000_0000) }.eax;
            // SAFETY: as above.
            #[allow(unused_unsafe)]
            let ecx = if max >= 0x8000_0001 {
                unsafe { std::arch::x86_64::__cpuid(0x8000_0001) }.ecx
            } else {
                0
            };
            let yes = ecx & (1 << 8) != 0;
            SUPPORTED.store(if yes { 1 } else { 2 }, Ordering::Relaxed);
            yes
        }
    }
}

/// Orders cached stores before the doorbell store: on x86 the CPU keeps stores in program order (write-combined and
/// non-temporal stores excepted), so only the compiler must; elsewhere a full fence.
#[inline(always)]
fn cached_store_order() {
    #[cfg(target_arch = "x86_64")]
    std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
    #[cfg(not(target_arch = "x86_64"))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

/// Orders the write-combined ring and USERD stores before the doorbell store.
#[inline(always)]
fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no preconditions.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
    #[cfg(not(target_arch = "x86_64"))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use super::{Channel, ChannelConfig, prefetch_for_write};
    use crate::rm::GpuCore;
    use crate::rm::sim::SimConfig;
    use crate::rm::sys;

    #[test]
    fn graphics_channel_groups_are_preempted_at_instruction_level() {
        let (core, bus) = GpuCore::open_simulated(SimConfig::default()).unwrap();
        let shared = Channel::new(&core, ChannelConfig::default()).unwrap();
        let joined = Channel::new(&core, ChannelConfig::default()).unwrap();
        let own = Channel::new(
            &core,
            ChannelConfig {
                own_group: true,
                ..ChannelConfig::default()
            },
        )
        .unwrap();
        assert_eq!(shared.handles().0, joined.handles().0);
        // Set once per group founded, as libcuda sets it: RM's default (wait for idle) ends a long grid when
        // another process needs the engine.
        for c in [&shared, &own] {
            assert_eq!(
                bus.lock().compute_preemption(c.handles().0),
                Some(sys::NV2080_CTRL_SET_CTXSW_PREEMPTION_MODE_COMPUTE_CILP)
            );
        }
        // A copy-engine group has no graphics context to preempt: nothing is set for it.
        let lce = (0..crate::rm::MAX_LCES)
            .find(|&l| SimConfig::default().usable_copy_engines() & (1 << l) != 0)
            .unwrap();
        let copy = Channel::new(&core, ChannelConfig::copy_engine(lce)).unwrap();
        assert_eq!(bus.lock().compute_preemption(copy.handles().0), None);
    }

    #[test]
    fn a_write_prefetch_never_faults_and_changes_nothing() {
        let words = [7u32; 64];
        prefetch_for_write(words.as_ptr().cast());
        assert!(words.iter().all(|&w| w == 7));
        // Addresses nothing is mapped at, and a non-canonical one: a hint, never an access.
        for addr in [
            0usize,
            8,
            0xdead_0000,
            usize::MAX - 63,
            0x8000_0000_0000_0000,
        ] {
            prefetch_for_write(addr as *const u8);
        }
    }
}
