//! The simulated RM as its client's transport (RM calls answered in process) and as an in-process GPU (memory
//! backed by anonymous shared memory at its GPU address).

use std::ffi::c_void;
use std::ptr::NonNull;

use rustix::mm::{MapFlags, ProtFlags, mmap_anonymous};

use super::objects::{Obj, SimShared};
use crate::rm::error::check;
use crate::rm::mapping::CpuMapping;
use crate::rm::transport::{CpuMapRequest, Handle, InProcessGpu, Transport};
use crate::rm::{Error, NvStatus, Result, sys};

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
