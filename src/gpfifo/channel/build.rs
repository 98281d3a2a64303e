//! Building a channel ([`Channel::new`]): its channel group (shared, its own, or CUDA's), subcontext, GPFIFO
//! channel object, engine objects, debugger object, work-submit token and UVM registration, and the memory they
//! are built on.

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tracing::{debug, warn};

use crate::hw::Generation;
use crate::hw::host::c361;
use crate::rm::{
    COPY_ALLOC_VERSION_ENGINE_TYPE, ChannelGroupSchedule, CopyAllocParams, GpuCore, MAX_LCES,
    Memory, MemoryDesc, Object, Placement, copy_engine_type, sys,
};

use super::fault::read_fault;
use super::store_order::is_write_combined;
use super::{Channel, ChannelClasses, ChannelConfig, Error, Result, RingState, Semaphores};

const NOTIFIER_SIZE: u64 = 0x1000;
/// VA that UVM_REGISTER_CHANNEL reserves for the channel's context buffers (libcuda passes the GR context size).
const CHANNEL_VA_SIZE: u64 = 64 << 20;

/// Unregisters the channel from UVM and returns its context VA, before the channel object is freed.
#[derive(Debug)]
pub(super) struct UvmChannel {
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
                .any(|n| n.upgrade().is_some_and(|n| read_fault(&*n).is_some()))
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
            let kept: Arc<dyn crate::rm::NotifierWords> = notifier.clone();
            g.notifiers.push(Arc::downgrade(&kept));
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
}

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
