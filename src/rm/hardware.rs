//! The hardware transport: RM calls as ioctls on /dev/nvidiactl and /dev/nvidiaN, UVM calls on /dev/nvidia-uvm
//! (NVIDIA open kernel module ABI, branch 580). Also what a GPU is opened with before any client exists: the
//! device nodes, the GPU list and the driver version.

use std::ffi::{CStr, c_void};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock};

use rustix::mm::{MapFlags, ProtFlags, mmap};
use tracing::debug;

use super::client::Client;
use super::error::check;
use super::ioctl::{nv_escape, uvm_ioctl, uvm_ioctl_raw};
use super::mapping::CpuMapping;
use super::transport::{CpuMapRequest, Handle, Transport};
use super::{Error, NvStatus, Result, sys};

/// The kernel driver, reached through one client's descriptors.
#[derive(Debug)]
pub(crate) struct Hardware {
    ctl: OwnedFd,
    uvm: OwnedFd,
    /// A second UVM descriptor, bound to this process's mm by `UVM_MM_INITIALIZE`; held open for the VA space's
    /// life.
    uvm_mm: OnceLock<OwnedFd>,
}

impl Hardware {
    /// Listed among APEX's UVM descriptors (see [`own_uvm_fds`]) for as long as it lives, whether APEX initialised
    /// the VA space or borrows one (a duplicate of CUDA's, for an attached GPU): a later attachment's search for
    /// CUDA's descriptor must not take APEX's duplicate for a second VA space with the GPU.
    fn new(ctl: OwnedFd, uvm: OwnedFd) -> Arc<Hardware> {
        let raw = uvm.as_raw_fd();
        own_uvm_fds(|fds| fds.push(raw));
        Arc::new(Hardware {
            ctl,
            uvm,
            uvm_mm: OnceLock::new(),
        })
    }

    /// A root client on `ctl` with a UVM VA space of its own, initialised on `uvm` (`uvm_mm` binds it to this
    /// process's mm where UVM allows).
    pub(crate) fn client(ctl: OwnedFd, uvm: OwnedFd, uvm_mm: OwnedFd) -> Result<Client> {
        let hw = Hardware::new(ctl, uvm);
        let client = Client::over(hw.clone())?;
        debug!(
            client = format_args!("{:#x}", client.handle()),
            "RM root client allocated"
        );
        let mut init = sys::UVM_INITIALIZE_PARAMS::default();
        client.uvm_call(sys::UVM_INITIALIZE, &mut init, "UVM_INITIALIZE", |p| {
            p.rmStatus
        })?;
        let mut mm = sys::UVM_MM_INITIALIZE_PARAMS {
            uvmFd: hw.uvm.as_raw_fd(),
            ..Default::default()
        };
        // SAFETY: UVM_MM_INITIALIZE_PARAMS is the argument of UVM_MM_INITIALIZE.
        let r = unsafe {
            uvm_ioctl(
                &uvm_mm,
                sys::UVM_MM_INITIALIZE,
                &mut mm,
                "UVM_MM_INITIALIZE",
            )
        };
        // libcuda sees this fail too when another VA space already owns the mm; UVM works without it.
        match r {
            Ok(()) if mm.rmStatus == 0 => {
                let _ = hw.uvm_mm.set(uvm_mm);
            }
            Ok(()) => debug!(status = %NvStatus(mm.rmStatus), "UVM_MM_INITIALIZE declined"),
            Err(e) => debug!(error = %e, "UVM_MM_INITIALIZE declined"),
        }
        Ok(client)
    }

    /// A root client on `ctl` whose UVM calls go to `uvm`, a UVM VA space someone else initialised (CUDA's, for
    /// an attached GPU): nothing is initialised or registered with UVM here.
    pub(crate) fn client_with_foreign_uvm(ctl: OwnedFd, uvm: OwnedFd) -> Result<Client> {
        Client::over(Hardware::new(ctl, uvm))
    }

    /// A root client on `ctl` that shares the UVM VA space behind `uvm` (a duplicate of another APEX client's
    /// descriptor): GPUs of one peer domain register in one VA space, so they can map each other's memory.
    pub(crate) fn client_sharing_uvm(ctl: OwnedFd, uvm: OwnedFd) -> Result<Client> {
        Client::over(Hardware::new(ctl, uvm))
    }
}

impl Drop for Hardware {
    fn drop(&mut self) {
        let raw = self.uvm.as_raw_fd();
        own_uvm_fds(|fds| fds.retain(|&fd| fd != raw));
    }
}

impl Transport for Hardware {
    fn alloc_root(&self) -> Result<Handle> {
        let mut p = sys::NVOS21_PARAMETERS {
            hClass: sys::NV01_ROOT_CLIENT,
            ..Default::default()
        };
        // SAFETY: NVOS21_PARAMETERS is the NV_ESC_RM_ALLOC argument; pAllocParms is null.
        unsafe { nv_escape(&self.ctl, sys::NV_ESC_RM_ALLOC, &mut p, "NV01_ROOT_CLIENT")? };
        check("RM_ALLOC", "NV01_ROOT_CLIENT", p.status)?;
        Ok(p.hObjectNew)
    }

    unsafe fn alloc(
        &self,
        client: Handle,
        parent: Handle,
        class: u32,
        params: *mut c_void,
        _size: usize,
        what: &'static str,
    ) -> Result<Handle> {
        let mut p = sys::NVOS21_PARAMETERS {
            hRoot: client,
            hObjectParent: parent,
            hClass: class,
            pAllocParms: params,
            ..Default::default()
        };
        // SAFETY: NVOS21_PARAMETERS is the RM_ALLOC argument; pAllocParms is null or the class's parameter
        // struct, lent for the call (the caller's contract). RM knows its size from the class.
        unsafe { nv_escape(&self.ctl, sys::NV_ESC_RM_ALLOC, &mut p, what)? };
        check("RM_ALLOC", what, p.status)?;
        debug!(
            class = format_args!("{class:#x}"),
            handle = format_args!("{:#x}", p.hObjectNew),
            what,
            "RM_ALLOC"
        );
        Ok(p.hObjectNew)
    }

    unsafe fn control(
        &self,
        client: Handle,
        object: Handle,
        cmd: u32,
        params: *mut c_void,
        size: usize,
        what: &'static str,
    ) -> Result<()> {
        let mut p = sys::NVOS54_PARAMETERS {
            hClient: client,
            hObject: object,
            cmd,
            params,
            paramsSize: size as u32,
            ..Default::default()
        };
        // SAFETY: NVOS54_PARAMETERS is the RM_CONTROL argument; params points to the command's parameter struct
        // of paramsSize bytes, lent for the call (the caller's contract).
        unsafe { nv_escape(&self.ctl, sys::NV_ESC_RM_CONTROL, &mut p, what)? };
        check("RM_CONTROL", what, p.status)
    }

    fn free(&self, client: Handle, parent: Handle, handle: Handle) -> Result<()> {
        let mut p = sys::NVOS00_PARAMETERS {
            hRoot: client,
            hObjectParent: parent,
            hObjectOld: handle,
            status: 0,
        };
        // SAFETY: NVOS00_PARAMETERS is the RM_FREE argument and holds no pointers.
        unsafe { nv_escape(&self.ctl, sys::NV_ESC_RM_FREE, &mut p, "RM_FREE")? };
        check("RM_FREE", "object", p.status)
    }

    fn dup(
        &self,
        client: Handle,
        parent: Handle,
        src_client: Handle,
        src: Handle,
        what: &'static str,
    ) -> Result<Handle> {
        let mut p = sys::NVOS55_PARAMETERS {
            hClient: client,
            hParent: parent,
            hObject: 0,
            hClientSrc: src_client,
            hObjectSrc: src,
            flags: 0,
            status: 0,
        };
        // SAFETY: NVOS55_PARAMETERS is the NV_ESC_RM_DUP_OBJECT argument and holds no pointers.
        unsafe { nv_escape(&self.ctl, sys::NV_ESC_RM_DUP_OBJECT, &mut p, what)? };
        check("RM_DUP_OBJECT", what, p.status)?;
        Ok(p.hObject)
    }

    unsafe fn uvm(&self, cmd: u32, params: *mut c_void, what: &'static str) -> Result<()> {
        // SAFETY: forwarded to the caller's contract.
        unsafe { uvm_ioctl_raw(&self.uvm, cmd, params, what) }
    }

    fn map_cpu(&self, client: Handle, req: &CpuMapRequest) -> Result<CpuMapping> {
        // RM attaches the mapping to the fd named in the request; the mmap on that fd then consumes it.
        let fd: OwnedFd = if req.system {
            open_node("/dev/nvidiactl")?
        } else {
            open_gpu_node(&self.ctl, req.minor)?
        };
        let mut p = sys::nv_ioctl_nvos33_parameters_with_fd {
            params: sys::NVOS33_PARAMETERS {
                hClient: client,
                hDevice: req.device,
                hMemory: req.object,
                length: req.len as u64,
                flags: req.flags,
                ..Default::default()
            },
            fd: fd.as_raw_fd(),
        };
        // SAFETY: the Linux NV_ESC_RM_MAP_MEMORY argument; it holds no pointers RM dereferences.
        unsafe {
            nv_escape(
                &self.ctl,
                sys::NV_ESC_RM_MAP_MEMORY,
                &mut p,
                "map for the CPU",
            )?
        };
        check("RM_MAP_MEMORY", "map for the CPU", p.params.status)?;
        let mut mflags = MapFlags::SHARED;
        if req.fixed.is_some() {
            mflags |= MapFlags::FIXED;
        }
        let addr = req.fixed.map_or(std::ptr::null_mut(), |a| a as *mut c_void);
        // SAFETY: maps the device memory RM just prepared on `fd`; with FIXED the target lies inside one of
        // our PROT_NONE reservations (the request's contract), so nothing of anyone else is replaced.
        let ptr = unsafe {
            mmap(
                addr,
                req.len,
                ProtFlags::READ | ProtFlags::WRITE,
                mflags,
                &fd,
                0,
            )
        }
        .map_err(|e| Error::Mmap {
            what: "RM memory",
            source: e.into(),
        })?;
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or(Error::Mmap {
            what: "RM memory",
            source: std::io::Error::other("mmap returned null"),
        })?;
        // SAFETY: a mapping of `req.len` bytes just made, which nothing else unmaps.
        Ok(unsafe { CpuMapping::from_raw(ptr, req.len) })
    }

    fn ctl(&self) -> Result<&OwnedFd> {
        Ok(&self.ctl)
    }

    fn uvm_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.uvm.as_fd())
    }
}

/// UVM descriptors APEX holds (opened and initialised itself, or duplicated from CUDA's): attaching to CUDA looks
/// for the process's other ones.
static OWN_UVM_FDS: Mutex<Vec<i32>> = Mutex::new(Vec::new());

/// Runs `f` on the list of UVM descriptors APEX holds.
pub(crate) fn own_uvm_fds<T>(f: impl FnOnce(&mut Vec<i32>) -> T) -> T {
    f(&mut OWN_UVM_FDS.lock().unwrap_or_else(|p| p.into_inner()))
}

/// Opens a device node read-write, close-on-exec, with errors that say what is wrong.
pub(crate) fn open_node(path: &str) -> Result<OwnedFd> {
    use rustix::fs::{Mode, OFlags, open};
    open(path, OFlags::RDWR | OFlags::CLOEXEC, Mode::empty()).map_err(|e| match e {
        rustix::io::Errno::NOENT | rustix::io::Errno::NXIO | rustix::io::Errno::NODEV => {
            Error::NoDeviceNode {
                path: path.to_string(),
            }
        }
        rustix::io::Errno::ACCESS | rustix::io::Errno::PERM => Error::PermissionDenied {
            path: path.to_string(),
        },
        e => Error::Open {
            path: path.to_string(),
            source: e.into(),
        },
    })
}

/// Opens /dev/nvidiaN and registers it with the client's control fd, as RM requires for mappings.
pub(crate) fn open_gpu_node(ctl: &impl AsFd, minor: u32) -> Result<OwnedFd> {
    let fd = open_node(&format!("/dev/nvidia{minor}"))?;
    let mut reg = sys::nv_ioctl_register_fd_t {
        ctl_fd: ctl.as_fd().as_raw_fd(),
    };
    // SAFETY: nv_ioctl_register_fd_t is the NV_ESC_REGISTER_FD argument.
    unsafe {
        nv_escape(
            &fd,
            sys::NV_ESC_REGISTER_FD,
            &mut reg,
            "register with /dev/nvidiactl",
        )?
    };
    Ok(fd)
}

/// The loaded module's version string, through NV_ESC_CHECK_VERSION_STR's query command.
pub(crate) fn query_driver_version(ctl: &OwnedFd) -> Result<String> {
    let mut v = sys::nv_ioctl_rm_api_version_t {
        cmd: u32::from(sys::NV_RM_API_VERSION_CMD_QUERY),
        ..Default::default()
    };
    // SAFETY: nv_ioctl_rm_api_version_t is the NV_ESC_CHECK_VERSION_STR argument; it holds no pointers.
    unsafe {
        nv_escape(
            ctl,
            sys::NV_ESC_CHECK_VERSION_STR,
            &mut v,
            "query driver version",
        )?
    };
    Ok(c_string(&v.versionString))
}

/// GPUs attached to the driver, in minor-number order.
pub(crate) fn card_info(ctl: &OwnedFd) -> Result<Vec<sys::nv_ioctl_card_info_t>> {
    let mut cards = [sys::nv_ioctl_card_info_t::default(); sys::NV_MAX_DEVICES as usize];
    // SAFETY: NV_ESC_CARD_INFO takes an array of nv_ioctl_card_info_t; its size is encoded in the opcode.
    unsafe { nv_escape(ctl, sys::NV_ESC_CARD_INFO, &mut cards, "list GPUs")? };
    Ok(cards.into_iter().filter(|c| c.valid != 0).collect())
}

/// A NUL-terminated C string from a fixed-size array RM filled (the rest of the array is ignored).
pub(crate) fn c_string(bytes: &[impl Copy + Into<i64>]) -> String {
    let v: Vec<u8> = bytes
        .iter()
        .map(|&c| c.into() as u8)
        .take_while(|&c| c != 0)
        .collect();
    CStr::from_bytes_until_nul(&[v.as_slice(), &[0]].concat())
        .map_or_else(|_| String::new(), |s| s.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn c_strings_stop_at_nul() {
        assert_eq!(
            c_string(&[b'5' as i8, b'8' as i8, b'0' as i8, 0, b'x' as i8]),
            "580"
        );
        assert_eq!(c_string(b"ab"), "ab");
    }
}
