//! A simulated RM, for CI without a GPU: the same [`GpuCore`], [`Memory`](super::Memory) and channel code as on
//! hardware, with only the driver boundary replaced.
//!
//! - RM allocs, controls and frees are answered in process: handles are handed out, the controls APEX issues
//!   (class list, GPU info of an H200, work-submit token, scheduling) are answered like RM answers them, and every
//!   GPFIFO channel allocation is registered from the `NV_CHANNEL_ALLOC_PARAMS` it was given.
//! - Memory is anonymous shared memory mapped at its GPU VA inside our VA reservation (VA == CPU address, as
//!   through UVM on hardware). UVM calls do nothing.
//! - The usermode (doorbell) page is 64 KiB of anonymous memory.
//!
//! [`SimBus`] is the front end's view: channel registrations, the doorbell word, and memory access by GPU VA,
//! each access checked against the registry of live allocations. The registry lock is held while the front end
//! touches memory, and a buffer is unregistered (under that lock) before it is unmapped, so the front end never
//! touches memory that is gone: a bad address is an [`AccessError`], never a segfault.

use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use rustix::mm::{MapFlags, ProtFlags, mmap_anonymous, munmap};
use tracing::{debug, info, warn};

use super::client::{Client, Object};
use super::domain::SIMULATED_DOMAIN;
use super::error::check;
use super::gpu::{GpuCore, HEADERS_BRANCH, USERMODE_CLASSES, USERMODE_SIZE, gpu_info};
use super::mapping::CpuMapping;
use super::transport::{CpuMapRequest, Handle, InProcessGpu, Transport};
use super::{
    COPY_ALLOC_VERSION_ENGINE_TYPE, COPY_ALLOC_VERSION_INSTANCE, CopyAllocParams, Error, NvStatus,
    Result, copy_engine_type, lce_of_engine_type, sys,
};
use crate::hw::generation::{self, Generation};
use crate::hw::host;

/// The GPU a simulated RM describes. The default is an H200: sm_90, 8 GPCs, 66 TPCs, 132 SMs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimConfig {
    /// The name the simulated RM reports.
    pub name: String,
    /// The UUID's 16 bytes; give each simulated GPU of one process its own, so they can be told apart.
    pub uuid: [u8; 16],
    /// SM version as major * 10 + minor.
    pub sm_version: u32,
    /// TPCs of each GPC (the GPC count is the length).
    pub tpcs_per_gpc: Vec<u32>,
    /// SMs in each TPC.
    pub sms_per_tpc: u32,
    /// The most warps an SM holds at once.
    pub max_warps_per_sm: u32,
    /// Video memory the simulated RM reports, bytes (nothing is reserved for it).
    pub memory_bytes: u64,
    /// The logical copy engines the GPU has (bit `n`: LCE `n`). A copy object bound to any other is refused
    /// (`NV_ERR_INVALID_ARGUMENT`), as RM refuses an absent engine.
    pub copy_engines: u32,
    /// Of `copy_engines`, those on the graphics engine's runlist (GRCEs): a copy-engine channel group on one of
    /// them is refused at `GPFIFO_SCHEDULE` (`NV_ERR_INVALID_STATE`), as an H100 refuses LCEs 0 and 1.
    pub graphics_copy_engines: u32,
    /// The LCEs RM names optimal for this GPU reading a peer's memory (`p2pOptimalReadCEs`).
    pub peer_read_ces: u32,
    /// The LCEs RM names optimal for this GPU writing a peer's memory (`p2pOptimalWriteCEs`).
    pub peer_write_ces: u32,
    /// Whether the GPU is in the process's simulated peer domain, an NVLink peer of the other simulated GPUs
    /// there. `false` models a GPU opened alone: an address space of its own, no peer path.
    pub peer: bool,
    /// Doorbells the GPU misses: the first this many of each channel are ignored. With any, the front end fetches
    /// only up to the GP_PUT it read at the last doorbell it saw, as hardware does (otherwise it polls GP_PUT),
    /// so work published under a missed doorbell waits for the next one.
    pub lost_doorbells: u32,
}

impl Default for SimConfig {
    fn default() -> SimConfig {
        SimConfig {
            name: "APEX simulated Hopper".into(),
            uuid: *b"APEX-simulated-0",
            sm_version: 90,
            // 66 TPCs over 8 GPCs, as on the H200 (two GPCs with 9, six with 8).
            tpcs_per_gpc: vec![9, 9, 8, 8, 8, 8, 8, 8],
            sms_per_tpc: 2,
            max_warps_per_sm: 64,
            memory_bytes: 141 << 30,
            // LCEs 0-4: 0 and 1 on the graphics runlist (as on an H100), 2-4 usable for copy-only channels.
            copy_engines: 0b1_1111,
            graphics_copy_engines: 0b11,
            peer_read_ces: 0b1_0000,
            peer_write_ces: 0b1100,
            peer: true,
            lost_doorbells: 0,
        }
    }
}

impl SimConfig {
    /// TPCs over all GPCs.
    pub fn tpc_count(&self) -> u32 {
        self.tpcs_per_gpc.iter().sum()
    }

    /// SMs over all GPCs.
    pub fn sm_count(&self) -> u32 {
        self.tpc_count() * self.sms_per_tpc
    }

    /// The LCEs a copy-only channel group can be scheduled on: present and not on the graphics runlist.
    pub fn usable_copy_engines(&self) -> u32 {
        self.copy_engines & !self.graphics_copy_engines
    }
}

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

/// Why the front end could not access memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    /// The range is not inside one live allocation (never allocated, freed, or running past its end).
    #[error("{len:#x} bytes at {va:#x} are not inside one live allocation")]
    Unmapped {
        /// GPU address of the access.
        va: u64,
        /// Bytes accessed.
        len: u64,
    },
    /// A word access at an address that is not a multiple of its size.
    #[error("{len}-byte access at {va:#x} is not naturally aligned")]
    Misaligned {
        /// GPU address of the access.
        va: u64,
        /// Bytes accessed.
        len: u64,
    },
}

#[derive(Clone, Copy, Debug)]
struct Obj {
    parent: Handle,
    class: u32,
    /// The engine (`NV2080_ENGINE_TYPE_*`) a channel group runs on, or the one a copy object is bound to.
    engine: Option<u32>,
}

#[derive(Debug, Default)]
struct State {
    next_handle: Handle,
    next_token: u32,
    objects: HashMap<Handle, Obj>,
    /// Live allocations by VA: (size, memory handle).
    allocations: BTreeMap<u64, (u64, Handle)>,
    va_of: HashMap<Handle, u64>,
    channels: BTreeMap<Handle, SimChannel>,
    /// The last performance boost asked of the subdevice: `(flags, duration)` of `NV2080_CTRL_CMD_PERF_BOOST`.
    perf_boost: Option<(u32, u32)>,
    /// Whether the last usermode object was asked for through BAR1 (`bBar1Mapping`); `None` before one is.
    usermode_bar1: Option<bool>,
    /// The compute preemption mode set on each channel group (`NV2080_CTRL_SET_CTXSW_PREEMPTION_MODE_COMPUTE_*`).
    compute_preemption: HashMap<Handle, u32>,
}

impl State {
    /// The live allocation holding all of `[va, va + len)`.
    fn holds(&self, va: u64, len: u64) -> bool {
        let Some(end) = va.checked_add(len) else {
            return false;
        };
        self.allocations
            .range(..=va)
            .next_back()
            .is_some_and(|(&base, &(size, _))| end <= base + size)
    }

    fn new_handle(&mut self) -> Handle {
        self.next_handle += 1;
        self.next_handle
    }
}

/// The simulated RM: the transport of a simulated GPU's client, and the state its front end reads.
#[derive(Debug)]
pub(crate) struct SimShared {
    state: Mutex<State>,
    config: SimConfig,
    classes: Vec<u32>,
    usermode: NonNull<u8>,
    start: Instant,
    /// Distinguishes the simulated GPUs of one process.
    id: u64,
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
const NV_ERR_INVALID_ARGUMENT: NvStatus = NvStatus(sys::NV_ERR_INVALID_ARGUMENT);
const NV_ERR_INVALID_CHANNEL: NvStatus = NvStatus(sys::NV_ERR_INVALID_CHANNEL);
const NV_ERR_INVALID_CLASS: NvStatus = NvStatus(sys::NV_ERR_INVALID_CLASS);
const NV_ERR_INVALID_OBJECT_HANDLE: NvStatus = NvStatus(sys::NV_ERR_INVALID_OBJECT_HANDLE);
const NV_ERR_INVALID_PARAM_STRUCT: NvStatus = NvStatus(sys::NV_ERR_INVALID_PARAM_STRUCT);
const NV_ERR_INVALID_PARAMETER: NvStatus = NvStatus(sys::NV_ERR_INVALID_PARAMETER);
const NV_ERR_INVALID_STATE: NvStatus = NvStatus(sys::NV_ERR_INVALID_STATE);

/// Whether RM registers a channel for `class`: a GPFIFO (host) class of the GPU-generation table.
fn is_gpfifo_class(class: u32) -> bool {
    generation::gpfifo_classes().any(|c| c == class)
}

/// Whether `class` is a copy-engine class of the GPU-generation table.
fn is_copy_class(class: u32) -> bool {
    generation::copy_classes().any(|c| c == class)
}

/// RM GPU ids of simulated GPUs: this prefix and the simulated GPU's number (RM's own ids are small numbers).
const SIM_GPU_ID_BASE: u32 = 0x5100_0000;

/// The RM GPU id of simulated GPU `id`.
fn sim_gpu_id(id: u64) -> u32 {
    SIM_GPU_ID_BASE | (id as u32 & 0xff_ffff)
}

/// Whether `gpu_id` names a simulated GPU.
fn is_sim_gpu_id(gpu_id: u32) -> bool {
    gpu_id & 0xff00_0000 == SIM_GPU_ID_BASE
}
const NV_ERR_NOT_SUPPORTED: NvStatus = NvStatus(sys::NV_ERR_NOT_SUPPORTED);

/// The caller's parameter struct as a `T`, if it has `T`'s size and alignment.
///
/// # Safety
/// `ptr` is null or points to `size` bytes that the caller lends exclusively for the call (the contract of an
/// RM alloc or control: the parameter struct belongs to the class or command).
unsafe fn params<'a, T>(ptr: *mut u8, size: usize) -> std::result::Result<&'a mut T, NvStatus> {
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

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// RM_ALLOC of `class` under `parent`; `ptr`/`size` are the caller's allocation parameters (or null).
    fn alloc_object(
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

    /// RM_CONTROL `cmd` on `object`, answering the controls APEX issues.
    fn answer_control(
        &self,
        object: Handle,
        cmd: u32,
        ptr: *mut u8,
        size: usize,
    ) -> std::result::Result<(), NvStatus> {
        let mut st = self.lock();
        let obj = *st
            .objects
            .get(&object)
            .ok_or(NV_ERR_INVALID_OBJECT_HANDLE)?;
        let c = &self.config;
        // SAFETY (every `params` below): `ptr`/`size` are the parameter struct of `cmd`, lent by the caller.
        match cmd {
            sys::NV0080_CTRL_CMD_GPU_GET_CLASSLIST_V2 => {
                let p =
                    unsafe { params::<sys::NV0080_CTRL_GPU_GET_CLASSLIST_V2_PARAMS>(ptr, size)? };
                let n = self.classes.len().min(p.classList.len());
                p.classList[..n].copy_from_slice(&self.classes[..n]);
                p.numClasses = n as u32;
            }
            sys::NV2080_CTRL_CMD_GPU_GET_NAME_STRING => {
                let p =
                    unsafe { params::<sys::NV2080_CTRL_GPU_GET_NAME_STRING_PARAMS>(ptr, size)? };
                let mut ascii = [0u8; 64];
                let n = c.name.len().min(ascii.len() - 1);
                ascii[..n].copy_from_slice(&c.name.as_bytes()[..n]);
                p.gpuNameString.ascii = ascii;
            }
            sys::NV2080_CTRL_CMD_GPU_GET_GID_INFO => {
                let p = unsafe { params::<sys::NV2080_CTRL_GPU_GET_GID_INFO_PARAMS>(ptr, size)? };
                p.data[..16].copy_from_slice(&c.uuid);
                p.length = 16;
            }
            sys::NV2080_CTRL_CMD_GPU_GET_ENGINES_V2 => {
                let p = unsafe { params::<sys::NV2080_CTRL_GPU_GET_ENGINES_V2_PARAMS>(ptr, size)? };
                // The graphics engine and the present LCEs.
                let mut n = 0;
                p.engineList[n] = sys::NV2080_ENGINE_TYPE_GRAPHICS;
                n += 1;
                for lce in (0..32u32).filter(|l| c.copy_engines & (1 << l) != 0) {
                    if let Some(t) = super::engine::copy_engine_type(lce)
                        && n < p.engineList.len()
                    {
                        p.engineList[n] = t;
                        n += 1;
                    }
                }
                p.engineCount = n as u32;
            }
            super::control::NV2080_CTRL_CMD_CE_GET_CE_PCE_MASK => {
                let p = unsafe { params::<super::control::CePceMaskParams>(ptr, size)? };
                // One PCE for each present LCE (the PCE of the same index): equal shares of a split copy.
                let lce = super::engine::lce_of_engine_type(p.ce_engine_type)
                    .filter(|l| *l < 32 && c.copy_engines & (1 << l) != 0)
                    .ok_or(NV_ERR_INVALID_ARGUMENT)?;
                p.pce_mask = 1 << lce;
            }
            sys::NV2080_CTRL_CMD_GR_GET_INFO => {
                let p = unsafe { params::<sys::NV2080_CTRL_GR_GET_INFO_PARAMS>(ptr, size)? };
                let n = p.grInfoListSize as usize;
                let list = p.grInfoList.cast::<sys::NV2080_CTRL_GR_INFO>();
                if list.is_null() || n > 256 || !list.is_aligned() {
                    return Err(NV_ERR_INVALID_ARGUMENT);
                }
                // SAFETY: as RM requires, grInfoList points to grInfoListSize entries the caller owns.
                let list = unsafe { std::slice::from_raw_parts_mut(list, n) };
                for e in list {
                    e.data = match e.index {
                        // RM's 0xMMmm encoding.
                        sys::NV2080_CTRL_GR_INFO_INDEX_SM_VERSION => {
                            ((c.sm_version / 10) << 8) | (c.sm_version % 10)
                        }
                        sys::NV2080_CTRL_GR_INFO_INDEX_MAX_WARPS_PER_SM => c.max_warps_per_sm,
                        sys::NV2080_CTRL_GR_INFO_INDEX_LITTER_NUM_TPC_PER_GPC => {
                            c.tpcs_per_gpc.iter().copied().max().unwrap_or(0)
                        }
                        sys::NV2080_CTRL_GR_INFO_INDEX_LITTER_NUM_SM_PER_TPC => c.sms_per_tpc,
                        _ => return Err(NV_ERR_NOT_SUPPORTED),
                    };
                }
            }
            sys::NV2080_CTRL_CMD_GR_GET_GPC_MASK => {
                let p = unsafe { params::<sys::NV2080_CTRL_GR_GET_GPC_MASK_PARAMS>(ptr, size)? };
                p.gpcMask = mask(c.tpcs_per_gpc.len() as u32);
            }
            sys::NV2080_CTRL_CMD_GR_GET_TPC_MASK => {
                let p = unsafe { params::<sys::NV2080_CTRL_GR_GET_TPC_MASK_PARAMS>(ptr, size)? };
                let tpcs = c
                    .tpcs_per_gpc
                    .get(p.gpcId as usize)
                    .ok_or(NV_ERR_INVALID_ARGUMENT)?;
                p.tpcMask = mask(*tpcs);
            }
            sys::NV2080_CTRL_CMD_FB_GET_INFO_V2 => {
                let p = unsafe { params::<sys::NV2080_CTRL_FB_GET_INFO_V2_PARAMS>(ptr, size)? };
                let n = (p.fbInfoListSize as usize).min(p.fbInfoList.len());
                for e in &mut p.fbInfoList[..n] {
                    e.data = match e.index {
                        sys::NV2080_CTRL_FB_INFO_INDEX_TOTAL_RAM_SIZE => (c.memory_bytes >> 10)
                            .try_into()
                            .map_err(|_| NV_ERR_INVALID_ARGUMENT)?,
                        _ => return Err(NV_ERR_NOT_SUPPORTED),
                    };
                }
            }
            sys::NVC36F_CTRL_CMD_GPFIFO_GET_WORK_SUBMIT_TOKEN => {
                let ch = st
                    .channels
                    .get(&object)
                    .ok_or(NV_ERR_INVALID_OBJECT_HANDLE)?;
                let p = unsafe {
                    params::<sys::NVC36F_CTRL_CMD_GPFIFO_GET_WORK_SUBMIT_TOKEN_PARAMS>(ptr, size)?
                };
                p.workSubmitToken = ch.token;
            }
            sys::NVA06F_CTRL_CMD_GPFIFO_SCHEDULE => {
                // A channel scheduled by itself: one that joined a group already scheduled.
                if !is_gpfifo_class(obj.class) {
                    return Err(NV_ERR_INVALID_OBJECT_HANDLE);
                }
                let p = unsafe { params::<sys::NVA06F_CTRL_GPFIFO_SCHEDULE_PARAMS>(ptr, size)? };
                let group = *st
                    .objects
                    .get(&obj.parent)
                    .ok_or(NV_ERR_INVALID_OBJECT_HANDLE)?;
                if p.bEnable != 0 && group.class == sys::KEPLER_CHANNEL_GROUP_A {
                    self.check_schedulable(&st, obj.parent, group)?;
                }
            }
            sys::NVA06C_CTRL_CMD_GPFIFO_SCHEDULE => {
                if obj.class != sys::KEPLER_CHANNEL_GROUP_A {
                    return Err(NV_ERR_INVALID_OBJECT_HANDLE);
                }
                let p = unsafe { params::<sys::NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS>(ptr, size)? };
                if p.bEnable != 0 {
                    self.check_schedulable(&st, object, obj)?;
                }
            }
            sys::NV2080_CTRL_CMD_GR_SET_CTXSW_PREEMPTION_MODE => {
                if obj.class != sys::NV20_SUBDEVICE_0 {
                    return Err(NV_ERR_INVALID_OBJECT_HANDLE);
                }
                let p = unsafe {
                    params::<sys::NV2080_CTRL_GR_SET_CTXSW_PREEMPTION_MODE_PARAMS>(ptr, size)?
                };
                // RM sets the modes of a graphics-engine group, each within its range.
                let target = st
                    .objects
                    .get(&p.hChannel)
                    .ok_or(NV_ERR_INVALID_OBJECT_HANDLE)?;
                if target.class != sys::KEPLER_CHANNEL_GROUP_A
                    || target.engine != Some(sys::NV2080_ENGINE_TYPE_GRAPHICS)
                {
                    return Err(NV_ERR_INVALID_CHANNEL);
                }
                let cilp = p.flags & 1 != 0;
                let gfxp = p.flags & 2 != 0;
                if (cilp
                    && p.cilpPreemptMode > sys::NV2080_CTRL_SET_CTXSW_PREEMPTION_MODE_COMPUTE_CILP)
                    || (gfxp
                        && p.gfxpPreemptMode
                            > sys::NV2080_CTRL_SET_CTXSW_PREEMPTION_MODE_GFX_GFXP_POOL)
                {
                    return Err(NV_ERR_INVALID_ARGUMENT);
                }
                if cilp {
                    st.compute_preemption.insert(p.hChannel, p.cilpPreemptMode);
                }
            }
            sys::NV2080_CTRL_CMD_PERF_BOOST => {
                if obj.class != sys::NV20_SUBDEVICE_0 {
                    return Err(NV_ERR_INVALID_OBJECT_HANDLE);
                }
                let p = unsafe { params::<sys::NV2080_CTRL_PERF_BOOST_PARAMS>(ptr, size)? };
                // RM's checks: a command it knows (bits 1:0), a duration up to an hour or "until cleared".
                let known_cmd = p.flags & 0x3 <= sys::NV2080_CTRL_PERF_BOOST_FLAGS_CMD_BOOST_TO_MAX;
                let duration_ok = p.duration <= sys::NV2080_CTRL_PERF_BOOST_DURATION_MAX
                    || p.duration == sys::NV2080_CTRL_PERF_BOOST_DURATION_INFINITE;
                if !known_cmd || !duration_ok {
                    return Err(NV_ERR_INVALID_ARGUMENT);
                }
                st.perf_boost = Some((p.flags, p.duration));
            }
            sys::NV0000_CTRL_CMD_SYSTEM_GET_P2P_CAPS_V2 => {
                if obj.class != sys::NV01_ROOT_CLIENT {
                    return Err(NV_ERR_INVALID_OBJECT_HANDLE);
                }
                let p =
                    unsafe { params::<sys::NV0000_CTRL_SYSTEM_GET_P2P_CAPS_V2_PARAMS>(ptr, size)? };
                self.answer_p2p_caps(p)?;
            }
            _ => return Err(NV_ERR_NOT_SUPPORTED),
        }
        Ok(())
    }

    /// What RM checks before it schedules channel group `group`: a copy-engine group runs on a copy engine's own
    /// runlist (not one it shares with the graphics engine), and every copy object of its channels is bound to
    /// the group's engine (otherwise RM finds the channels on two runlists: `NV_ERR_INVALID_STATE`).
    fn check_schedulable(
        &self,
        st: &State,
        group: Handle,
        obj: Obj,
    ) -> std::result::Result<(), NvStatus> {
        let Some(engine) = obj.engine else {
            return Err(NV_ERR_INVALID_STATE);
        };
        let Some(lce) = lce_of_engine_type(engine) else {
            return Ok(());
        };
        if lce >= 32 || self.config.graphics_copy_engines & (1 << lce) != 0 {
            return Err(NV_ERR_INVALID_STATE);
        }
        let channels: Vec<Handle> = st
            .objects
            .iter()
            .filter(|(_, o)| o.parent == group && is_gpfifo_class(o.class))
            .map(|(&h, _)| h)
            .collect();
        let mismatch = st.objects.values().any(|o| {
            channels.contains(&o.parent) && is_copy_class(o.class) && o.engine != Some(engine)
        });
        if mismatch {
            return Err(NV_ERR_INVALID_STATE);
        }
        Ok(())
    }

    /// NV0000_CTRL_CMD_SYSTEM_GET_P2P_CAPS_V2 for two simulated GPUs: NVLink peers with reads, writes and
    /// atomics, and this GPU's optimal copy engines; any other pair has no peer path.
    fn answer_p2p_caps(
        &self,
        p: &mut sys::NV0000_CTRL_SYSTEM_GET_P2P_CAPS_V2_PARAMS,
    ) -> std::result::Result<(), NvStatus> {
        if p.gpuCount != 2 {
            return Err(NV_ERR_INVALID_ARGUMENT);
        }
        let (a, b) = (p.gpuIds[0], p.gpuIds[1]);
        if a != sim_gpu_id(self.id) {
            return Err(NV_ERR_INVALID_ARGUMENT);
        }
        if is_sim_gpu_id(b) && self.config.peer {
            p.p2pCaps = [
                sys::NV0000_CTRL_SYSTEM_GET_P2P_CAPS_NVLINK_SUPPORTED,
                sys::NV0000_CTRL_SYSTEM_GET_P2P_CAPS_READS_SUPPORTED,
                sys::NV0000_CTRL_SYSTEM_GET_P2P_CAPS_WRITES_SUPPORTED,
                sys::NV0000_CTRL_SYSTEM_GET_P2P_CAPS_ATOMICS_SUPPORTED,
            ]
            .iter()
            .fold(0, |caps, bit| caps | (1 << bit));
            p.p2pCapsStatus.fill(0);
            p.p2pOptimalReadCEs = self.config.peer_read_ces;
            p.p2pOptimalWriteCEs = self.config.peer_write_ces;
        } else {
            p.p2pCaps = 0;
            // NV0000_P2P_CAPS_STATUS_NOT_SUPPORTED
            p.p2pCapsStatus.fill(5);
            p.p2pOptimalReadCEs = 0;
            p.p2pOptimalWriteCEs = 0;
        }
        Ok(())
    }

    /// RM_FREE of `handle` and everything under it.
    fn free_object(&self, handle: Handle) -> NvStatus {
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

/// Only the simulated RM's own state is touched; the parameter structs are read as RM reads them.
impl Transport for SimShared {
    fn alloc_root(&self) -> Result<Handle> {
        let mut st = self.lock();
        let h = st.new_handle();
        st.objects.insert(
            h,
            Obj {
                parent: 0,
                class: sys::NV01_ROOT_CLIENT,
                engine: None,
            },
        );
        Ok(h)
    }

    unsafe fn alloc(
        &self,
        _client: Handle,
        parent: Handle,
        class: u32,
        params: *mut c_void,
        size: usize,
        what: &'static str,
    ) -> Result<Handle> {
        self.alloc_object(parent, class, params.cast(), size)
            .map_err(|status| Error::Rm {
                call: "RM_ALLOC",
                what,
                status,
            })
    }

    unsafe fn control(
        &self,
        _client: Handle,
        object: Handle,
        cmd: u32,
        params: *mut c_void,
        size: usize,
        what: &'static str,
    ) -> Result<()> {
        let status = match self.answer_control(object, cmd, params.cast(), size) {
            Ok(()) => NvStatus::OK,
            Err(s) => s,
        };
        check("RM_CONTROL", what, status.0)
    }

    fn free(&self, _client: Handle, _parent: Handle, handle: Handle) -> Result<()> {
        check("RM_FREE", "object", self.free_object(handle).0)
    }

    fn dup(&self, _: Handle, _: Handle, _: Handle, _: Handle, _: &'static str) -> Result<Handle> {
        Err(Error::Simulated {
            what: "/dev/nvidiactl",
        })
    }

    /// UVM's job (GPU mappings at the CPU address) is done by the registry of live allocations: nothing to do.
    unsafe fn uvm(&self, _cmd: u32, _params: *mut c_void, _what: &'static str) -> Result<()> {
        Ok(())
    }

    fn map_cpu(&self, _client: Handle, _req: &CpuMapRequest) -> Result<CpuMapping> {
        Err(Error::Simulated {
            what: "/dev/nvidiactl",
        })
    }

    fn ctl(&self) -> Result<&std::os::fd::OwnedFd> {
        Err(Error::Simulated {
            what: "/dev/nvidiactl",
        })
    }

    fn uvm_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        None
    }

    fn in_process_gpu(&self) -> Option<&dyn InProcessGpu> {
        Some(self)
    }
}

impl InProcessGpu for SimShared {
    /// Backs `[va, va + size)` (inside one of our PROT_NONE reservations) with anonymous shared memory and
    /// registers it as memory object `handle`.
    fn back(&self, handle: Handle, va: u64, size: u64) -> Result<()> {
        // SAFETY: the range was just handed out by a VaRegion of ours, so it lies inside our PROT_NONE
        // reservation and MAP_FIXED replaces nothing of anyone else's.
        unsafe {
            mmap_anonymous(
                va as *mut c_void,
                size as usize,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED | MapFlags::FIXED | MapFlags::NORESERVE,
            )
        }
        .map_err(|e| Error::Mmap {
            what: "simulated GPU memory",
            source: e.into(),
        })?;
        let mut st = self.lock();
        st.allocations.insert(va, (size, handle));
        st.va_of.insert(handle, va);
        Ok(())
    }

    /// Lets this simulated GPU's front end reach `[va, va + size)`, memory another simulated GPU of the process
    /// allocated (a peer mapping: the bytes stay the owner's).
    fn reach(&self, va: u64, size: u64) {
        // Handle 0 is never an object of this RM: the range is not this GPU's to free.
        self.lock().allocations.insert(va, (size, 0));
    }

    /// Forgets the allocation at `va`; after this returns the front end cannot reach it.
    fn forget(&self, va: u64) {
        let mut st = self.lock();
        if let Some((_, handle)) = st.allocations.remove(&va) {
            st.va_of.remove(&handle);
        }
    }

    fn usermode_page(&self) -> NonNull<u8> {
        self.usermode
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

fn mask(bits: u32) -> u32 {
    if bits >= 32 {
        u32::MAX
    } else {
        (1 << bits) - 1
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

impl GpuCore {
    /// Opens a simulated GPU: the RM objects, VA regions, memory and channels work as on hardware, but RM is
    /// answered in process and nothing executes what is submitted until a front-end model (the `sim` module)
    /// reads the rings through the returned [`SimBus`].
    pub fn open_simulated(config: SimConfig) -> Result<(std::sync::Arc<GpuCore>, SimBus)> {
        let shared = Arc::new(SimShared::new(config)?);
        let client = Arc::new(Client::over(shared.clone())?);
        let (device, subdevice, classes) = super::gpu::device_objects(&client, 0)?;
        let card = sys::nv_ioctl_card_info_t {
            valid: 1,
            ..Default::default()
        };
        let version = format!("{HEADERS_BRANCH}.0 (APEX simulated RM)");
        let info = gpu_info(&subdevice, 0, &card, version)?;
        let mut vp = sys::NV_VASPACE_ALLOCATION_PARAMETERS::default();
        let vaspace = Arc::new(Object::alloc(
            &client,
            Some(&device),
            sys::FERMI_VASPACE_A,
            Some(&mut vp),
            "FERMI_VASPACE_A",
        )?);
        let (low, high) = super::gpu::reserve_regions()?;
        let core = GpuCore {
            info,
            classes,
            client,
            _dev_fd: None,
            device,
            subdevice,
            vaspace,
            low,
            high,
            // The doorbell page belongs to the simulated RM (see `InProcessGpu::usermode_page`).
            usermode: None,
            windows: std::sync::OnceLock::new(),
            attachment: None,
            // Distinct per simulated GPU (RM's ids are small numbers; these cannot collide with them).
            gpu_id: sim_gpu_id(shared.id()),
            // A GPU alone gets a domain of its own (counting down from the shared one: RM's ids count up).
            domain: if shared.config.peer {
                SIMULATED_DOMAIN
            } else {
                SIMULATED_DOMAIN - shared.id()
            },
            graphics_group: Default::default(),
        };
        // Allocated as on hardware, so that the simulated RM checks its parameters; the page the doorbell is
        // rung on is the simulated RM's own.
        drop(core.alloc_usermode()?);
        // The same policy as a GPU opened on hardware.
        if super::gpu::perf_boost_wanted(std::env::var_os(super::gpu::PERF_BOOST_ENV).as_deref()) {
            core.request_max_performance();
        }
        info!(gpu = %core.info.name, sms = core.info.sm_count, "opened simulated GPU");
        Ok((Arc::new(core), SimBus(shared)))
    }
}

/// The simulated GPU as its front end sees it: channel registrations, the doorbell, memory by GPU VA.
#[derive(Clone, Debug)]
pub struct SimBus(Arc<SimShared>);

impl SimBus {
    /// Holds the registry until the view is dropped: allocations cannot go away meanwhile.
    pub fn lock(&self) -> SimView<'_> {
        SimView {
            st: self.0.lock(),
            shared: &self.0,
        }
    }

    /// The GPU the simulated RM describes.
    pub fn config(&self) -> &SimConfig {
        &self.0.config
    }

    /// Nanoseconds since the simulated GPU was opened (its timestamp clock; never 0).
    pub fn now_ns(&self) -> u64 {
        self.0.start.elapsed().as_nanos() as u64 + 1
    }
}

/// A locked view of the simulated GPU. Every access is checked against the live allocations.
pub struct SimView<'a> {
    st: MutexGuard<'a, State>,
    shared: &'a SimShared,
}

impl SimView<'_> {
    /// The last performance boost asked of the GPU, `(flags, duration)` as `NV2080_CTRL_CMD_PERF_BOOST` took
    /// them; `None` when none was.
    pub fn perf_boost(&self) -> Option<(u32, u32)> {
        self.st.perf_boost
    }

    /// Whether the doorbell page was asked for through BAR1 (`NV_HOPPER_USERMODE_A_PARAMS::bBar1Mapping`), as
    /// USERD's writes travel; `None` when no usermode object was allocated.
    pub fn doorbell_through_bar1(&self) -> Option<bool> {
        self.st.usermode_bar1
    }

    /// The compute preemption mode set on channel group `group` (`NV2080_CTRL_SET_CTXSW_PREEMPTION_MODE_COMPUTE_*`),
    /// or `None` where none was set (RM's default, wait for idle).
    pub fn compute_preemption(&self, group: Handle) -> Option<u32> {
        self.st.compute_preemption.get(&group).copied()
    }

    /// Every live GPFIFO channel.
    pub fn channels(&self) -> Vec<SimChannel> {
        self.st.channels.values().copied().collect()
    }

    /// The channel with RM handle `handle`, if it is live.
    pub fn channel(&self, handle: Handle) -> Option<SimChannel> {
        self.st.channels.get(&handle).copied()
    }

    /// Whether an object of `class` is allocated under channel `channel` (what SET_OBJECT may bind).
    pub fn channel_has_class(&self, channel: Handle, class: u32) -> bool {
        self.st
            .objects
            .values()
            .any(|o| o.parent == channel && o.class == class)
    }

    /// Whether `[va, va + len)` lies inside one live allocation.
    pub fn contains(&self, va: u64, len: u64) -> bool {
        self.st.holds(va, len)
    }

    fn ptr(&self, va: u64, len: u64, align: u64) -> std::result::Result<*mut u8, AccessError> {
        if !va.is_multiple_of(align) {
            return Err(AccessError::Misaligned { va, len });
        }
        if len == 0 || !self.st.holds(va, len) {
            return Err(AccessError::Unmapped { va, len });
        }
        Ok(va as *mut u8)
    }

    /// Copies `out.len()` bytes from GPU address `va`.
    pub fn read(&self, va: u64, out: &mut [u8]) -> std::result::Result<(), AccessError> {
        if out.is_empty() {
            return Ok(());
        }
        let p = self.ptr(va, out.len() as u64, 1)?;
        // SAFETY: the range lies inside a live allocation, which is mapped read-write (VA == CPU address) and
        // cannot be unmapped while we hold the registry lock; `out` is a Rust buffer, so no overlap.
        unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Copies `data` to GPU address `va`.
    pub fn write(&self, va: u64, data: &[u8]) -> std::result::Result<(), AccessError> {
        if data.is_empty() {
            return Ok(());
        }
        let p = self.ptr(va, data.len() as u64, 1)?;
        // SAFETY: as in `read`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
        Ok(())
    }

    /// Reads `n` little-endian words at `va` (4-byte aligned).
    pub fn read_words(&self, va: u64, n: usize) -> std::result::Result<Vec<u32>, AccessError> {
        let len = n as u64 * 4;
        let p = self.ptr(va, len, 4)?.cast::<u32>();
        // SAFETY: as in `read`; 4-byte aligned, n words in bounds. The CPU writes these words concurrently only
        // in ways the protocol forbids (like DMA), so per-word volatile loads are what the hardware sees.
        Ok((0..n)
            .map(|i| unsafe { p.add(i).read_volatile() })
            .collect())
    }

    /// An atomic 32-bit load at `va` (4-byte aligned), as the front end reads semaphores and GPPut.
    pub fn read_u32(&self, va: u64) -> std::result::Result<u32, AccessError> {
        let p = self.ptr(va, 4, 4)?;
        // SAFETY: in a live allocation, 4-byte aligned; the CPU polls these words, so atomically.
        Ok(unsafe { AtomicU32::from_ptr(p.cast()) }.load(Ordering::Acquire))
    }

    /// An atomic 64-bit load at `va` (8-byte aligned).
    pub fn read_u64(&self, va: u64) -> std::result::Result<u64, AccessError> {
        let p = self.ptr(va, 8, 8)?;
        // SAFETY: in a live allocation, 8-byte aligned.
        Ok(unsafe { AtomicU64::from_ptr(p.cast()) }.load(Ordering::Acquire))
    }

    /// An atomic 32-bit store at `va` (4-byte aligned), as the front end releases semaphores and GPGet.
    pub fn write_u32(&self, va: u64, value: u32) -> std::result::Result<(), AccessError> {
        let p = self.ptr(va, 4, 4)?;
        // SAFETY: in a live allocation, 4-byte aligned; semaphores and GPGet are polled by the CPU.
        unsafe { AtomicU32::from_ptr(p.cast()) }.store(value, Ordering::Release);
        Ok(())
    }

    /// An atomic 64-bit store at `va` (8-byte aligned).
    pub fn write_u64(&self, va: u64, value: u64) -> std::result::Result<(), AccessError> {
        let p = self.ptr(va, 8, 8)?;
        // SAFETY: in a live allocation, 8-byte aligned.
        unsafe { AtomicU64::from_ptr(p.cast()) }.store(value, Ordering::Release);
        Ok(())
    }

    /// Takes the last token written to the doorbell since the previous call (0 when none).
    pub fn take_doorbell(&self) -> u32 {
        let offset = host::c361::NOTIFY_CHANNEL_PENDING as usize;
        // SAFETY: the usermode page is USERMODE_SIZE bytes, owned by `shared` (alive: we borrow it); the offset
        // is inside it and 4-byte aligned.
        let word = unsafe { AtomicU32::from_ptr(self.shared.usermode.as_ptr().add(offset).cast()) };
        word.swap(0, Ordering::AcqRel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rm::{ChannelGroupSchedule, Memory, MemoryDesc, Placement, RmControl};

    #[test]
    fn opens_like_an_h200_and_checks_every_access() {
        let (core, bus) = GpuCore::open_simulated(SimConfig::default()).unwrap();
        let i = core.info();
        assert_eq!(
            (i.sm_version, i.sm_count, i.gpc_count, i.tpc_count),
            (90, 132, 8, 66)
        );
        assert_eq!((i.sms_per_tpc, i.max_warps_per_sm), (2, 64));
        assert_eq!(i.name, "APEX simulated Hopper");
        assert!(core.has_class(0xc86f) && core.has_class(0xcbc0) && core.has_class(0xc8b5));
        assert!(core.has_class(0xc661));
        assert!(!core.usermode_ptr().is_null());
        // The doorbell travels the way USERD's GP_PUT does (BAR1), so it cannot overtake it.
        assert_eq!(bus.lock().doorbell_through_bar1(), Some(true));

        let mem = Memory::alloc(
            &core,
            MemoryDesc::video(0x1000)
                .placement(Placement::SystemCached)
                .with_cpu()
                .low(),
        )
        .unwrap();
        assert_eq!(mem.cpu_ptr().map(|p| p.as_ptr() as u64), Some(mem.va()));
        mem.write_u64_volatile(8, 0x1234).unwrap();
        let va = mem.va();
        {
            let v = bus.lock();
            assert_eq!(v.read_u64(va + 8), Ok(0x1234));
            v.write_u32(va + 16, 7).unwrap();
            assert_eq!(
                v.read_u32(va + 0x1000),
                Err(AccessError::Unmapped {
                    va: va + 0x1000,
                    len: 4
                })
            );
            assert_eq!(
                v.read_u64(va + 4),
                Err(AccessError::Misaligned { va: va + 4, len: 8 })
            );
        }
        assert_eq!(mem.read_u32_volatile(16).unwrap(), 7);
        drop(mem);
        assert!(!bus.lock().contains(va, 4), "a freed buffer is unreachable");
    }

    /// The objects of a copy-only channel on LCE `group_lce`, built by hand; `copy` is the copy object's
    /// allocation parameters (`None`: none, as APEX allocated it before it named the engine).
    struct CopyChannel {
        _copy: Object,
        _channel: Arc<Object>,
        group: Arc<Object>,
        _mem: (Memory, Memory),
    }

    fn group_on(core: &Arc<GpuCore>, lce: u32) -> Arc<Object> {
        let mut gp = sys::NV_CHANNEL_GROUP_ALLOCATION_PARAMETERS {
            engineType: copy_engine_type(lce).expect("an LCE RM names"),
            hVASpace: core.vaspace().handle(),
            ..Default::default()
        };
        Arc::new(
            Object::alloc(
                core.client(),
                Some(core.device()),
                sys::KEPLER_CHANNEL_GROUP_A,
                Some(&mut gp),
                "group",
            )
            .expect("copy-engine group"),
        )
    }

    fn channel_params(ring: &Memory, notifier: &Memory) -> sys::NV_CHANNEL_ALLOC_PARAMS {
        let mut cp = sys::NV_CHANNEL_ALLOC_PARAMS {
            hObjectError: notifier.handle(),
            hObjectBuffer: ring.handle(),
            gpFifoOffset: ring.va(),
            gpFifoEntries: 64,
            ..Default::default()
        };
        cp.hUserdMemory[0] = ring.handle();
        cp.userdOffset[0] = 0x1000;
        cp
    }

    fn copy_channel(
        core: &Arc<GpuCore>,
        group_lce: u32,
        copy: Option<CopyAllocParams>,
    ) -> Result<CopyChannel> {
        let desc = MemoryDesc::video(0x2000).with_cpu().low();
        let (ring, notifier) = (
            Memory::alloc(core, desc).unwrap(),
            Memory::alloc(core, desc).unwrap(),
        );
        let group = group_on(core, group_lce);
        let mut cp = sys::NV_CHANNEL_ALLOC_PARAMS {
            engineType: copy_engine_type(group_lce).unwrap(),
            ..channel_params(&ring, &notifier)
        };
        let channel = Arc::new(Object::alloc(
            core.client(),
            Some(&group),
            0xc86f,
            Some(&mut cp),
            "channel",
        )?);
        let copy = match copy {
            None => Object::alloc::<()>(core.client(), Some(&channel), 0xc8b5, None, "copy")?,
            Some(mut p) => {
                Object::alloc(core.client(), Some(&channel), 0xc8b5, Some(&mut p), "copy")?
            }
        };
        Ok(CopyChannel {
            _copy: copy,
            _channel: channel,
            group,
            _mem: (ring, notifier),
        })
    }

    fn schedule(group: &Object) -> Result<()> {
        let mut p = ChannelGroupSchedule(sys::NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS {
            bEnable: 1,
            ..Default::default()
        });
        group.ctrl(&mut p)
    }

    fn by_engine(lce: u32) -> Option<CopyAllocParams> {
        Some(CopyAllocParams {
            version: COPY_ALLOC_VERSION_ENGINE_TYPE,
            engine_type: copy_engine_type(lce).unwrap(),
        })
    }

    #[test]
    fn a_copy_group_schedules_only_when_its_copy_objects_run_on_its_engine() {
        let (core, _bus) = GpuCore::open_simulated(SimConfig::default()).unwrap();
        // The copy object as APEX allocated it before: no parameters, so RM binds it to CE 0 while the group
        // is on LCE 2.
        let old = copy_channel(&core, 2, None).expect("objects are accepted");
        let e = schedule(&old.group).expect_err("the group spans two runlists");
        assert_eq!(e.status(), Some(NV_ERR_INVALID_STATE));
        // Named by engine type (version 1, what the channel code passes now) or by CE instance (version 0).
        let v1 = copy_channel(&core, 2, by_engine(2)).unwrap();
        schedule(&v1.group).expect("copy object on the group's engine");
        let v0 = copy_channel(
            &core,
            3,
            Some(CopyAllocParams {
                version: COPY_ALLOC_VERSION_INSTANCE,
                engine_type: 3,
            }),
        )
        .unwrap();
        schedule(&v0.group).expect("CE instance 3 in a group on LCE 3");
        let other = copy_channel(&core, 2, by_engine(4)).unwrap();
        let e = schedule(&other.group).expect_err("copy object on LCE 4, group on LCE 2");
        assert_eq!(e.status(), Some(NV_ERR_INVALID_STATE));
        // LCEs 0 and 1 share the graphics runlist: a copy-only group there is refused even when consistent.
        let grce = copy_channel(&core, 0, by_engine(0)).unwrap();
        let e = schedule(&grce.group).expect_err("a graphics-runlist CE");
        assert_eq!(e.status(), Some(NV_ERR_INVALID_STATE));
    }

    #[test]
    fn absent_engines_subcontexts_in_copy_groups_and_channel_va_spaces_are_refused() {
        let (core, _bus) = GpuCore::open_simulated(SimConfig::default()).unwrap();
        let status = |r: Result<CopyChannel>| r.map(drop).unwrap_err().status();
        // LCE 7 is not on the simulated GPU; version 2 is not a version RM knows.
        assert_eq!(
            status(copy_channel(&core, 7, by_engine(7))),
            Some(NV_ERR_INVALID_ARGUMENT)
        );
        let bad_version = Some(CopyAllocParams {
            version: 2,
            engine_type: 2,
        });
        assert_eq!(
            status(copy_channel(&core, 2, bad_version)),
            Some(NV_ERR_INVALID_ARGUMENT)
        );
        // Subcontexts are graphics-only.
        let group = group_on(&core, 2);
        let mut cs = sys::NV_CTXSHARE_ALLOCATION_PARAMETERS {
            hVASpace: core.vaspace().handle(),
            flags: sys::NV_CTXSHARE_ALLOCATION_FLAGS_SUBCONTEXT_ASYNC,
            subctxId: 0,
        };
        let e = Object::alloc(
            core.client(),
            Some(&group),
            sys::FERMI_CONTEXT_SHARE_A,
            Some(&mut cs),
            "ctxshare",
        )
        .unwrap_err();
        assert_eq!(e.status(), Some(NV_ERR_INVALID_ARGUMENT));
        // A channel in a group does not name a VA space of its own.
        let desc = MemoryDesc::video(0x2000).with_cpu().low();
        let (ring, notifier) = (
            Memory::alloc(&core, desc).unwrap(),
            Memory::alloc(&core, desc).unwrap(),
        );
        let mut cp = sys::NV_CHANNEL_ALLOC_PARAMS {
            hVASpace: core.vaspace().handle(),
            ..channel_params(&ring, &notifier)
        };
        let e = Object::alloc(
            core.client(),
            Some(&group),
            0xc86f,
            Some(&mut cp),
            "channel",
        )
        .unwrap_err();
        assert_eq!(e.status(), Some(NV_ERR_INVALID_ARGUMENT));
        cp.hVASpace = 0;
        Object::alloc(
            core.client(),
            Some(&group),
            0xc86f,
            Some(&mut cp),
            "channel",
        )
        .expect("the same channel without its own VA space");
    }

    #[test]
    fn unknown_controls_and_classes_are_refused() {
        let (core, _bus) = GpuCore::open_simulated(SimConfig::default()).unwrap();
        /// A command RM does not know, with GET_GPC_MASK's parameters.
        #[repr(transparent)]
        struct Bogus(sys::NV2080_CTRL_GR_GET_GPC_MASK_PARAMS);
        // SAFETY: the struct is GET_GPC_MASK's parameters; the command is refused before they are read.
        unsafe impl RmControl for Bogus {
            const CMD: u32 = 0x2080_ffff;
            const NAME: &'static str = "bogus";
        }
        let mut p = Bogus(Default::default());
        let e = core.subdevice().ctrl(&mut p).unwrap_err();
        assert_eq!(e.status(), Some(NV_ERR_NOT_SUPPORTED));
        let e = Object::alloc::<()>(core.client(), Some(core.device()), 0xc56f, None, "ampere")
            .unwrap_err();
        assert_eq!(e.status(), Some(NV_ERR_INVALID_CLASS));
    }

    #[test]
    fn opening_asks_for_cudas_boost_and_rm_checks_it() {
        let (core, bus) = GpuCore::open_simulated(SimConfig::default()).unwrap();
        // Unless APEX_PERF_BOOST=0 is set in the environment of the test run.
        let wanted = super::super::gpu::perf_boost_wanted(
            std::env::var_os(super::super::gpu::PERF_BOOST_ENV).as_deref(),
        );
        assert_eq!(
            bus.lock().perf_boost(),
            wanted.then_some((0x12, sys::NV2080_CTRL_PERF_BOOST_DURATION_INFINITE))
        );
        let mut bad = sys::NV2080_CTRL_PERF_BOOST_PARAMS {
            flags: 0x3,
            duration: 10,
        };
        let e = core.subdevice().ctrl(&mut bad).unwrap_err();
        assert_eq!(e.status(), Some(NV_ERR_INVALID_ARGUMENT));
        let mut clear = sys::NV2080_CTRL_PERF_BOOST_PARAMS {
            flags: 0,
            duration: 0,
        };
        core.subdevice().ctrl(&mut clear).unwrap();
        assert_eq!(bus.lock().perf_boost(), Some((0, 0)));
    }
}
