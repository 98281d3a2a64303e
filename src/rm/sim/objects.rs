//! The simulated RM's registry and its RM_ALLOC and RM_FREE: objects, channel registrations, live allocations.

use std::collections::{BTreeMap, HashMap};
use std::ptr::NonNull;
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use rustix::mm::{MapFlags, ProtFlags, mmap_anonymous, munmap};
use tracing::{debug, warn};

use super::SimConfig;
use crate::hw::generation::{self, Generation};
use crate::rm::gpu::{USERMODE_CLASSES, USERMODE_SIZE};
use crate::rm::transport::Handle;
use crate::rm::{
    COPY_ALLOC_VERSION_ENGINE_TYPE, COPY_ALLOC_VERSION_INSTANCE, CopyAllocParams, Error, NvStatus,
    Result, copy_engine_type, lce_of_engine_type, sys,
};

/// A GPFIFO channel as RM registered it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimChannel {
    /// The channel object's RM handle.
    pub handle: Handle,
    /// The GPFIFO class it was allocated as (`0xc86f` on Hopper).
    pub class: u32,
    /// The work-submit token the simulated RM handed out.
    pub token: u32,
    /// GPU address of the GPFIFO ring.
    pub ring_va: u64,
    /// Entries in the ring (a power of two).
    pub entries: u32,
    /// GPU address of the channel's USERD (GPPut, GPGet).
    pub userd_va: u64,
    /// The error notifier (`NvNotificationRec`) that RM writes when the channel faults.
    pub notifier_va: u64,
    /// The engine its channel group runs on (`NV2080_ENGINE_TYPE_GRAPHICS`, or a copy engine's
    /// `NV2080_ENGINE_TYPE_COPY(n)`).
    pub engine: u32,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Obj {
    pub(super) parent: Handle,
    pub(super) class: u32,
    /// The engine (`NV2080_ENGINE_TYPE_*`) a channel group runs on, or the one a copy object is bound to.
    pub(super) engine: Option<u32>,
}

#[derive(Debug, Default)]
pub(super) struct State {
    next_handle: Handle,
    next_token: u32,
    pub(super) objects: HashMap<Handle, Obj>,
    /// Live allocations by VA: (size, memory handle).
    pub(super) allocations: BTreeMap<u64, (u64, Handle)>,
    pub(super) va_of: HashMap<Handle, u64>,
    pub(super) channels: BTreeMap<Handle, SimChannel>,
    /// The last performance boost asked of the subdevice: `(flags, duration)` of `NV2080_CTRL_CMD_PERF_BOOST`.
    pub(super) perf_boost: Option<(u32, u32)>,
    /// Whether the last usermode object was asked for through BAR1 (`bBar1Mapping`); `None` before one is.
    pub(super) usermode_bar1: Option<bool>,
    /// The compute preemption mode set on each channel group (`NV2080_CTRL_SET_CTXSW_PREEMPTION_MODE_COMPUTE_*`).
    pub(super) compute_preemption: HashMap<Handle, u32>,
}

impl State {
    /// The live allocation holding all of `[va, va + len)`.
    pub(super) fn holds(&self, va: u64, len: u64) -> bool {
        let Some(end) = va.checked_add(len) else {
            return false;
        };
        self.allocations
            .range(..=va)
            .next_back()
            .is_some_and(|(&base, &(size, _))| end <= base + size)
    }

    pub(super) fn new_handle(&mut self) -> Handle {
        self.next_handle += 1;
        self.next_handle
    }
}

/// The simulated RM: the transport of a simulated GPU's client, and the state its front end reads.
#[derive(Debug)]
pub(crate) struct SimShared {
    state: Mutex<State>,
    pub(super) config: SimConfig,
    pub(super) classes: Vec<u32>,
    pub(super) usermode: NonNull<u8>,
    pub(super) start: Instant,
    /// Distinguishes the simulated GPUs of one process.
    pub(super) id: u64,
}

// SAFETY: `usermode` is an anonymous mapping owned by this struct; it is only accessed through atomics.
unsafe impl Send for SimShared {}
// SAFETY: as above; everything else is behind the mutex.
unsafe impl Sync for SimShared {}

impl Drop for SimShared {
    fn drop(&mut self) {
        // SAFETY: the mapping was created in `new` with this length and nobody else unmaps it.
        if let Err(e) = unsafe { munmap(self.usermode.as_ptr().cast(), USERMODE_SIZE) } {
            warn!(error = %e, "unmapping the simulated usermode page failed");
        }
    }
}

const NV_ERR_INSUFFICIENT_PERMISSIONS: NvStatus = NvStatus(sys::NV_ERR_INSUFFICIENT_PERMISSIONS);
pub(super) const NV_ERR_INVALID_ARGUMENT: NvStatus = NvStatus(sys::NV_ERR_INVALID_ARGUMENT);
pub(super) const NV_ERR_INVALID_CHANNEL: NvStatus = NvStatus(sys::NV_ERR_INVALID_CHANNEL);
pub(super) const NV_ERR_INVALID_CLASS: NvStatus = NvStatus(sys::NV_ERR_INVALID_CLASS);
pub(super) const NV_ERR_INVALID_OBJECT_HANDLE: NvStatus =
    NvStatus(sys::NV_ERR_INVALID_OBJECT_HANDLE);
const NV_ERR_INVALID_PARAM_STRUCT: NvStatus = NvStatus(sys::NV_ERR_INVALID_PARAM_STRUCT);
const NV_ERR_INVALID_PARAMETER: NvStatus = NvStatus(sys::NV_ERR_INVALID_PARAMETER);
pub(super) const NV_ERR_INVALID_STATE: NvStatus = NvStatus(sys::NV_ERR_INVALID_STATE);

/// Whether RM registers a channel for `class`: a GPFIFO (host) class of the GPU-generation table.
pub(super) fn is_gpfifo_class(class: u32) -> bool {
    generation::gpfifo_classes().any(|c| c == class)
}

/// Whether `class` is a copy-engine class of the GPU-generation table.
pub(super) fn is_copy_class(class: u32) -> bool {
    generation::copy_classes().any(|c| c == class)
}
pub(super) const NV_ERR_NOT_SUPPORTED: NvStatus = NvStatus(sys::NV_ERR_NOT_SUPPORTED);

/// The caller's parameter struct as a `T`, if it has `T`'s size and alignment.
///
/// # Safety
/// `ptr` is null or points to `size` bytes that the caller lends exclusively for the call (the contract of an
/// RM alloc or control: the parameter struct belongs to the class or command).
pub(super) unsafe fn params<'a, T>(
    ptr: *mut u8,
    size: usize,
) -> std::result::Result<&'a mut T, NvStatus> {
    if ptr.is_null() || size != size_of::<T>() || !ptr.cast::<T>().is_aligned() {
        return Err(NV_ERR_INVALID_PARAM_STRUCT);
    }
    // SAFETY: non-null, aligned and of T's size (checked above), exclusively lent (the caller's contract);
    // every T used here is a plain-old-data bindgen struct, valid for any bit pattern.
    Ok(unsafe { &mut *ptr.cast::<T>() })
}

static NEXT_SIM_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl SimShared {
    pub(crate) fn new(config: SimConfig) -> Result<SimShared> {
        // SAFETY: a fresh anonymous mapping at a kernel-chosen address.
        let page = unsafe {
            mmap_anonymous(
                std::ptr::null_mut(),
                USERMODE_SIZE,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
            )
        }
        .map_err(|e| Error::Mmap {
            what: "simulated usermode page",
            source: e.into(),
        })?;
        let usermode = NonNull::new(page.cast::<u8>()).ok_or(Error::Mmap {
            what: "simulated usermode page",
            source: std::io::Error::other("mmap returned null"),
        })?;
        let mut classes = vec![
            sys::NV01_ROOT_CLIENT,
            sys::NV01_DEVICE_0,
            sys::NV20_SUBDEVICE_0,
            sys::NV01_MEMORY_SYSTEM,
            sys::NV01_MEMORY_LOCAL_USER,
            sys::FERMI_VASPACE_A,
            sys::FERMI_CONTEXT_SHARE_A,
            sys::KEPLER_CHANNEL_GROUP_A,
            sys::HOPPER_USERMODE_A,
        ];
        // The engine classes of the simulated GPU's generation (Hopper's by default); none for an SM version
        // without a row, so its channels are refused as on a GPU APEX does not know.
        if let Some(c) = Generation::for_sm(config.sm_version).and_then(|g| g.classes) {
            classes.extend([c.gpfifo, c.compute, c.copy]);
        }
        Ok(SimShared {
            state: Mutex::new(State {
                next_handle: 0xcaf0_0000,
                next_token: 0x20,
                ..State::default()
            }),
            config,
            classes,
            usermode,
            start: Instant::now(),
            id: NEXT_SIM_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        })
    }

    /// Which simulated GPU of the process this is.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// RM_ALLOC of `class` under `parent`; `ptr`/`size` are the caller's allocation parameters (or null).
    pub(super) fn alloc_object(
        &self,
        parent: Handle,
        class: u32,
        ptr: *mut u8,
        size: usize,
    ) -> std::result::Result<Handle, NvStatus> {
        let mut st = self.lock();
        let parent_obj = *st
            .objects
            .get(&parent)
            .ok_or(NV_ERR_INVALID_OBJECT_HANDLE)?;
        if !self.classes.contains(&class) {
            return Err(NV_ERR_INVALID_CLASS);
        }
        let handle = st.new_handle();
        let in_group = parent_obj.class == sys::KEPLER_CHANNEL_GROUP_A;
        let mut engine = None;
        if class == sys::KEPLER_CHANNEL_GROUP_A {
            // SAFETY: a channel group's parameters are NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS (checked by size),
            // lent by the caller.
            let p = unsafe { params::<sys::NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS>(ptr, size)? };
            engine = Some(match p.engineType {
                sys::NV2080_ENGINE_TYPE_NULL | sys::NV2080_ENGINE_TYPE_GRAPHICS => {
                    sys::NV2080_ENGINE_TYPE_GRAPHICS
                }
                t if lce_of_engine_type(t).is_some() => t,
                _ => return Err(NV_ERR_INVALID_ARGUMENT),
            });
        } else if class == sys::FERMI_CONTEXT_SHARE_A {
            // Subcontexts are a graphics-engine feature: RM refuses one in a copy-engine group.
            if !in_group || parent_obj.engine.and_then(lce_of_engine_type).is_some() {
                return Err(NV_ERR_INVALID_ARGUMENT);
            }
        } else if is_gpfifo_class(class) {
            // SAFETY: a GPFIFO class's parameters are NV_CHANNEL_ALLOC_PARAMS (checked by size), lent by the caller.
            let p = unsafe { params::<sys::NV_CHANNEL_ALLOC_PARAMS>(ptr, size)? };
            // A channel in a group takes its VA space from the group or its context share, never by itself.
            if in_group && p.hVASpace != 0 {
                return Err(NV_ERR_INVALID_ARGUMENT);
            }
            let engine = parent_obj
                .engine
                .filter(|_| in_group)
                .unwrap_or(sys::NV2080_ENGINE_TYPE_GRAPHICS);
            let channel = register_channel(&mut st, handle, class, engine, p)?;
            debug!(?channel, "simulated GPFIFO channel registered");
            st.channels.insert(handle, channel);
        } else if USERMODE_CLASSES.contains(&class) {
            // As RM's usrmodeConstruct: Hopper and later classes take optional NV_HOPPER_USERMODE_A_PARAMS; the
            // privileged page needs the BAR1 mapping and a kernel caller.
            let bar1 = if class >= sys::HOPPER_USERMODE_A && !ptr.is_null() {
                // SAFETY: a Hopper usermode class's parameters are NV_HOPPER_USERMODE_A_PARAMS (checked by size),
                // lent by the caller.
                let p = unsafe { params::<sys::NV_HOPPER_USERMODE_A_PARAMS>(ptr, size)? };
                if p.bPriv != 0 {
                    return Err(if p.bBar1Mapping == 0 {
                        NV_ERR_INVALID_PARAMETER
                    } else {
                        NV_ERR_INSUFFICIENT_PERMISSIONS
                    });
                }
                p.bBar1Mapping != 0
            } else {
                false
            };
            st.usermode_bar1 = Some(bar1);
        } else if is_copy_class(class) {
            if !is_gpfifo_class(parent_obj.class) {
                return Err(NV_ERR_INVALID_OBJECT_HANDLE);
            }
            let lce = copy_object_lce(ptr, size)?;
            if lce >= 32 || self.config.copy_engines & (1 << lce) == 0 {
                return Err(NV_ERR_INVALID_ARGUMENT);
            }
            engine = copy_engine_type(lce);
        }
        st.objects.insert(
            handle,
            Obj {
                parent,
                class,
                engine,
            },
        );
        Ok(handle)
    }

    /// RM_FREE of `handle` and everything under it.
    pub(super) fn free_object(&self, handle: Handle) -> NvStatus {
        let mut st = self.lock();
        if !st.objects.contains_key(&handle) {
            return NV_ERR_INVALID_OBJECT_HANDLE;
        }
        let mut doomed = vec![handle];
        let mut i = 0;
        while let Some(&h) = doomed.get(i) {
            doomed.extend(
                st.objects
                    .iter()
                    .filter(|(_, o)| o.parent == h)
                    .map(|(&c, _)| c),
            );
            i += 1;
        }
        for h in doomed {
            st.objects.remove(&h);
            st.channels.remove(&h);
            st.compute_preemption.remove(&h);
            // A buffer whose memory object goes is no longer reachable by the GPU.
            if let Some(va) = st.va_of.remove(&h) {
                st.allocations.remove(&va);
            }
        }
        NvStatus::OK
    }
}

/// The LCE a copy object's allocation parameters bind it to, as RM reads `NVB0B5_ALLOCATION_PARAMETERS`: none
/// is CE 0; version 0 names a CE instance, version 1 an `NV2080_ENGINE_TYPE_COPY(n)`.
fn copy_object_lce(ptr: *mut u8, size: usize) -> std::result::Result<u32, NvStatus> {
    if ptr.is_null() {
        return Ok(0);
    }
    // SAFETY: a copy class's parameters are NVB0B5_ALLOCATION_PARAMETERS (checked by size), lent by the caller.
    let p = unsafe { params::<CopyAllocParams>(ptr, size)? };
    match p.version {
        COPY_ALLOC_VERSION_INSTANCE => Ok(p.engine_type),
        COPY_ALLOC_VERSION_ENGINE_TYPE => {
            lce_of_engine_type(p.engine_type).ok_or(NV_ERR_INVALID_ARGUMENT)
        }
        _ => Err(NV_ERR_INVALID_ARGUMENT),
    }
}

/// Checks a GPFIFO allocation the way RM does and records where its ring, USERD and notifier are.
fn register_channel(
    st: &mut State,
    handle: Handle,
    class: u32,
    engine: u32,
    p: &sys::NV_CHANNEL_ALLOC_PARAMS,
) -> std::result::Result<SimChannel, NvStatus> {
    let entries = p.gpFifoEntries;
    if !entries.is_power_of_two() || entries < 2 {
        return Err(NV_ERR_INVALID_ARGUMENT);
    }
    let userd_base = *st
        .va_of
        .get(&p.hUserdMemory[0])
        .ok_or(NV_ERR_INVALID_OBJECT_HANDLE)?;
    let notifier_va = *st
        .va_of
        .get(&p.hObjectError)
        .ok_or(NV_ERR_INVALID_OBJECT_HANDLE)?;
    let userd_va = userd_base
        .checked_add(p.userdOffset[0])
        .ok_or(NV_ERR_INVALID_ARGUMENT)?;
    let notifier_len = size_of::<sys::NvNotificationRec>() as u64;
    if !st.holds(p.gpFifoOffset, u64::from(entries) * 8)
        || !st.holds(userd_va, 0x200)
        || !st.holds(notifier_va, notifier_len)
        || !p.gpFifoOffset.is_multiple_of(8)
        || !userd_va.is_multiple_of(8)
    {
        return Err(NV_ERR_INVALID_ARGUMENT);
    }
    let token = st.next_token;
    st.next_token += 1;
    Ok(SimChannel {
        handle,
        class,
        token,
        ring_va: p.gpFifoOffset,
        entries,
        userd_va,
        notifier_va,
        engine,
    })
}
