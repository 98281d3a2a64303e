//! Loaded modules, their kernels and their variables.

use std::sync::Arc;

use super::backend::Backed;
use super::{Backend, Result};
use crate::driver;
use crate::module::{self, cubin::KernelInfo};

/// A loaded module: a cubin, fatbin, PTX or nvcc-built program, ready to hand out its kernels and globals.
///
/// Cloning is cheap (shared); the module's code stays loaded while a clone or a kernel of it lives.
///
/// ```no_run
/// # fn main() -> apex::Result<()> {
/// let gpu = apex::Gpu::open(0)?;
/// let module = gpu.load_module_file("kernels/apex_test_kernels.sm_90.cubin")?;
/// let kernel = module.kernel("vector_add")?; // mangled or demangled names
/// println!("{:?} registers per thread", kernel.info().map(|k| k.registers));
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct Module(Backed<Arc<module::Module>, driver::LoadedModule>);

impl Module {
    pub(super) fn from_direct(module: Arc<module::Module>) -> Module {
        Module(Backed::Direct(module))
    }

    pub(super) fn from_driver(module: driver::LoadedModule) -> Module {
        Module(Backed::Driver(module))
    }

    /// The backend that loaded this module.
    pub fn backend(&self) -> Backend {
        self.0.backend()
    }

    /// The direct path's module, when that backend loaded it.
    pub fn direct(&self) -> Option<&Arc<module::Module>> {
        self.0.direct()
    }

    /// libcuda's module, when the driver backend loaded it.
    pub fn driver(&self) -> Option<&Arc<driver::Module>> {
        self.0.driver().map(|m| m.module())
    }

    /// The cubin the module's code came from, as APEX parsed it: always on the direct path; on the driver
    /// backend when the code was a cubin APEX could read (not PTX).
    pub fn cubin(&self) -> Option<&module::cubin::Cubin> {
        match &self.0 {
            Backed::Direct(m) => Some(m.cubin()),
            Backed::Driver(m) => m.cubin(),
        }
    }

    /// Whether the module's `__constant__` bank is CUDA's instance's
    /// ([`Gpu::load_module_sharing_constants`](crate::Gpu::load_module_sharing_constants)): a write to a
    /// `__constant__` variable through CUDA (`cudaMemcpyToSymbol`) reaches this module's launches. Always `true` on
    /// the driver backend, where the module is CUDA's own.
    pub fn shares_constants(&self) -> bool {
        match &self.0 {
            Backed::Direct(m) => m.shares_constants(),
            Backed::Driver(_) => true,
        }
    }

    /// The kernel `name` (the mangled symbol, or the demangled name with or without its parameter list).
    pub fn kernel(&self, name: &str) -> Result<Kernel> {
        Ok(Kernel(match &self.0 {
            Backed::Direct(m) => Backed::Direct(m.kernel(name)?),
            Backed::Driver(m) => Backed::Driver(m.kernel(name)?),
        }))
    }

    /// The module variable (`__device__` or `__constant__`) called `name`: its device address and size, what
    /// `cuModuleGetGlobal` gives. On the direct path a C++ variable in a namespace also answers to its demangled
    /// name. Read and write it with [`Queue::copy_to_global`](super::Queue::copy_to_global) and
    /// [`Queue::copy_from_global`](super::Queue::copy_from_global) (or their pinned-memory forms), in stream
    /// order with the queue's launches.
    pub fn global(&self, name: &str) -> Result<Global> {
        let (symbol, device_ptr, size) = match &self.0 {
            Backed::Direct(m) => {
                let g = m.global(name)?;
                (g.name, g.va, g.size)
            }
            Backed::Driver(m) => m.global(name)?,
        };
        Ok(Global {
            module: self.clone(),
            name: symbol,
            device_ptr,
            size,
        })
    }
}

/// A module variable (`__device__` or `__constant__`): see [`Module::global`]. Keeps its module loaded.
#[derive(Clone, Debug)]
pub struct Global {
    pub(super) module: Module,
    name: String,
    pub(super) device_ptr: u64,
    pub(super) size: u64,
}

impl Global {
    /// The variable's symbol.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its device address (a `__constant__` variable's too: kernels read it through a constant bank bound there).
    pub fn device_ptr(&self) -> u64 {
        self.device_ptr
    }

    /// Its device address as a [`DevicePtr`](crate::DevicePtr) (what [`device_ptr`](Self::device_ptr) returns, typed).
    pub fn ptr(&self) -> crate::DevicePtr {
        crate::DevicePtr(self.device_ptr)
    }

    /// Bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    pub(super) fn backend(&self) -> Backend {
        self.module.backend()
    }

    /// The device address of `bytes` at `offset`, checked against the variable.
    pub(super) fn range(&self, offset: u64, bytes: u64) -> Result<u64> {
        if offset.checked_add(bytes).is_none_or(|end| end > self.size) {
            return Err(module::Error::GlobalRange {
                name: self.name.clone(),
                size: self.size,
                offset,
                bytes,
            }
            .into());
        }
        Ok(self.device_ptr + offset)
    }
}

/// A kernel of a loaded module.
#[derive(Clone, Debug)]
pub struct Kernel(Backed<module::Kernel, driver::Kernel>);

impl Kernel {
    /// The backend's kernel, for the queue that launches it.
    pub(super) fn inner(&self) -> &Backed<module::Kernel, driver::Kernel> {
        &self.0
    }

    /// The backend whose module holds this kernel.
    pub fn backend(&self) -> Backend {
        self.0.backend()
    }

    /// The direct path's kernel, when that backend loaded its module.
    pub fn direct(&self) -> Option<&module::Kernel> {
        self.0.direct()
    }

    /// libcuda's function, when the driver backend loaded its module.
    pub fn driver(&self) -> Option<&driver::Function> {
        self.0.driver().map(|k| k.function())
    }

    /// The driver backend's kernel (its function and parameter table), when that backend loaded its module.
    pub(super) fn driver_kernel(&self) -> Option<&driver::Kernel> {
        self.0.driver()
    }

    /// The kernel's symbol (mangled, as the module names it).
    pub fn name(&self) -> &str {
        match &self.0 {
            Backed::Direct(k) => k.name(),
            Backed::Driver(k) => k.name(),
        }
    }

    /// The cubin's attributes (absent for PTX loaded by the driver).
    pub fn info(&self) -> Option<&KernelInfo> {
        match &self.0 {
            Backed::Direct(k) => Some(k.info()),
            Backed::Driver(k) => k.info(),
        }
    }
}
