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
//!
//! The code is split by concern: `objects` (the simulated RM's registry, RM_ALLOC and RM_FREE), `controls`
//! (RM_CONTROL), `transport` (the simulated RM as its client's transport and as an in-process GPU) and `bus` (the
//! front end's view). This file holds the GPU a simulated RM describes ([`SimConfig`]) and opening one
//! ([`GpuCore::open_simulated`]).

mod bus;
mod controls;
mod objects;
#[cfg(test)]
mod tests;
mod transport;

use std::sync::Arc;

use tracing::info;

use super::client::{Client, Object};
use super::domain::SIMULATED_DOMAIN;
use super::gpu::{GpuCore, HEADERS_BRANCH, gpu_info};
use super::{Result, sys};

pub use bus::{AccessError, SimBus, SimView};
pub use objects::SimChannel;

use objects::SimShared;

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
