//! Opening a GPU through RM: enumeration, driver check, device/subdevice, class list, GPU info, our own
//! GPU virtual address space registered with UVM, and the usermode (doorbell) page.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use tracing::{debug, info, warn};

use super::client::{Client, Object};
use super::domain::{self, DomainChoice};
use super::hardware::{
    Hardware, c_string, card_info, open_gpu_node, open_node, own_uvm_fds, query_driver_version,
};
use super::mapping::CpuMapping;
use super::sys::defs;
use super::transport::CpuMapRequest;
use super::va::VaRegion;
use super::{Error, Result, sys};

/// Driver branch of the vendored headers in `open-gpu-headers/` (tag 580.142).
pub const HEADERS_BRANCH: u32 = 580;

/// Size of the usermode region: a 64 KiB page whose offset 0x90 is the doorbell.
pub const USERMODE_SIZE: usize = 0x1_0000;

/// Low region: everything the GPU front end addresses with 40 bits (rings, pushbuffers, QMDs, code,
/// constant banks) and the shader windows. 64 GiB, placed below 1 TiB.
pub(super) const LOW_REGION_SIZE: u64 = 64 << 30;
pub(super) const LOW_REGION_LIMIT: u64 = 1 << 40;
/// High region for user buffers: 1 TiB wherever the kernel finds room.
pub(super) const HIGH_REGION_SIZE: u64 = 1 << 40;

/// What RM reports about the GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct GpuInfo {
    /// The index [`GpuCore::open`] was given: the GPU's place in RM's list (`NV_ESC_CARD_INFO`).
    pub index: usize,
    /// The N of the GPU's device node /dev/nvidiaN.
    pub minor: u32,
    /// The name RM reports (`NVIDIA H200`).
    pub name: String,
    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as nvidia-smi prints it.
    pub uuid: String,
    /// The UUID's 16 bytes, as UVM and RM controls take it.
    pub uuid_bytes: [u8; 16],
    /// PCI address, `domain:bus:device.function` in hex (`00000000:1b:00.0`).
    pub pci_bus_id: String,
    /// SM version as major * 10 + minor (90 for Hopper).
    pub sm_version: u32,
    /// Streaming multiprocessors enabled on this GPU (TPCs × SMs per TPC).
    pub sm_count: u32,
    /// Graphics processing clusters enabled on this GPU.
    pub gpc_count: u32,
    /// Texture processing clusters enabled, over all GPCs (floorswept ones not counted).
    pub tpc_count: u32,
    /// The most TPCs a GPC of this chip has (the chip's design, before floorsweeping).
    pub tpcs_per_gpc_max: u32,
    /// SMs in each TPC (2 on Hopper).
    pub sms_per_tpc: u32,
    /// The most warps an SM holds at once (64 on Hopper), for occupancy.
    pub max_warps_per_sm: u32,
    /// Video memory, bytes.
    pub memory_bytes: u64,
    /// The loaded kernel module's version (`580.159.04`).
    pub driver_version: String,
}

/// The RM objects of one opened GPU that everything above builds on. Shared (`Arc`) by memory,
/// channels and modules, so the device outlives all of them.
#[derive(Debug)]
pub struct GpuCore {
    pub(crate) info: GpuInfo,
    pub(crate) classes: Vec<u32>,
    pub(crate) client: Arc<Client>,
    // /dev/nvidiaN, registered with the control fd; held open for the GPU's lifetime as RM expects
    // (None for a simulated GPU).
    pub(crate) _dev_fd: Option<OwnedFd>,
    pub(crate) device: Arc<Object>,
    pub(crate) subdevice: Arc<Object>,
    pub(crate) vaspace: Arc<Object>,
    pub(crate) low: VaRegion,
    pub(crate) high: VaRegion,
    pub(super) usermode: Option<(CpuMapping, Object)>,
    /// An empty address range shared by every queue of this GPU for its shader windows (see
    /// [`GpuCore::window_range`]).
    pub(crate) windows: std::sync::OnceLock<u64>,
    /// For a GPU attached to a CUDA context: CUDA's channel group and VA spaces, duplicated into our client.
    pub(crate) attachment: Option<Attachment>,
    /// RM's id of this GPU (what NV0000 controls name it by).
    pub(crate) gpu_id: u32,
    /// The peer domain (UVM VA space shared with other GPUs) this GPU is in; 0 for none.
    pub(crate) domain: u64,
    /// The graphics-engine channel group this GPU's compute channels share (kept by the channel layer).
    pub(crate) graphics_group: std::sync::Mutex<SharedGroup>,
}

/// A channel group that several channels of one [`GpuCore`] join, each with a subcontext of its own, as libcuda's
/// streams share their context's group: the graphics engine runs their kernels side by side, where channels in
/// groups of their own take turns, one group's context at a time. Weak: the group lives as long as a channel in
/// it does.
#[derive(Debug, Default)]
pub(crate) struct SharedGroup {
    /// The group, while a channel holds it.
    pub(crate) group: std::sync::Weak<Object>,
    /// Set once a channel of the group has faulted: RM ends the whole group, so no channel joins it after that.
    pub(crate) faulted: Arc<std::sync::atomic::AtomicBool>,
    /// The error notifiers of the group's channels, read before a channel joins: RM posts a group's end to its
    /// channels' notifiers whether or not anyone has looked.
    pub(crate) notifiers: Vec<std::sync::Weak<dyn NotifierWords>>,
}

/// A channel's error notifier as its group keeps it: words RM writes and the CPU reads ([`Memory`](super::Memory)
/// is one). A trait so that the GPU's record of its groups does not depend on how memory is built.
pub(crate) trait NotifierWords: Send + Sync {
    /// The 32-bit word at byte `offset`, read without caching (RM writes it behind the CPU's back).
    fn read_u32_volatile(&self, offset: u64) -> Result<u32>;
}

/// A CUDA context's channel group and VA spaces, duplicated into APEX's client: channels built on an attached
/// [`GpuCore`] join that group as subcontexts of their own and share CUDA's address space, so CUDA's device
/// pointers are valid in APEX's kernels and no channel-group switch separates APEX's work from CUDA's.
#[derive(Debug)]
pub struct Attachment {
    /// CUDA's compute channel group (our duplicate of it).
    pub group: Arc<Object>,
    /// CUDA's VA spaces (duplicates), in the order channels try them: the one UVM accepts a channel on is the
    /// context's.
    pub vaspaces: Vec<Arc<Object>>,
    /// CUDA's RM client handle.
    pub cuda_client: super::Handle,
    /// CUDA contexts of the process with a compute channel group on this GPU at the attach: above 1, `group` is the
    /// oldest one's, which need not be the current context's (RM does not say which group is whose).
    pub cuda_contexts: usize,
}

impl GpuCore {
    /// Opens GPU `index` (in the order NV_ESC_CARD_INFO lists them) in an address space of its own.
    pub fn open(index: usize) -> Result<Arc<GpuCore>> {
        GpuCore::open_in(index, false)
    }

    /// Opens GPU `index` in the process's peer domain (one UVM VA space shared with the other GPUs opened this
    /// way), so that it can map their memory and they its. Opt-in: measured on two H200s, channels created after
    /// large (256 MiB) allocations in a shared VA space could stall (see issue 13's note); a GPU opened alone
    /// never shares.
    pub fn open_peer(index: usize) -> Result<Arc<GpuCore>> {
        GpuCore::open_in(index, true)
    }

    fn open_in(index: usize, share: bool) -> Result<Arc<GpuCore>> {
        let ctl = open_node("/dev/nvidiactl")?;
        let driver_version = supported_driver_version(&ctl)?;
        let cards = card_info(&ctl)?;
        let card = *cards.get(index).ok_or(Error::NoSuchGpu {
            index,
            count: cards.len(),
        })?;
        let dev_fd = open_gpu_node(&ctl, card.minor_number)?;
        // Held for the whole open: two threads must not both register this GPU in the shared domain.
        let mut domains = domain::domains();
        let choice = if share {
            domains.choose(card.gpu_id)
        } else {
            domains.private()
        };
        let domain = choice.id();
        let client = Arc::new(match choice {
            DomainChoice::Join(_, uvm) => Hardware::client_sharing_uvm(ctl, uvm)?,
            _ => {
                let uvm = open_node("/dev/nvidia-uvm")?;
                let uvm_mm = open_node("/dev/nvidia-uvm")?;
                Hardware::client(ctl, uvm, uvm_mm)?
            }
        });

        let mut id = sys::NV0000_CTRL_GPU_GET_ID_INFO_V2_PARAMS {
            gpuId: card.gpu_id,
            ..Default::default()
        };
        client.ctrl(client.handle(), &mut id)?;

        let (device, subdevice, classes) = device_objects(&client, id.deviceInstance)?;

        let info = gpu_info(&subdevice, index, &card, driver_version)?;
        info!(gpu = %info.name, uuid = %info.uuid, sm = info.sm_version, sms = info.sm_count, "opened GPU");

        // Our own GPU VA space, owned by UVM so that buffers are mapped at their CPU addresses.
        let mut vp = sys::NV_VASPACE_ALLOCATION_PARAMETERS {
            vaBase: 0x1000,
            vaSize: 0x1_ffff_fb00_0000,
            flags: sys::NV_VASPACE_ALLOCATION_FLAGS_ENABLE_PAGE_FAULTING
                | sys::NV_VASPACE_ALLOCATION_FLAGS_IS_EXTERNALLY_OWNED,
            ..Default::default()
        };
        let vaspace = Arc::new(Object::alloc(
            &client,
            Some(&device),
            sys::FERMI_VASPACE_A,
            Some(&mut vp),
            "FERMI_VASPACE_A",
        )?);
        let uuid = sys::NvProcessorUuid {
            uuid: info.uuid_bytes,
        };
        let mut rg = sys::UVM_REGISTER_GPU_PARAMS {
            gpu_uuid: uuid,
            rmCtrlFd: -1,
            ..Default::default()
        };
        client.uvm_call(sys::UVM_REGISTER_GPU, &mut rg, "UVM_REGISTER_GPU", |p| {
            p.rmStatus
        })?;
        let mut rv = sys::UVM_REGISTER_GPU_VASPACE_PARAMS {
            gpuUuid: uuid,
            rmCtrlFd: client.ctl_raw_fd(),
            hClient: client.handle(),
            hVaSpace: vaspace.handle(),
            ..Default::default()
        };
        client.uvm_call(
            sys::UVM_REGISTER_GPU_VASPACE,
            &mut rv,
            "UVM_REGISTER_GPU_VASPACE",
            |p| p.rmStatus,
        )?;

        // Candidates every 64 GiB from 64 GiB up, so two GPUs in one process each find a low region.
        let (low, high) = reserve_regions()?;

        let mut core = GpuCore {
            info,
            classes,
            client,
            _dev_fd: Some(dev_fd),
            device,
            subdevice,
            vaspace,
            low,
            high,
            usermode: None,
            windows: std::sync::OnceLock::new(),
            attachment: None,
            gpu_id: card.gpu_id,
            domain,
            graphics_group: Default::default(),
        };
        core.open_usermode()?;
        if perf_boost_wanted(std::env::var_os(PERF_BOOST_ENV).as_deref()) {
            core.request_max_performance();
        }
        debug!(classes = core.classes.len(), domain, "GPU core ready");
        domains.admit(domain, card.gpu_id, &core.client);
        Ok(Arc::new(core))
    }

    /// How many GPUs RM lists (`NV_ESC_CARD_INFO`), the indices [`GpuCore::open`] takes.
    pub fn count() -> Result<usize> {
        let ctl = open_node("/dev/nvidiactl")?;
        Ok(card_info(&ctl)?.len())
    }

    /// The UUID of every GPU RM lists, in [`GpuCore::open`]'s index order, read without opening them for work.
    pub fn uuids() -> Result<Vec<[u8; 16]>> {
        let ctl = open_node("/dev/nvidiactl")?;
        let cards = card_info(&ctl)?;
        // RM answers for attached GPUs: each GPU node is held open while its UUID is read.
        let nodes = cards
            .iter()
            .map(|c| open_gpu_node(&ctl, c.minor_number))
            .collect::<Result<Vec<_>>>()?;
        let client = Hardware::client_with_foreign_uvm(ctl, open_node("/dev/nvidia-uvm")?)?;
        let uuids = cards
            .iter()
            .map(|c| gpu_uuid(&client, c.gpu_id))
            .collect::<Result<Vec<_>>>();
        drop(client);
        drop(nodes);
        uuids
    }

    /// Opens the GPU whose UUID is `uuid` inside the CUDA context of this process that runs on it: APEX's own
    /// client, device and memory, with channels that join CUDA's compute channel group and address space (see
    /// [`Attachment`]). The CUDA context must exist (with its first kernel launch or allocation done) and must
    /// outlive the returned core and everything built on it.
    pub fn attach_cuda(uuid: [u8; 16]) -> Result<Arc<GpuCore>> {
        // Phase times for the debug log: the attach is on a program's critical path under the preload.
        let started = std::time::Instant::now();
        let lap = |since: &mut u128| {
            let now = started.elapsed().as_micros();
            let d = now - *since;
            *since = now;
            d
        };
        let mut mark = 0u128;
        let ctl = open_node("/dev/nvidiactl")?;
        let driver_version = supported_driver_version(&ctl)?;
        let cards = card_info(&ctl)?;
        // A probe client on our own descriptor: it finds CUDA's client, then the real one is built with CUDA's
        // UVM descriptor.
        let probe_uvm = open_node("/dev/nvidia-uvm")?;
        let own_uvm: Vec<i32> = own_uvm_fds(|f| f.clone());
        let initialised = super::attach::foreign_uvm_fds(&own_uvm);
        let found = initialised.len();
        let mut uvm: Vec<_> = initialised
            .into_iter()
            .filter(|fd| super::attach::uvm_has_gpu(fd, uuid))
            .collect();
        if uvm.len() != 1 {
            return Err(Error::Attach(format!(
                "found {found} initialised UVM descriptors that APEX did not open, {} of them with GPU {} \
                 registered (CUDA's is one); {}",
                uvm.len(),
                format_uuid(&uuid),
                if uvm.is_empty() {
                    "is a CUDA context created on this GPU in this process (cuInit, a context, and one allocation)?"
                } else {
                    "cannot tell which one is CUDA's"
                }
            )));
        }
        let uvm = uvm.remove(0);
        let uvm_us = lap(&mut mark);
        let client = Arc::new(Hardware::client_with_foreign_uvm(ctl, probe_uvm)?);
        let probe_us = lap(&mut mark);
        let classes = super::attach::compute_object_classes();
        // The context on the GPU asked for among a client's objects: one candidate per device of the client that
        // has a context, the GPU of each told by RM's id of its subdevice (a context on any GPU of the process is
        // found, not only the first's).
        let pick =
            |c: &super::attach::ForeignClient, objects: &[super::attach::RmObject], device| {
                super::attach::context_candidates(objects, c.handle, device, &classes)
                    .into_iter()
                    .find_map(|objs| {
                        let gpu_id = c.gpu_id(objs.subdevice).ok()?;
                        let (index, card) =
                            cards.iter().enumerate().find(|(_, k)| k.gpu_id == gpu_id)?;
                        (!gpu_uuid(&client, gpu_id).is_ok_and(|u| u != uuid))
                            .then_some((objs, index, *card))
                    })
            };
        let mut found = None;
        let mut clients = super::attach::foreign_clients(&client)?;
        // Newest first, as listed, but the clients whose first device holds a channel group before the rest: a client
        // without a context (a GPU query library's) is read to its table's end before it is ruled out.
        clients.sort_by_cached_key(|c| !c.first_device_has_channel_group());
        // A quick pass over every client first, then, only if it found nothing, one to the end of each table.
        'passes: for gap in [
            super::attach::HANDLE_SCAN_QUICK_GAP,
            super::attach::HANDLE_SCAN_GAP,
        ] {
            for (i, c) in clients.iter().enumerate() {
                // The scan stops once the context is found: the rest of the table (the program's allocations) is
                // not needed, and each handle read is an ioctl. Its VA spaces are read by then: libcuda makes a
                // context's VA space before its channel group (every table seen, H100 and H200, 580.159.04).
                let Ok((device, objects)) =
                    c.objects(gap, |objects, device| pick(c, objects, device).is_some())
                else {
                    continue;
                };
                debug!(
                    client = format_args!("{:#x}", c.handle),
                    device = format_args!("{device:#x}"),
                    gap,
                    objects = %objects
                        .iter()
                        .map(|o| format!("{:#x}<{:#x}:{:#x}", o.handle, o.parent, o.class))
                        .collect::<Vec<_>>()
                        .join(" "),
                    "a same-process client's objects (handle<parent:class)"
                );
                if let Some((objs, index, card)) = pick(c, &objects, device) {
                    found = Some((i, objs, index, card));
                    break 'passes;
                }
            }
        }
        let found = found.map(|(i, objs, index, card)| (clients.swap_remove(i), objs, index, card));
        if let Some((_, objs, _, _)) = &found
            && objs.compute_groups.len() > 1
        {
            // Several contexts of this process on one GPU share its VA spaces (measured), so every CUdeviceptr
            // works whichever group APEX joins; which group belongs to the current context RM does not say.
            warn!(
                groups = objs.compute_groups.len(),
                joined = format_args!("{:#x}", objs.compute_group),
                "several CUDA contexts use this GPU: APEX joins the oldest one's channel group (memory of every \
                 context works; APEX's work shares that context's time slices and fault fate)"
            );
        }
        let Some((cuda, objs, index, card)) = found else {
            return Err(Error::Attach(
                "no CUDA context with a compute channel group was found in this process (create the context and \
                 launch or allocate once before attaching)"
                    .into(),
            ));
        };
        drop(client);
        let scan_us = lap(&mut mark);
        // The client that is kept: UVM calls go to CUDA's VA space.
        let ctl = open_node("/dev/nvidiactl")?;
        let dev_fd = open_gpu_node(&ctl, card.minor_number)?;
        let client = Arc::new(Hardware::client_with_foreign_uvm(ctl, uvm)?);
        let mut id = sys::NV0000_CTRL_GPU_GET_ID_INFO_V2_PARAMS {
            gpuId: card.gpu_id,
            ..Default::default()
        };
        client.ctrl(client.handle(), &mut id)?;
        let (device, subdevice, classes) = device_objects(&client, id.deviceInstance)?;
        let info = gpu_info(&subdevice, index, &card, driver_version)?;
        let client_us = lap(&mut mark);
        if info.uuid_bytes != uuid {
            return Err(Error::Attach(format!(
                "the CUDA context found runs on {}, not on the GPU asked for ({})",
                info.uuid,
                format_uuid(&uuid)
            )));
        }
        let group = Arc::new(Object::dup(
            &client,
            &device,
            cuda.handle,
            objs.compute_group,
            sys::KEPLER_CHANNEL_GROUP_A,
            "CUDA's channel group",
        )?);
        let vaspaces = objs
            .vaspaces
            .iter()
            .map(|&h| {
                Object::dup(
                    &client,
                    &device,
                    cuda.handle,
                    h,
                    sys::FERMI_VASPACE_A,
                    "CUDA's VA space",
                )
                .map(Arc::new)
            })
            .collect::<Result<Vec<_>>>()?;
        let dup_us = lap(&mut mark);
        // CUDA keeps its allocations inside CPU ranges it reserved (measured: probes/attach E7), so ranges APEX
        // reserves are never handed out by CUDA.
        let (low, high) = reserve_regions()?;
        let regions_us = lap(&mut mark);
        info!(gpu = %info.name, uuid = %info.uuid, cuda_client = format_args!("{:#x}", cuda.handle),
            group = format_args!("{:#x}", objs.compute_group), "attached to the CUDA context");
        let mut core = GpuCore {
            info,
            classes,
            client,
            _dev_fd: Some(dev_fd),
            device,
            subdevice,
            vaspace: vaspaces[0].clone(),
            low,
            high,
            usermode: None,
            windows: std::sync::OnceLock::new(),
            attachment: Some(Attachment {
                group,
                vaspaces,
                cuda_client: cuda.handle,
                cuda_contexts: objs.compute_groups.len(),
            }),
            gpu_id: card.gpu_id,
            domain: 0,
            graphics_group: Default::default(),
        };
        core.open_usermode()?;
        debug!(
            uvm_us,
            probe_us,
            scan_us,
            client_us,
            dup_us,
            regions_us,
            usermode_us = lap(&mut mark),
            "attach phases"
        );
        Ok(Arc::new(core))
    }

    /// Asks RM to hold the GPU at its highest performance state for as long as this client lives, the request
    /// libcuda makes for every context it creates (`NV2080_CTRL_CMD_PERF_BOOST`, flags 0x12, until cleared).
    /// RM tracks boosts per client and drops this one with the client; it changes no setting of the GPU. Without
    /// it an idle H100 stays at its 345 MHz idle clock through the first seconds of a process that has no CUDA
    /// context beside it (measured on 2× H100: peer copies at 0.53–0.60× `cuMemcpyPeerAsync`'s bandwidth, 0.99× boosted). A refusal (a
    /// virtual GPU, a policy) is logged, not an error: the boost is a hint.
    pub fn request_max_performance(&self) {
        let mut p = perf_boost_params();
        match self.client.ctrl(self.subdevice.handle(), &mut p) {
            Ok(()) => debug!(
                gpu = self.info.index,
                "performance boost requested, as CUDA does"
            ),
            Err(e) => {
                warn!(gpu = self.info.index, error = %e, "RM refused the performance boost; clocks follow the load")
            }
        }
    }

    /// CUDA's channel group and VA spaces, for a GPU opened with [`GpuCore::attach_cuda`].
    pub fn attachment(&self) -> Option<&Attachment> {
        self.attachment.as_ref()
    }

    /// What RM reported about the GPU when it was opened.
    pub fn info(&self) -> &GpuInfo {
        &self.info
    }

    /// Every class the GPU lists (NV0080_CTRL_CMD_GPU_GET_CLASSLIST_V2).
    pub fn classes(&self) -> &[u32] {
        &self.classes
    }

    /// Whether the GPU lists `class` (a class number such as `0xcbc0`, HOPPER_COMPUTE_A).
    pub fn has_class(&self, class: u32) -> bool {
        self.classes.contains(&class)
    }

    /// The first of `preferred` that the GPU lists, or an error naming what it lists.
    pub fn pick_class(&self, what: &'static str, preferred: &[u32]) -> Result<u32> {
        preferred
            .iter()
            .copied()
            .find(|c| self.has_class(*c))
            .ok_or_else(|| Error::UnsupportedClass {
                what,
                count: self.classes.len(),
                listed: self
                    .classes
                    .iter()
                    .map(|c| format!("{c:#06x}"))
                    .collect::<Vec<_>>()
                    .join(" "),
            })
    }

    /// The RM client every object of this GPU is allocated in.
    pub fn client(&self) -> &Arc<Client> {
        &self.client
    }

    /// The `NV01_DEVICE_0` object: the parent of memory, VA spaces and channel groups.
    pub fn device(&self) -> &Arc<Object> {
        &self.device
    }

    /// The logical copy engines the GPU has, a bit per LCE index (`NV2080_CTRL_CMD_GPU_GET_ENGINES_V2`), so that
    /// channels are built only on engines that exist (RM logs an assertion for each copy object asked of an
    /// absent one).
    pub fn copy_engines_present(&self) -> Result<u64> {
        let mut p = sys::NV2080_CTRL_GPU_GET_ENGINES_V2_PARAMS::default();
        self.subdevice.ctrl(&mut p)?;
        let n = (p.engineCount as usize).min(p.engineList.len());
        Ok(p.engineList[..n]
            .iter()
            .filter_map(|&t| super::engine::lce_of_engine_type(t))
            .fold(0u64, |m, lce| m | 1 << lce))
    }

    /// The physical copy engines (PCEs) behind logical copy engine `lce`, a bit each
    /// (`NV2080_CTRL_CMD_CE_GET_CE_PCE_MASK`): how much copying one LCE can do, as the PCEs are the units that move
    /// data (an H100's LCE 4 copies about six times as fast as LCE 2).
    pub fn copy_engine_pces(&self, lce: u32) -> Result<u32> {
        let ce_engine_type = super::engine::copy_engine_type(lce).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "LCE {lce}: RM names copy engines 0 to {}",
                super::engine::MAX_LCES - 1
            ))
        })?;
        let mut p = super::control::CePceMaskParams {
            ce_engine_type,
            pce_mask: 0,
        };
        self.subdevice.ctrl(&mut p)?;
        Ok(p.pce_mask)
    }

    /// The `NV20_SUBDEVICE_0` object: the target of per-GPU controls (GR, FB, GPU info).
    pub fn subdevice(&self) -> &Arc<Object> {
        &self.subdevice
    }

    /// The GPU VA space channels are bound to (`FERMI_VASPACE_A`; CUDA's, for an attached GPU).
    pub fn vaspace(&self) -> &Arc<Object> {
        &self.vaspace
    }

    /// The region below 1 TiB for what the front end addresses with 40 bits.
    pub fn low_region(&self) -> &VaRegion {
        &self.low
    }

    /// A range of `size` bytes aligned to `align` in the low region that nothing is ever mapped into, reserved
    /// once per GPU (the first caller's size and alignment hold) and kept until the GPU is closed. Compute
    /// queues put their shared- and local-memory windows there.
    pub fn window_range(&self, size: u64, align: u64) -> Result<u64> {
        if let Some(&va) = self.windows.get() {
            return Ok(va);
        }
        let va = self.low.alloc(size, align)?;
        match self.windows.set(va) {
            Ok(()) => Ok(va),
            Err(_) => {
                // Another thread won the race; give ours back.
                self.low.free(va, size);
                self.windows
                    .get()
                    .copied()
                    .ok_or(Error::OutOfVa { size, align })
            }
        }
    }

    /// The 1 TiB region for user buffers, which need no 40-bit address.
    pub fn high_region(&self) -> &VaRegion {
        &self.high
    }

    /// Start of the usermode page; the doorbell is at offset 0x90 in it (`DOORBELL_OFFSET`).
    pub fn usermode_ptr(&self) -> *mut u8 {
        match &self.usermode {
            Some((m, _)) => m.as_ptr(),
            // An in-process GPU's doorbell page belongs to its transport, which outlives every channel.
            None => self
                .client
                .in_process_gpu()
                .map_or(std::ptr::null_mut(), |g| g.usermode_page().as_ptr()),
        }
    }

    /// Allocates the usermode object (the doorbell page), maps it for the CPU and keeps both.
    fn open_usermode(&mut self) -> Result<()> {
        let usermode = self.alloc_usermode()?;
        let map = self.client.map_cpu(&CpuMapRequest {
            device: self.device.handle(),
            object: usermode.handle(),
            system: false,
            minor: self.info.minor,
            len: USERMODE_SIZE,
            flags: defs::NVOS33_FLAGS_CACHING_TYPE.val(sys::NVOS33_FLAGS_CACHING_TYPE_UNCACHED),
            fixed: None,
        })?;
        self.usermode = Some((map, usermode));
        Ok(())
    }

    /// Allocates the usermode object, the page whose offset 0x90 is the doorbell.
    ///
    /// From Hopper on, the page is asked for through BAR1 (`bBar1Mapping`), as libcuda, UVM and nvidia-push ask
    /// for it, so that the doorbell travels the path USERD's GP_PUT, written just before it, travels. Rung through
    /// BAR0, the doorbell could take effect first: the front end read the old GP_PUT, found nothing new, and the
    /// submission waited for the next doorbell (GP_GET one short of GP_PUT until then). On an H100 shared with
    /// other processes every process running round trips lost a submission that way within seconds of another
    /// process starting to launch. RM gives the BAR0 page itself where BAR1 is off (coherent platforms).
    pub(crate) fn alloc_usermode(&self) -> Result<Object> {
        let class = self.pick_class("usermode", USERMODE_CLASSES)?;
        if class < sys::HOPPER_USERMODE_A {
            return Object::alloc::<()>(
                &self.client,
                Some(&self.subdevice),
                class,
                None,
                "USERMODE",
            );
        }
        let mut params = sys::NV_HOPPER_USERMODE_A_PARAMS {
            bBar1Mapping: 1,
            bPriv: 0,
        };
        Object::alloc(
            &self.client,
            Some(&self.subdevice),
            class,
            Some(&mut params),
            "USERMODE (BAR1 doorbell)",
        )
    }

    pub(crate) fn uuid(&self) -> sys::NvProcessorUuid {
        sys::NvProcessorUuid {
            uuid: self.info.uuid_bytes,
        }
    }
}

/// The environment variable that, set to `0`, keeps [`GpuCore::open`] from asking for the performance boost
/// CUDA asks for ([`GpuCore::request_max_performance`]).
pub const PERF_BOOST_ENV: &str = "APEX_PERF_BOOST";

/// Whether the performance boost is wanted, given the value of [`PERF_BOOST_ENV`]: yes unless it says `0`,
/// `off`, `no` or `false`.
pub(crate) fn perf_boost_wanted(value: Option<&std::ffi::OsStr>) -> bool {
    !value.and_then(|v| v.to_str()).is_some_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "0" | "off" | "no" | "false"
        )
    })
}

/// The boost libcuda asks for when it creates a context (an RM trace of a CUDA program, `flags=0x12
/// duration=0xffffffff`): to the highest P-state, marked as CUDA's, until cleared (RM clears it when the client
/// goes).
pub fn perf_boost_params() -> sys::NV2080_CTRL_PERF_BOOST_PARAMS {
    sys::NV2080_CTRL_PERF_BOOST_PARAMS {
        flags: sys::NV2080_CTRL_PERF_BOOST_FLAGS_CMD_BOOST_TO_MAX
            | (sys::NV2080_CTRL_PERF_BOOST_FLAGS_CUDA_YES << 4),
        duration: sys::NV2080_CTRL_PERF_BOOST_DURATION_INFINITE,
    }
}

impl Drop for GpuCore {
    fn drop(&mut self) {
        // The usermode page is unmapped before its object is freed; the rest is freed by field order and
        // by the root client, which takes every remaining object with it.
        self.usermode = None;
        if self.attachment.is_some() {
            // The UVM VA space and its GPU registration are CUDA's.
            return;
        }
        let mut p = sys::UVM_UNREGISTER_GPU_VASPACE_PARAMS {
            gpuUuid: self.uuid(),
            ..Default::default()
        };
        let _ = self.client.uvm_call(
            sys::UVM_UNREGISTER_GPU_VASPACE,
            &mut p,
            "UVM_UNREGISTER_GPU_VASPACE",
            |p| p.rmStatus,
        );
        let mut p = sys::UVM_UNREGISTER_GPU_PARAMS {
            gpu_uuid: self.uuid(),
            ..Default::default()
        };
        let _ = self
            .client
            .uvm_call(sys::UVM_UNREGISTER_GPU, &mut p, "UVM_UNREGISTER_GPU", |p| {
                p.rmStatus
            });
    }
}

/// Usermode (doorbell) classes, newest first.
pub const USERMODE_CLASSES: &[u32] = &[
    sys::BLACKWELL_USERMODE_A,
    sys::HOPPER_USERMODE_A,
    sys::AMPERE_USERMODE_A,
    sys::TURING_USERMODE_A,
    sys::VOLTA_USERMODE_A,
];

/// The device and subdevice objects of GPU `device_instance` and the classes it lists.
pub(crate) fn device_objects(
    client: &Arc<Client>,
    device_instance: u32,
) -> Result<(Arc<Object>, Arc<Object>, Vec<u32>)> {
    let mut dp = sys::NV0080_ALLOC_PARAMETERS {
        deviceId: device_instance,
        hClientShare: client.handle(),
        vaMode: sys::NV_DEVICE_ALLOCATION_VAMODE_OPTIONAL_MULTIPLE_VASPACES,
        ..Default::default()
    };
    let device = Arc::new(Object::alloc(
        client,
        None,
        sys::NV01_DEVICE_0,
        Some(&mut dp),
        "NV01_DEVICE_0",
    )?);
    let mut sp = sys::NV2080_ALLOC_PARAMETERS { subDeviceId: 0 };
    let subdevice = Arc::new(Object::alloc(
        client,
        Some(&device),
        sys::NV20_SUBDEVICE_0,
        Some(&mut sp),
        "NV20_SUBDEVICE_0",
    )?);
    let mut cl = sys::NV0080_CTRL_GPU_GET_CLASSLIST_V2_PARAMS::default();
    device.ctrl(&mut cl)?;
    let n = (cl.numClasses as usize).min(cl.classList.len());
    Ok((device, subdevice, cl.classList[..n].to_vec()))
}

/// The low region (below 1 TiB; candidates every 64 GiB so several GPUs in one process each find one) and the
/// high region.
pub(crate) fn reserve_regions() -> Result<(VaRegion, VaRegion)> {
    let low = VaRegion::reserve(
        LOW_REGION_SIZE,
        (1..15u64).map(|i| i * LOW_REGION_SIZE),
        LOW_REGION_LIMIT,
    )?;
    let high = VaRegion::reserve(HIGH_REGION_SIZE, [], u64::MAX)?;
    Ok((low, high))
}

/// The UUID of the GPU RM calls `gpu_id`, in binary.
fn gpu_uuid(client: &Client, gpu_id: u32) -> Result<[u8; 16]> {
    let mut p = sys::NV0000_CTRL_GPU_GET_UUID_FROM_GPU_ID_PARAMS {
        gpuId: gpu_id,
        flags: sys::NV0000_CTRL_CMD_GPU_GET_UUID_FROM_GPU_ID_FLAGS_FORMAT_BINARY,
        ..Default::default()
    };
    client.ctrl(client.handle(), &mut p)?;
    let mut u = [0u8; 16];
    u.copy_from_slice(&p.gpuUuid[..16]);
    Ok(u)
}

/// The loaded module's version, or [`Error::DriverBranch`] unless it is of the branch APEX's structures come from.
fn supported_driver_version(ctl: &OwnedFd) -> Result<String> {
    let driver_version = query_driver_version(ctl)?;
    let branch = driver_version
        .split('.')
        .next()
        .and_then(|b| b.parse::<u32>().ok());
    if branch != Some(HEADERS_BRANCH) {
        return Err(Error::DriverBranch {
            found: driver_version,
            expected: HEADERS_BRANCH,
        });
    }
    Ok(driver_version)
}

pub(super) fn gpu_info(
    sub: &Object,
    index: usize,
    card: &sys::nv_ioctl_card_info_t,
    driver_version: String,
) -> Result<GpuInfo> {
    let mut name = sys::NV2080_CTRL_GPU_GET_NAME_STRING_PARAMS::default();
    sub.ctrl(&mut name)?;
    // SAFETY: gpuNameStringFlags = 0 asks for ASCII, so the `ascii` member of the union is the one written.
    let name = c_string(unsafe { &name.gpuNameString.ascii });

    let mut gid = sys::NV2080_CTRL_GPU_GET_GID_INFO_PARAMS {
        flags: sys::NV2080_GPU_CMD_GPU_GET_GID_FLAGS_FORMAT_BINARY,
        length: 16,
        ..Default::default()
    };
    sub.ctrl(&mut gid)?;
    let mut uuid_bytes = [0u8; 16];
    uuid_bytes.copy_from_slice(&gid.data[..16]);

    let indices = [
        sys::NV2080_CTRL_GR_INFO_INDEX_SM_VERSION,
        sys::NV2080_CTRL_GR_INFO_INDEX_MAX_WARPS_PER_SM,
        sys::NV2080_CTRL_GR_INFO_INDEX_LITTER_NUM_TPC_PER_GPC,
        sys::NV2080_CTRL_GR_INFO_INDEX_LITTER_NUM_SM_PER_TPC,
    ];
    let mut list = indices.map(|index| sys::NV2080_CTRL_GR_INFO { index, data: 0 });
    let mut gr = sys::NV2080_CTRL_GR_GET_INFO_PARAMS {
        grInfoListSize: list.len() as u32,
        grInfoList: list.as_mut_ptr().cast(),
        ..Default::default()
    };
    sub.ctrl(&mut gr)?;
    let [sm_raw, warps, tpcs_per_gpc_max, sms_per_tpc] = list.map(|i| i.data);
    // RM encodes the SM version as 0xMMmm (0x0900 = sm_90).
    let sm_version = ((sm_raw >> 8) & 0xff) * 10 + (sm_raw & 0xff).min(9);

    let mut gpc = sys::NV2080_CTRL_GR_GET_GPC_MASK_PARAMS::default();
    sub.ctrl(&mut gpc)?;
    let mut tpc_count = 0;
    for gpc_id in (0..32).filter(|g| gpc.gpcMask & (1 << g) != 0) {
        let mut tpc = sys::NV2080_CTRL_GR_GET_TPC_MASK_PARAMS {
            gpcId: gpc_id,
            ..Default::default()
        };
        sub.ctrl(&mut tpc)?;
        tpc_count += tpc.tpcMask.count_ones();
    }

    let mut fb = sys::NV2080_CTRL_FB_GET_INFO_V2_PARAMS {
        fbInfoListSize: 1,
        ..Default::default()
    };
    fb.fbInfoList[0].index = sys::NV2080_CTRL_FB_INFO_INDEX_TOTAL_RAM_SIZE;
    sub.ctrl(&mut fb)?;
    // Reported in KiB.
    let memory_bytes = u64::from(fb.fbInfoList[0].data) << 10;

    let pci = &card.pci_info;
    Ok(GpuInfo {
        index,
        minor: card.minor_number,
        name,
        uuid: format_uuid(&uuid_bytes),
        uuid_bytes,
        pci_bus_id: format!("{:08x}:{:02x}:{:02x}.0", pci.domain, pci.bus, pci.slot),
        sm_version,
        sm_count: tpc_count * sms_per_tpc,
        gpc_count: gpc.gpcMask.count_ones(),
        tpc_count,
        tpcs_per_gpc_max,
        sms_per_tpc,
        max_warps_per_sm: warps,
        memory_bytes,
        driver_version,
    })
}

/// `GPU-` and the 16 bytes as 8-4-4-4-12 hex digits, the form nvidia-smi prints.
pub fn format_uuid(b: &[u8; 16]) -> String {
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_prints_like_nvidia_smi() {
        let b = [
            0xde, 0x91, 0x8d, 0x9d, 0xe2, 0x4e, 0x30, 0xae, 0x6e, 0xf5, 0x43, 0xa3, 0xfe, 0xaf,
            0x0a, 0x39,
        ];
        assert_eq!(format_uuid(&b), "GPU-de918d9d-e24e-30ae-6ef5-43a3feaf0a39");
    }

    #[test]
    fn the_boost_is_libcudas_and_can_be_turned_off() {
        // An RM trace of libcuda creating a context: PERF_BOOST flags=0x12 duration=0xffffffff.
        let p = perf_boost_params();
        assert_eq!((p.flags, p.duration), (0x12, 0xffff_ffff));
        use std::ffi::OsStr;
        assert!(perf_boost_wanted(None));
        assert!(perf_boost_wanted(Some(OsStr::new("1"))));
        for off in ["0", "off", "NO", " false "] {
            assert!(!perf_boost_wanted(Some(OsStr::new(off))), "{off}");
        }
    }
}
