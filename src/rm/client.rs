//! The RM client: the file descriptors, the root client handle, and RAII handles for RM objects.

// Issue 14: public items here still lack docs; document them and drop this allow.
#![allow(missing_docs)]

use std::ffi::c_void;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use tracing::{debug, warn};

use super::ioctl::{nv_escape, uvm_ioctl};
use super::sim::SimShared;
use super::{Error, NvStatus, Result, sys};

/// Handle of an RM object, unique within its client.
pub type Handle = u32;

/// The file descriptors of one RM client and its root handle. Freed (with every object under it) on drop.
#[derive(Debug)]
pub struct Client {
    handle: Handle,
    backend: Backend,
}

/// Where RM calls go: the kernel driver, or the in-process simulated RM that CI uses (no GPU).
#[derive(Debug)]
enum Backend {
    Device {
        ctl: OwnedFd,
        uvm: OwnedFd,
        // A second UVM fd, bound to this process's mm by UVM_MM_INITIALIZE; held open for the va space's life.
        _uvm_mm: Option<OwnedFd>,
        /// Whether `uvm` is a VA space this client initialised (not one it shares, as an attached GPU does).
        own_uvm: bool,
    },
    Simulated(Arc<SimShared>),
}

impl Client {
    /// Allocates a root client on `ctl` and initialises a UVM va space on `uvm`.
    pub(crate) fn new(ctl: OwnedFd, uvm: OwnedFd, uvm_mm: OwnedFd) -> Result<Client> {
        let mut p = sys::NVOS21_PARAMETERS {
            hClass: sys::NV01_ROOT_CLIENT,
            ..Default::default()
        };
        // SAFETY: NVOS21_PARAMETERS is the NV_ESC_RM_ALLOC argument; pAllocParms is null.
        unsafe { nv_escape(&ctl, sys::NV_ESC_RM_ALLOC, &mut p, "NV01_ROOT_CLIENT")? };
        check("RM_ALLOC", "NV01_ROOT_CLIENT", p.status)?;
        // Counted from here: on any error below, dropping `client` frees it again.
        LIVE_OBJECTS.fetch_add(1, Ordering::Relaxed);
        let uvm_raw = uvm.as_raw_fd();
        own_uvm_fds(|fds| fds.push(uvm_raw));
        let mut client = Client {
            handle: p.hObjectNew,
            backend: Backend::Device {
                ctl,
                uvm,
                _uvm_mm: None,
                own_uvm: true,
            },
        };
        debug!(
            client = format_args!("{:#x}", client.handle),
            "RM root client allocated"
        );

        let mut init = sys::UVM_INITIALIZE_PARAMS::default();
        client.uvm_call(sys::UVM_INITIALIZE, &mut init, "UVM_INITIALIZE", |p| {
            p.rmStatus
        })?;
        let mut mm = sys::UVM_MM_INITIALIZE_PARAMS {
            uvmFd: uvm_raw,
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
        // libcuda sees this fail too when another va space already owns the mm; UVM works without it.
        match r {
            Ok(()) if mm.rmStatus == 0 => {
                if let Backend::Device { _uvm_mm, .. } = &mut client.backend {
                    *_uvm_mm = Some(uvm_mm);
                }
            }
            Ok(()) => debug!(status = %NvStatus(mm.rmStatus), "UVM_MM_INITIALIZE declined"),
            Err(e) => debug!(error = %e, "UVM_MM_INITIALIZE declined"),
        }
        Ok(client)
    }

    /// A root client on `ctl` whose UVM calls go to `uvm`, a UVM VA space someone else initialised (CUDA's, for
    /// an attached GPU): nothing is initialised or registered with UVM here.
    pub(crate) fn with_foreign_uvm(ctl: OwnedFd, uvm: OwnedFd) -> Result<Client> {
        let mut p = sys::NVOS21_PARAMETERS {
            hClass: sys::NV01_ROOT_CLIENT,
            ..Default::default()
        };
        // SAFETY: NVOS21_PARAMETERS is the NV_ESC_RM_ALLOC argument; pAllocParms is null.
        unsafe { nv_escape(&ctl, sys::NV_ESC_RM_ALLOC, &mut p, "NV01_ROOT_CLIENT")? };
        check("RM_ALLOC", "NV01_ROOT_CLIENT", p.status)?;
        LIVE_OBJECTS.fetch_add(1, Ordering::Relaxed);
        Ok(Client {
            handle: p.hObjectNew,
            backend: Backend::Device {
                ctl,
                uvm,
                _uvm_mm: None,
                own_uvm: false,
            },
        })
    }

    /// A root client on `ctl` that shares the UVM VA space behind `uvm` (a duplicate of another APEX client's
    /// descriptor): GPUs of one peer domain register in one VA space, so they can map each other's memory.
    pub(crate) fn sharing_uvm(ctl: OwnedFd, uvm: OwnedFd) -> Result<Client> {
        let raw = uvm.as_raw_fd();
        let mut client = Client::with_foreign_uvm(ctl, uvm)?;
        if let Backend::Device { own_uvm, .. } = &mut client.backend {
            *own_uvm = true;
        }
        own_uvm_fds(|fds| fds.push(raw));
        Ok(client)
    }

    /// The UVM descriptor RM-level UVM calls go to (none for a simulated client).
    pub(crate) fn uvm_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        match &self.backend {
            Backend::Device { uvm, .. } => Some(uvm.as_fd()),
            Backend::Simulated(_) => None,
        }
    }

    /// A client of the simulated RM: no file descriptors, RM calls answered in process.
    pub(crate) fn simulated(sim: Arc<SimShared>) -> Client {
        let handle = sim.alloc_root();
        LIVE_OBJECTS.fetch_add(1, Ordering::Relaxed);
        Client {
            handle,
            backend: Backend::Simulated(sim),
        }
    }

    pub fn handle(&self) -> Handle {
        self.handle
    }

    /// /dev/nvidiactl; a simulated client has none.
    pub(crate) fn ctl(&self) -> Result<&OwnedFd> {
        match &self.backend {
            Backend::Device { ctl, .. } => Ok(ctl),
            Backend::Simulated(_) => Err(Error::Simulated {
                what: "/dev/nvidiactl",
            }),
        }
    }

    /// The control fd as UVM calls name it (-1 for a simulated client, whose UVM calls do nothing).
    pub(crate) fn ctl_raw_fd(&self) -> i32 {
        match &self.backend {
            Backend::Device { ctl, .. } => ctl.as_raw_fd(),
            Backend::Simulated(_) => -1,
        }
    }

    /// The simulated RM behind this client, if it is one.
    pub(crate) fn sim(&self) -> Option<&Arc<SimShared>> {
        match &self.backend {
            Backend::Device { .. } => None,
            Backend::Simulated(s) => Some(s),
        }
    }

    /// Whether RM calls go to the simulated RM instead of the kernel driver.
    pub fn is_simulated(&self) -> bool {
        self.sim().is_some()
    }

    /// NV_ESC_RM_ALLOC of `class` under `parent`, with the class's allocation parameters.
    pub fn alloc<P>(
        &self,
        parent: Handle,
        class: u32,
        params: Option<&mut P>,
        what: &'static str,
    ) -> Result<Handle> {
        let ptr = params.map_or(std::ptr::null_mut(), |p| (p as *mut P).cast::<c_void>());
        let ctl = match &self.backend {
            Backend::Device { ctl, .. } => ctl,
            Backend::Simulated(sim) => {
                let status = sim.alloc(parent, class, ptr.cast(), size_of::<P>());
                return status.map_err(|s| Error::Rm {
                    call: "RM_ALLOC",
                    what,
                    status: s,
                });
            }
        };
        let mut p = sys::NVOS21_PARAMETERS {
            hRoot: self.handle,
            hObjectParent: parent,
            hClass: class,
            pAllocParms: ptr,
            ..Default::default()
        };
        // SAFETY: NVOS21_PARAMETERS is the RM_ALLOC argument; pAllocParms is null or points to the caller's
        // exclusively borrowed parameter struct, which outlives the call.
        unsafe { nv_escape(ctl, sys::NV_ESC_RM_ALLOC, &mut p, what)? };
        check("RM_ALLOC", what, p.status)?;
        debug!(
            class = format_args!("{class:#x}"),
            handle = format_args!("{:#x}", p.hObjectNew),
            what,
            "RM_ALLOC"
        );
        Ok(p.hObjectNew)
    }

    /// NV_ESC_RM_CONTROL `cmd` on `object` with its parameter struct.
    pub fn control<P>(
        &self,
        object: Handle,
        cmd: u32,
        params: &mut P,
        what: &'static str,
    ) -> Result<()> {
        let ctl = match &self.backend {
            Backend::Device { ctl, .. } => ctl,
            Backend::Simulated(sim) => {
                let status = sim.control(object, cmd, (params as *mut P).cast(), size_of::<P>());
                return check("RM_CONTROL", what, status.0);
            }
        };
        let mut p = sys::NVOS54_PARAMETERS {
            hClient: self.handle,
            hObject: object,
            cmd,
            params: (params as *mut P).cast(),
            paramsSize: size_of::<P>() as u32,
            ..Default::default()
        };
        // SAFETY: NVOS54_PARAMETERS is the RM_CONTROL argument; params points to a live `P` of paramsSize
        // bytes. The caller picks `P` to be the control's parameter struct.
        unsafe { nv_escape(ctl, sys::NV_ESC_RM_CONTROL, &mut p, what)? };
        check("RM_CONTROL", what, p.status)
    }

    /// NV_ESC_RM_FREE of `handle` (and everything RM holds under it).
    pub fn free(&self, parent: Handle, handle: Handle) -> Result<()> {
        let ctl = match &self.backend {
            Backend::Device { ctl, .. } => ctl,
            Backend::Simulated(sim) => return check("RM_FREE", "object", sim.free(handle).0),
        };
        let mut p = sys::NVOS00_PARAMETERS {
            hRoot: self.handle,
            hObjectParent: parent,
            hObjectOld: handle,
            status: 0,
        };
        // SAFETY: NVOS00_PARAMETERS is the RM_FREE argument and holds no pointers.
        unsafe { nv_escape(ctl, sys::NV_ESC_RM_FREE, &mut p, "RM_FREE")? };
        check("RM_FREE", "object", p.status)
    }

    /// A UVM ioctl whose parameter struct ends in an `rmStatus`, read back through `status`.
    pub(crate) fn uvm_call<P>(
        &self,
        cmd: u32,
        params: &mut P,
        what: &'static str,
        status: fn(&P) -> u32,
    ) -> Result<()> {
        let uvm = match &self.backend {
            Backend::Device { uvm, .. } => uvm,
            // UVM's job (GPU mappings at the CPU address) is done by the simulated RM's allocation registry.
            Backend::Simulated(_) => return Ok(()),
        };
        // SAFETY: callers pass the UVM_*_PARAMS struct that belongs to `cmd`.
        unsafe { uvm_ioctl(uvm, cmd, params, what)? };
        check("UVM", what, status(params))
    }
}

/// UVM descriptors APEX opened and initialised itself: attaching to CUDA looks for the process's other ones.
static OWN_UVM_FDS: std::sync::Mutex<Vec<i32>> = std::sync::Mutex::new(Vec::new());

pub(crate) fn own_uvm_fds<T>(f: impl FnOnce(&mut Vec<i32>) -> T) -> T {
    f(&mut OWN_UVM_FDS.lock().unwrap_or_else(|p| p.into_inner()))
}

impl Drop for Client {
    fn drop(&mut self) {
        if let Backend::Device {
            uvm, own_uvm: true, ..
        } = &self.backend
        {
            let raw = uvm.as_raw_fd();
            own_uvm_fds(|fds| fds.retain(|&fd| fd != raw));
        }
        // Freeing the root client frees every object allocated under it; closing the fds follows.
        match self.free(0, self.handle) {
            Ok(()) => {
                LIVE_OBJECTS.fetch_sub(1, Ordering::Relaxed);
            }
            Err(e) => warn!(error = %e, "freeing the RM root client failed"),
        }
    }
}

/// RM objects (root clients included) this process allocated through APEX and has not freed.
static LIVE_OBJECTS: AtomicI64 = AtomicI64::new(0);

/// How many RM objects (root clients included) APEX holds now, for leak checks.
pub fn live_objects() -> i64 {
    LIVE_OBJECTS.load(Ordering::Relaxed)
}

pub(crate) fn check(call: &'static str, what: &'static str, status: u32) -> Result<()> {
    if status == 0 {
        Ok(())
    } else {
        Err(Error::Rm {
            call,
            what,
            status: NvStatus(status),
        })
    }
}

/// An RM object, freed on drop. It holds its parent, so RM objects are always freed children first.
#[derive(Debug)]
pub struct Object {
    client: Arc<Client>,
    parent: Option<Arc<Object>>,
    handle: Handle,
    class: u32,
    what: &'static str,
}

impl Object {
    /// Allocates `class` under `parent` (or under the root client when `parent` is None).
    pub fn alloc<P>(
        client: &Arc<Client>,
        parent: Option<&Arc<Object>>,
        class: u32,
        params: Option<&mut P>,
        what: &'static str,
    ) -> Result<Object> {
        let parent_handle = parent.map_or(client.handle(), |p| p.handle);
        let handle = client.alloc(parent_handle, class, params, what)?;
        LIVE_OBJECTS.fetch_add(1, Ordering::Relaxed);
        Ok(Object {
            client: client.clone(),
            parent: parent.cloned(),
            handle,
            class,
            what,
        })
    }

    /// A handle in `client` (under `parent`) for object `src` of another client of this process
    /// (`NV_ESC_RM_DUP_OBJECT`); freeing it drops this client's reference only.
    pub fn dup(
        client: &Arc<Client>,
        parent: &Arc<Object>,
        src_client: Handle,
        src: Handle,
        class: u32,
        what: &'static str,
    ) -> Result<Object> {
        let handle = super::attach::dup_object(client, parent.handle, src_client, src, what)?;
        LIVE_OBJECTS.fetch_add(1, Ordering::Relaxed);
        Ok(Object {
            client: client.clone(),
            parent: Some(parent.clone()),
            handle,
            class,
            what,
        })
    }

    pub fn handle(&self) -> Handle {
        self.handle
    }

    pub fn class(&self) -> u32 {
        self.class
    }

    pub fn client(&self) -> &Arc<Client> {
        &self.client
    }

    /// RM control on this object.
    pub fn control<P>(&self, cmd: u32, params: &mut P, what: &'static str) -> Result<()> {
        self.client.control(self.handle, cmd, params, what)
    }
}

impl Drop for Object {
    fn drop(&mut self) {
        let parent = self
            .parent
            .as_ref()
            .map_or(self.client.handle(), |p| p.handle);
        match self.client.free(parent, self.handle) {
            Ok(()) => {
                LIVE_OBJECTS.fetch_sub(1, Ordering::Relaxed);
            }
            Err(e) => {
                warn!(error = %e, what = self.what, handle = format_args!("{:#x}", self.handle), "RM_FREE failed");
            }
        }
    }
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
