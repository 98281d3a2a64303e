//! Finding the RM objects of a CUDA context in this process, so APEX can build its channels inside CUDA's
//! channel group and address space (docs/attach-cuda.md, measured on driver 580.159.04).
//!
//! RM binds a client to the open file it was created on, so CUDA's object table is read through CUDA's own
//! `/dev/nvidiactl` descriptor (found in `/proc/self/fd`, duplicated for the duration of the search). The objects
//! APEX uses are then duplicated into APEX's own client (`NV_ESC_RM_DUP_OBJECT`, allowed within one process by
//! RM's default share policy), and channel registration and mappings go through CUDA's UVM descriptor, the one
//! that owns the address space.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;

use tracing::debug;

use super::client::{Client, Handle};
use super::control::{ClientGetAccessRights, ClientGetChildHandle, ClientGetHandleInfo, RmControl};
use super::error::check;
use super::ioctl::{nv_escape, uvm_ioctl};
use super::{Error, Result, sys};

/// `NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO_INDEX_PARENT` and `..._CLASSID`.
const HANDLE_INFO_PARENT: u32 = 1;
const HANDLE_INFO_CLASSID: u32 = 2;
/// RM's internal (NVOC) class id of `Device`, which GET_CHILD_HANDLE takes instead of the class number
/// (generated/g_device_nvoc.h; the same in branches 535 to 595).
const NVOC_ID_DEVICE: u32 = 0x00e0_ac20;
/// RM's internal (NVOC) class id of `KernelChannelGroupApi`, a channel group (generated/
/// g_kernel_channel_group_api_nvoc.c).
const NVOC_ID_KERNEL_CHANNEL_GROUP_API: u32 = 0x002b_5b80;
/// What [`RmObject::parent`] holds where the scan did not read it (no object's parent is handle 0).
pub const PARENT_NOT_READ: Handle = 0;
/// Root client handles: RM hands out `0xc1d00000 | index` from one counter (resserv/rs_server.c).
const CLIENT_BASE: u32 = 0xc1d0_0000;
const CLIENT_INDEX_MASK: u32 = 0x000f_ffff;
/// Client indices below APEX's own that are searched for CUDA's client.
const CLIENT_WINDOW: u32 = 4096;
/// `RS_ACCESS_DUP_OBJECT`: bit 0 of the access mask.
const ACCESS_DUP: u32 = 1;
/// Handles scanned from the base of CUDA's device handle, and how many misses in a row end the scan.
const HANDLE_SCAN: u32 = 0x1_0000;
pub const HANDLE_SCAN_GAP: u32 = 0x1000;
/// The gap a first, quick pass over every client ends its scan at: a context's objects are made together when it
/// is created, with few holes between them, while reading a client that holds no context (a PyTorch process has
/// one beside CUDA's) to the full gap cost 8 ms of the attach (H200, 580.159.04). A second pass with the full gap
/// runs only where the first found nothing.
pub const HANDLE_SCAN_QUICK_GAP: u32 = 0x100;
/// Misses in a row, and handles scanned, after which the scan asks whether it has found what it looks for: each
/// probe is an ioctl (about 4 µs), and the long gap alone cost 18 ms of the attach (H100, 580.159.04).
const HANDLE_SCAN_PAUSE: u32 = 32;
const HANDLE_SCAN_CHECK_EVERY: u32 = 256;

/// The objects of a client's handles `base`, `base + 1`, ... as `probe` answers for each (`None`: no such handle),
/// in handle order. The scan ends after `gap` misses in a row ([`HANDLE_SCAN_GAP`]: the end of the table; libcuda numbers
/// its objects from one base, and freed ones leave holes), or earlier once `enough` says the objects found so far
/// hold what the caller looks for; `enough` is asked at each run of `HANDLE_SCAN_PAUSE` misses and every
/// `HANDLE_SCAN_CHECK_EVERY` handles that found something new. Objects with higher handles than the end are not
/// read: a caller that needs the oldest of something (the lowest handle) has it by then.
pub fn scan_handles(
    base: Handle,
    gap: u32,
    mut probe: impl FnMut(Handle) -> Option<RmObject>,
    mut enough: impl FnMut(&[RmObject]) -> bool,
) -> Vec<RmObject> {
    let mut out = Vec::new();
    let mut last_hit = 0;
    let mut checked = 0;
    for i in 0..HANDLE_SCAN {
        let missed = i - last_hit;
        if missed > gap {
            break;
        }
        let pause = missed == HANDLE_SCAN_PAUSE || i % HANDLE_SCAN_CHECK_EVERY == 0;
        if pause && out.len() > checked {
            checked = out.len();
            if enough(&out) {
                break;
            }
        }
        if let Some(o) = probe(base.wrapping_add(i)) {
            out.push(o);
            last_hit = i;
        }
    }
    out
}

/// Whether the attach looks at the parent of an object of `class` (see [`pick_context_objects`] and
/// [`client_devices`]): devices, their subdevices, VA spaces and channel groups, the channels in a group (GPFIFO
/// classes, `0x??6f`) and the compute objects of a channel (`compute`).
pub fn parent_looked_at(class: u32, compute: &[u32]) -> bool {
    matches!(
        class,
        sys::NV01_DEVICE_0
            | sys::NV20_SUBDEVICE_0
            | sys::FERMI_VASPACE_A
            | sys::KEPLER_CHANNEL_GROUP_A
    ) || class & 0xff == 0x6f
        || compute.contains(&class)
}

/// Compute engine classes (every row of the GPU-generation table, newest first): a channel with one of these under
/// it runs kernels.
pub fn compute_object_classes() -> Vec<u32> {
    crate::hw::generation::compute_classes().collect()
}

/// One object of a client: its handle, its parent and its class number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RmObject {
    /// The object's handle in its client.
    pub handle: Handle,
    /// Its parent's handle (the client's for top-level objects); [`PARENT_NOT_READ`] where a scan skipped it (an
    /// object whose parent the attach never looks at: see [`parent_looked_at`]).
    pub parent: Handle,
    /// Its class number (`NV01_DEVICE_0`, `KEPLER_CHANNEL_GROUP_A`, ...).
    pub class: u32,
}

/// The objects of a CUDA context that an attached APEX channel uses, as handles in CUDA's client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContextObjects {
    /// CUDA's device object.
    pub device: Handle,
    /// CUDA's subdevice object under it.
    pub subdevice: Handle,
    /// The channel group whose channels carry a compute object: the one CUDA's kernels run in (the oldest, when
    /// several contexts of the process use this GPU).
    pub compute_group: Handle,
    /// Every such group on the device, oldest first: one per CUDA context on this GPU (measured: a context made with
    /// `cuCtxCreate` beside the primary one adds a compute group and shares the primary's VA spaces).
    pub compute_groups: Vec<Handle>,
    /// VA spaces under the device, in handle order (the context's own comes first in libcuda's table).
    pub vaspaces: Vec<Handle>,
}

/// Picks the compute channel group, the subdevice and the VA spaces of `device` out of a client's objects.
/// `None` when the table has no channel group with a compute channel (CUDA creates it with the context).
pub fn pick_context_objects(
    objects: &[RmObject],
    device: Handle,
    compute_classes: &[u32],
) -> Option<ContextObjects> {
    let children = |parent: Handle| objects.iter().filter(move |o| o.parent == parent);
    let mut compute_groups: Vec<Handle> = objects
        .iter()
        .filter(|o| o.parent == device && o.class == sys::KEPLER_CHANNEL_GROUP_A)
        .filter(|g| {
            children(g.handle)
                .any(|ch| children(ch.handle).any(|e| compute_classes.contains(&e.class)))
        })
        .map(|g| g.handle)
        .collect();
    compute_groups.sort_unstable();
    let compute_group = *compute_groups.first()?;
    let subdevice = children(device)
        .find(|o| o.class == sys::NV20_SUBDEVICE_0)?
        .handle;
    let mut vaspaces: Vec<Handle> = children(device)
        .filter(|o| o.class == sys::FERMI_VASPACE_A)
        .map(|o| o.handle)
        .collect();
    vaspaces.sort_unstable();
    (!vaspaces.is_empty()).then_some(ContextObjects {
        device,
        subdevice,
        compute_group,
        compute_groups,
        vaspaces,
    })
}

/// The devices of a client's object table that could hold a CUDA context, in handle order: every
/// `NV01_DEVICE_0` directly under the client, and `first` (the one RM's child lookup found, listed even if the scan
/// missed it). libcuda's client holds a device object for every GPU it can see, not only the GPUs that have a
/// context, so the device of a context on a GPU other than the first is found here, never by the child lookup alone.
pub fn client_devices(objects: &[RmObject], client: Handle, first: Handle) -> Vec<Handle> {
    let mut devices: Vec<Handle> = objects
        .iter()
        .filter(|o| o.parent == client && o.class == sys::NV01_DEVICE_0)
        .map(|o| o.handle)
        .chain(std::iter::once(first))
        .collect();
    devices.sort_unstable();
    devices.dedup();
    devices
}

/// Every context candidate of a client's object table: for each of its devices (see [`client_devices`]), the
/// compute channel group, subdevice and VA spaces, where that device has a compute channel group. Which GPU each
/// one runs on is asked of RM through its subdevice by the caller.
pub fn context_candidates(
    objects: &[RmObject],
    client: Handle,
    first: Handle,
    compute_classes: &[u32],
) -> Vec<ContextObjects> {
    client_devices(objects, client, first)
        .into_iter()
        .filter_map(|d| pick_context_objects(objects, d, compute_classes))
        .collect()
}

/// CUDA's RM client in this process, reachable through a duplicate of the descriptor it is bound to.
#[derive(Debug)]
pub struct ForeignClient {
    /// The client's root handle.
    pub handle: Handle,
    ctl: OwnedFd,
}

impl ForeignClient {
    /// NV_ESC_RM_CONTROL on one of the client's objects, through the client's own open file: the command `P` is
    /// bound to ([`RmControl`]), with `params`.
    fn ctrl<P: RmControl>(&self, object: Handle, params: &mut P) -> Result<()> {
        let what = P::NAME;
        let mut p = sys::NVOS54_PARAMETERS {
            hClient: self.handle,
            hObject: object,
            cmd: P::CMD,
            params: (params as *mut P).cast(),
            paramsSize: size_of::<P>() as u32,
            ..Default::default()
        };
        // SAFETY: NVOS54_PARAMETERS is the RM_CONTROL argument; params points to a live, exclusively borrowed `P`
        // of paramsSize bytes, which `P: RmControl` makes the parameter struct of `P::CMD`.
        unsafe { nv_escape(&self.ctl, sys::NV_ESC_RM_CONTROL, &mut p, what)? };
        check("RM_CONTROL", what, p.status)
    }

    /// The class number of object `h` of this client (an error for a handle the client does not hold).
    fn class_of(&self, h: Handle) -> Result<u32> {
        let mut c = ClientGetHandleInfo {
            h_object: h,
            index: HANDLE_INFO_CLASSID,
            result: 0,
        };
        self.ctrl(self.handle, &mut c)?;
        Ok(c.result as u32)
    }

    /// The parent's handle of object `h` of this client.
    fn parent_of(&self, h: Handle) -> Result<Handle> {
        let mut p = ClientGetHandleInfo {
            h_object: h,
            index: HANDLE_INFO_PARENT,
            result: 0,
        };
        self.ctrl(self.handle, &mut p)?;
        Ok(p.result as u32)
    }

    /// The first device object RM's child lookup finds under the client.
    fn first_device(&self) -> Result<Handle> {
        self.child_of_type(self.handle, NVOC_ID_DEVICE)
    }

    /// The first child of `parent` whose RM-internal class is `nvoc_class` (0 for none).
    fn child_of_type(&self, parent: Handle, nvoc_class: u32) -> Result<Handle> {
        let mut q = ClientGetChildHandle {
            h_parent: parent,
            class_id: nvoc_class,
            h_object: 0,
        };
        self.ctrl(self.handle, &mut q)?;
        Ok(q.h_object)
    }

    /// Whether the client's first device holds a channel group, asked of RM in two controls: CUDA's client does
    /// once a context exists on that GPU; a client that only queries the GPU does not. False also when RM does not
    /// say. Clients that do are read first: [`scan_handles`] reads a whole table, one control per handle, before it
    /// can conclude that a client holds no context.
    pub fn first_device_has_channel_group(&self) -> bool {
        self.first_device()
            .and_then(|d| self.child_of_type(d, NVOC_ID_KERNEL_CHANNEL_GROUP_API))
            .is_ok_and(|group| group != 0)
    }

    /// The client's objects and the first device RM's child lookup finds: a scan of handles from that device
    /// handle's base (libcuda numbers all its objects, of every GPU, from one base; see [`scan_handles`]), ended by
    /// `gap` misses in a row or once `enough(objects, device)` says the objects so far hold what the caller needs.
    pub fn objects(
        &self,
        gap: u32,
        mut enough: impl FnMut(&[RmObject], Handle) -> bool,
    ) -> Result<(Handle, Vec<RmObject>)> {
        let device = self.first_device()?;
        let base = device & 0xffff_0000;
        let compute = compute_object_classes();
        let out = scan_handles(
            base,
            gap,
            |h| {
                // Most of a table is the program's memory: its parents are never looked at, so not read (half the
                // controls of a table read).
                let class = self.class_of(h).ok()?;
                let parent = if parent_looked_at(class, &compute) {
                    self.parent_of(h).ok()?
                } else {
                    PARENT_NOT_READ
                };
                Some(RmObject {
                    handle: h,
                    parent,
                    class,
                })
            },
            |objects| enough(objects, device),
        );
        debug!(
            client = format_args!("{:#x}", self.handle),
            device = format_args!("{device:#x}"),
            objects = out.len(),
            "read the CUDA client's object table"
        );
        Ok((device, out))
    }

    /// The RM GPU id of a subdevice of this client (to match it with APEX's own view of the GPU).
    pub fn gpu_id(&self, subdevice: Handle) -> Result<u32> {
        let mut p = sys::NV2080_CTRL_GPU_GET_ID_PARAMS::default();
        self.ctrl(subdevice, &mut p)?;
        Ok(p.gpuId)
    }
}

/// The process's open descriptors whose target is `path`.
fn fds_of(path: &str) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return Vec::new();
    };
    let mut fds: Vec<i32> = dir
        .flatten()
        .filter(|e| std::fs::read_link(e.path()).ok() == Some(PathBuf::from(path)))
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    fds.sort_unstable();
    fds
}

/// A close-on-exec duplicate of descriptor `fd` of this process.
fn dup_fd(fd: i32) -> Result<OwnedFd> {
    // SAFETY: `fd` was just listed in /proc/self/fd; it is only borrowed for the fcntl that duplicates it. If
    // another thread closed it in between, the fcntl fails (or duplicates what now has that number, which the
    // RM and UVM checks below then reject).
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    rustix::io::fcntl_dupfd_cloexec(borrowed, 0).map_err(|e| Error::Open {
        path: format!("/proc/self/fd/{fd}"),
        source: e.into(),
    })
}

/// Same-process RM clients created before `own` (CUDA's among them), each with the descriptor it is bound to.
pub fn foreign_clients(own: &Client) -> Result<Vec<ForeignClient>> {
    let own_fd = own.ctl()?.as_raw_fd();
    let ctl_fds: Vec<i32> = fds_of("/dev/nvidiactl")
        .into_iter()
        .filter(|&fd| fd != own_fd)
        .collect();
    let mut out = Vec::new();
    let index = own.handle() & CLIENT_INDEX_MASK;
    for k in 1..=CLIENT_WINDOW.min(index) {
        let h = CLIENT_BASE | ((index - k) & CLIENT_INDEX_MASK);
        if super::client::is_own_client(h) {
            continue;
        }
        let mut p = ClientGetAccessRights {
            h_object: h,
            h_client: h,
            mask: 0,
        };
        // Asked of our own client: it looks the other client up without checking our descriptor against it.
        if own.ctrl(own.handle(), &mut p).is_err() || p.mask & ACCESS_DUP == 0 {
            continue;
        }
        // Only the descriptor the client was created on answers for it (strict client validation).
        for &fd in &ctl_fds {
            let Ok(ctl) = dup_fd(fd) else { continue };
            let c = ForeignClient { handle: h, ctl };
            if c.class_of(h).is_ok() {
                debug!(
                    client = format_args!("{h:#x}"),
                    fd, "found a same-process RM client"
                );
                out.push(c);
                break;
            }
        }
    }
    Ok(out)
}

/// Duplicates of the process's initialised UVM descriptors other than `exclude` (the ones APEX opened):
/// CUDA's VA-space descriptor among them. UVM_PAGEABLE_MEM_ACCESS succeeds only on an initialised VA space.
pub fn foreign_uvm_fds(exclude: &[i32]) -> Vec<OwnedFd> {
    fds_of("/dev/nvidia-uvm")
        .into_iter()
        .filter(|fd| !exclude.contains(fd))
        .filter_map(|fd| dup_fd(fd).ok())
        .filter(|fd| {
            let mut p = sys::UVM_PAGEABLE_MEM_ACCESS_PARAMS::default();
            // SAFETY: UVM_PAGEABLE_MEM_ACCESS_PARAMS is the argument of UVM_PAGEABLE_MEM_ACCESS.
            let r = unsafe {
                uvm_ioctl(
                    fd,
                    sys::UVM_PAGEABLE_MEM_ACCESS,
                    &mut p,
                    "UVM_PAGEABLE_MEM_ACCESS",
                )
            };
            r.is_ok() && p.rmStatus == 0
        })
        .collect()
}

/// Whether `uuid`'s GPU is registered in the UVM VA space behind `fd` (read-only: UVM answers
/// `NV_ERR_INVALID_DEVICE` for a GPU the VA space does not have). CUDA's VA space has the GPU of its context; a
/// process can hold other initialised UVM descriptors (measured: a PyTorch process holds two).
pub fn uvm_has_gpu(fd: &OwnedFd, uuid: [u8; 16]) -> bool {
    let mut p = sys::UVM_PAGEABLE_MEM_ACCESS_ON_GPU_PARAMS {
        gpu_uuid: sys::NvProcessorUuid { uuid },
        ..Default::default()
    };
    // SAFETY: UVM_PAGEABLE_MEM_ACCESS_ON_GPU_PARAMS is the argument of UVM_PAGEABLE_MEM_ACCESS_ON_GPU.
    let r = unsafe {
        uvm_ioctl(
            fd,
            sys::UVM_PAGEABLE_MEM_ACCESS_ON_GPU,
            &mut p,
            "UVM_PAGEABLE_MEM_ACCESS_ON_GPU",
        )
    };
    r.is_ok() && p.rmStatus == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn o(handle: Handle, parent: Handle, class: u32) -> RmObject {
        RmObject {
            handle,
            parent,
            class,
        }
    }

    /// A table as `probe` sees it: `objects` at their handles, everything else a miss; counts the probes.
    fn table_probe(
        objects: &[RmObject],
    ) -> (
        impl FnMut(Handle) -> Option<RmObject> + '_,
        std::rc::Rc<std::cell::Cell<u32>>,
    ) {
        let probes = std::rc::Rc::new(std::cell::Cell::new(0));
        let counter = probes.clone();
        let probe = move |h: Handle| {
            counter.set(counter.get() + 1);
            objects.iter().find(|o| o.handle == h).copied()
        };
        (probe, probes)
    }

    #[test]
    fn the_scan_reads_the_whole_table_through_holes_and_stops_after_a_long_gap() {
        let base = 0x5c00_0000;
        let mut table: Vec<RmObject> = (1..40).map(|i| o(base + i, 0xc1d0_0001, 0x40)).collect();
        // A hole of freed objects shorter than the long gap, then more objects.
        table.extend((0..10).map(|i| o(base + 0x800 + i, 0xc1d0_0001, 0x40)));
        let (probe, probes) = table_probe(&table);
        let got = scan_handles(base, HANDLE_SCAN_GAP, probe, |_| false);
        assert_eq!(got, table, "every object, in handle order");
        // The scan ended one long gap after the last object.
        assert_eq!(probes.get(), 0x800 + 9 + HANDLE_SCAN_GAP + 1);
        // A hole longer than the gap ends the table.
        table.push(o(base + 0x3000, 0xc1d0_0001, 0x40));
        let (probe, _) = table_probe(&table);
        assert_eq!(
            scan_handles(base, HANDLE_SCAN_GAP, probe, |_| false).len(),
            table.len() - 1
        );
        // The quick pass stops at the first hole longer than its gap, after few probes.
        let (probe, probes) = table_probe(&table);
        let got = scan_handles(base, HANDLE_SCAN_QUICK_GAP, probe, |_| false);
        assert_eq!(got, table[..39]);
        assert_eq!(probes.get(), 39 + HANDLE_SCAN_QUICK_GAP + 1);
    }

    #[test]
    fn the_scan_stops_early_once_enough_is_found_and_asks_rarely() {
        let base = 0x5c00_0000;
        let table: Vec<RmObject> = (1..100)
            .chain(0x200..0x240)
            .map(|i| o(base + i, 0xc1d0_0001, 0x40 + i))
            .collect();
        // Looking for the object at base + 50: found in the first run of objects, so the scan ends at the first
        // pause (the run of misses after base + 99), without reading the later objects or the long gap.
        let (probe, probes) = table_probe(&table);
        let mut asked = 0;
        let got = scan_handles(base, HANDLE_SCAN_GAP, probe, |objs| {
            asked += 1;
            objs.iter().any(|o| o.handle == base + 50)
        });
        assert_eq!(got.len(), 99);
        assert_eq!(probes.get(), 99 + HANDLE_SCAN_PAUSE);
        assert_eq!(asked, 1);
        // Looking for something in the second run: the first pause says no, the scan goes on through the hole.
        let (probe, probes) = table_probe(&table);
        let got = scan_handles(base, HANDLE_SCAN_GAP, probe, |objs| {
            objs.iter().any(|o| o.handle == base + 0x220)
        });
        assert_eq!(got.len(), 99 + 0x40);
        assert_eq!(probes.get(), 0x23f + HANDLE_SCAN_PAUSE);
        // A dense table is asked every few hundred handles, so a target early in it ends the scan early.
        let dense: Vec<RmObject> = (1..5000).map(|i| o(base + i, 0xc1d0_0001, 0x40)).collect();
        let (probe, probes) = table_probe(&dense);
        let got = scan_handles(base, HANDLE_SCAN_GAP, probe, |objs| {
            objs.iter().any(|o| o.handle == base + 10)
        });
        assert_eq!(got.len(), HANDLE_SCAN_CHECK_EVERY as usize - 1);
        assert_eq!(probes.get(), HANDLE_SCAN_CHECK_EVERY);
    }

    /// The shape of libcuda's table on an H100 (probes/attach, driver 580.159.04): a GR group with compute
    /// channels, copy-only groups, two VA spaces.
    #[test]
    fn the_compute_group_is_the_one_with_compute_channels() {
        let dev = 0x5c00_0002;
        let table = [
            o(dev, 0xc1d0_0037, sys::NV01_DEVICE_0),
            o(0x5c00_0003, dev, sys::NV20_SUBDEVICE_0),
            o(0x5c00_000a, dev, sys::FERMI_VASPACE_A),
            o(0x5c00_0009, dev, sys::FERMI_VASPACE_A),
            // A copy-only group first: it must not be picked.
            o(0x5c00_0010, dev, sys::KEPLER_CHANNEL_GROUP_A),
            o(0x5c00_0011, 0x5c00_0010, sys::HOPPER_CHANNEL_GPFIFO_A),
            o(0x5c00_0012, 0x5c00_0011, sys::HOPPER_DMA_COPY_A),
            o(0x5c00_0015, dev, sys::KEPLER_CHANNEL_GROUP_A),
            o(0x5c00_001c, 0x5c00_0015, sys::HOPPER_CHANNEL_GPFIFO_A),
            o(0x5c00_001d, 0x5c00_001c, sys::HOPPER_COMPUTE_A),
        ];
        let got = pick_context_objects(&table, dev, &[sys::HOPPER_COMPUTE_A]).unwrap();
        assert_eq!(got.compute_group, 0x5c00_0015);
        assert_eq!(got.compute_groups, [0x5c00_0015]);
        assert_eq!(got.subdevice, 0x5c00_0003);
        assert_eq!(got.vaspaces, [0x5c00_0009, 0x5c00_000a]);
        // Without a compute channel there is nothing to attach to.
        assert!(pick_context_objects(&table[..7], dev, &[sys::HOPPER_COMPUTE_A]).is_none());
        // Objects of another device do not count.
        assert!(pick_context_objects(&table, 0x5c00_0099, &[sys::HOPPER_COMPUTE_A]).is_none());
        // A second context's compute group (made later, listed first here): the oldest is picked, both are named.
        let mut two = vec![
            o(0x5c00_009f, dev, sys::KEPLER_CHANNEL_GROUP_A),
            o(0x5c00_00a6, 0x5c00_009f, sys::HOPPER_CHANNEL_GPFIFO_A),
            o(0x5c00_00a7, 0x5c00_00a6, sys::HOPPER_COMPUTE_A),
        ];
        two.extend_from_slice(&table);
        let got = pick_context_objects(&two, dev, &[sys::HOPPER_COMPUTE_A]).unwrap();
        assert_eq!(got.compute_group, 0x5c00_0015);
        assert_eq!(got.compute_groups, [0x5c00_0015, 0x5c00_009f]);
    }

    /// The scan reads the parent only of classes the attach looks under; what it picks from such a table is what
    /// it picks from the whole one. The classes are those of libcuda's table on an H100 (driver 580.159.04).
    #[test]
    fn parents_read_only_where_looked_at_pick_the_same_context() {
        let client = 0xc1d0_00b5;
        let dev = 0x5c00_0002;
        let sub = 0x5c00_0003;
        let compute = [sys::HOPPER_COMPUTE_A];
        let full = [
            o(0x5c00_0001, client, 0xcb33),
            o(dev, client, sys::NV01_DEVICE_0),
            o(sub, dev, sys::NV20_SUBDEVICE_0),
            o(0x5c00_0004, sub, 0x2081),
            o(0x5c00_0005, sub, 0xc661),
            o(0x5c00_0007, sub, 0x90e6),
            o(0x5c00_0009, dev, sys::FERMI_VASPACE_A),
            o(0x5c00_000a, dev, sys::FERMI_VASPACE_A),
            o(0x5c00_000c, dev, 0x50a0),
            o(0x5c00_000e, dev, 0x40),
            o(0x5c00_0015, dev, sys::KEPLER_CHANNEL_GROUP_A),
            o(0x5c00_0016, 0x5c00_0015, 0x9067),
            o(0x5c00_0019, dev, 0x3e),
            o(0x5c00_001c, 0x5c00_0015, sys::HOPPER_CHANNEL_GPFIFO_A),
            o(0x5c00_001d, 0x5c00_001c, sys::HOPPER_COMPUTE_A),
            o(0x5c00_001e, 0x5c00_001c, sys::HOPPER_DMA_COPY_A),
            o(0x5c00_003d, sub, 0x79),
            o(0x5c00_003e, dev, sys::KEPLER_CHANNEL_GROUP_A),
            o(0x5c00_0040, 0x5c00_003e, sys::HOPPER_CHANNEL_GPFIFO_A),
            o(0x5c00_0041, 0x5c00_0040, sys::HOPPER_DMA_COPY_A),
            o(0x5c00_0070, dev, 0x71),
            o(0x5c00_0089, dev, 0x83de),
        ];
        let read: Vec<RmObject> = full
            .iter()
            .map(|x| RmObject {
                parent: if parent_looked_at(x.class, &compute) {
                    x.parent
                } else {
                    PARENT_NOT_READ
                },
                ..*x
            })
            .collect();
        let skipped = read.iter().filter(|x| x.parent == PARENT_NOT_READ).count();
        assert_eq!(skipped, 13, "memory, events, copy objects and the like");
        assert_eq!(
            context_candidates(&read, client, dev, &compute),
            context_candidates(&full, client, dev, &compute)
        );
        let got = pick_context_objects(&read, dev, &compute).unwrap();
        assert_eq!(
            (got.compute_group, got.subdevice, got.vaspaces.clone()),
            (0x5c00_0015, sub, vec![0x5c00_0009, 0x5c00_000a])
        );
        // Every GPFIFO class of the generation table is a channel whose parent is read.
        for c in crate::hw::generation::gpfifo_classes() {
            assert!(parent_looked_at(c, &compute), "{c:#x}");
        }
    }

    /// A client with a device object per GPU and a context only on the second (a process whose device is
    /// `cuda:1`): the child lookup finds the first device, which has no compute group; the candidates are found by
    /// the scan, one per device with a context, each with its own subdevice and VA spaces.
    #[test]
    fn a_context_on_a_later_gpu_is_found_beside_devices_without_one() {
        let client = 0xc1d0_0040;
        let (d0, d1) = (0x5c00_0002, 0x5c00_0020);
        let gpu0 = [
            o(d0, client, sys::NV01_DEVICE_0),
            o(0x5c00_0003, d0, sys::NV20_SUBDEVICE_0),
            o(0x5c00_0004, d0, sys::FERMI_VASPACE_A),
        ];
        let gpu1 = [
            o(d1, client, sys::NV01_DEVICE_0),
            o(0x5c00_0021, d1, sys::NV20_SUBDEVICE_0),
            o(0x5c00_0030, d1, sys::FERMI_VASPACE_A),
            o(0x5c00_0031, d1, sys::FERMI_VASPACE_A),
            o(0x5c00_0040, d1, sys::KEPLER_CHANNEL_GROUP_A),
            o(0x5c00_0041, 0x5c00_0040, sys::HOPPER_CHANNEL_GPFIFO_A),
            o(0x5c00_0042, 0x5c00_0041, sys::HOPPER_COMPUTE_A),
        ];
        let table: Vec<RmObject> = gpu1.iter().chain(&gpu0).copied().collect();
        // A sub-object's class equal to a device's does not make it one: only objects under the client count.
        let mut with_noise = table.clone();
        with_noise.push(o(0x5c00_0050, d1, sys::NV01_DEVICE_0));
        assert_eq!(client_devices(&with_noise, client, d0), [d0, d1]);
        // The lookup's device is kept even when the scan missed it.
        assert_eq!(client_devices(&gpu1, client, d0), [d0, d1]);
        let got = context_candidates(&table, client, d0, &[sys::HOPPER_COMPUTE_A]);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].device, d1);
        assert_eq!(got[0].subdevice, 0x5c00_0021);
        assert_eq!(got[0].compute_group, 0x5c00_0040);
        assert_eq!(got[0].vaspaces, [0x5c00_0030, 0x5c00_0031]);
        // Contexts on both GPUs: one candidate each, in device order, none mixing the other's objects.
        let mut both = table.clone();
        both.extend([
            o(0x5c00_0060, d0, sys::KEPLER_CHANNEL_GROUP_A),
            o(0x5c00_0061, 0x5c00_0060, sys::HOPPER_CHANNEL_GPFIFO_A),
            o(0x5c00_0062, 0x5c00_0061, sys::HOPPER_COMPUTE_A),
        ]);
        let got = context_candidates(&both, client, d0, &[sys::HOPPER_COMPUTE_A]);
        let shape: Vec<_> = got
            .iter()
            .map(|c| (c.device, c.subdevice, c.compute_group, c.vaspaces.clone()))
            .collect();
        assert_eq!(
            shape,
            [
                (d0, 0x5c00_0003, 0x5c00_0060, vec![0x5c00_0004]),
                (d1, 0x5c00_0021, 0x5c00_0040, vec![0x5c00_0030, 0x5c00_0031]),
            ]
        );
        // No device with a context: nothing to attach to.
        assert!(context_candidates(&gpu0, client, d0, &[sys::HOPPER_COMPUTE_A]).is_empty());
    }
}
