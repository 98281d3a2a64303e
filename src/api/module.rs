//! Loaded modules, their kernels and their variables.

use std::sync::Arc;

use super::queue::{Endpoint, KeepAlive};
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
pub struct Module(ModuleInner);

/// Which backend loaded the module; private so that a new backend is not a breaking change.
#[derive(Clone, Debug)]
enum ModuleInner {
    /// Loaded by APEX onto the direct path.
    Direct(Arc<module::Module>),
    /// Loaded by libcuda; the cubin parsed from the same bytes, when APEX could read it, checks arguments before
    /// launching and resolves demangled names.
    Driver {
        module: Arc<driver::Module>,
        cubin: Option<Arc<module::cubin::Cubin>>,
    },
}

impl Module {
    pub(super) fn from_direct(module: Arc<module::Module>) -> Module {
        Module(ModuleInner::Direct(module))
    }

    pub(super) fn from_driver(
        module: Arc<driver::Module>,
        cubin: Option<Arc<module::cubin::Cubin>>,
    ) -> Module {
        Module(ModuleInner::Driver { module, cubin })
    }

    /// The backend that loaded this module.
    pub fn backend(&self) -> Backend {
        match self.0 {
            ModuleInner::Direct(_) => Backend::Direct,
            ModuleInner::Driver { .. } => Backend::Driver,
        }
    }

    /// The direct path's module, when that backend loaded it.
    pub fn direct(&self) -> Option<&Arc<module::Module>> {
        match &self.0 {
            ModuleInner::Direct(m) => Some(m),
            ModuleInner::Driver { .. } => None,
        }
    }

    /// libcuda's module, when the driver backend loaded it.
    pub fn driver(&self) -> Option<&Arc<driver::Module>> {
        match &self.0 {
            ModuleInner::Driver { module, .. } => Some(module),
            ModuleInner::Direct(_) => None,
        }
    }

    /// The cubin the module's code came from, as APEX parsed it: always on the direct path; on the driver
    /// backend when the code was a cubin APEX could read (not PTX).
    pub fn cubin(&self) -> Option<&module::cubin::Cubin> {
        match &self.0 {
            ModuleInner::Direct(m) => Some(m.cubin()),
            ModuleInner::Driver { cubin, .. } => cubin.as_deref(),
        }
    }

    /// The kernel `name` (the mangled symbol, or the demangled name with or without its parameter list).
    pub fn kernel(&self, name: &str) -> Result<Kernel> {
        match &self.0 {
            ModuleInner::Direct(m) => Ok(Kernel(KernelInner::Direct(m.kernel(name)?))),
            ModuleInner::Driver { module, cubin } => {
                let info = match cubin {
                    Some(c) => Some(c.kernel(name).map_err(module::Error::from)?.clone()),
                    None => None,
                };
                // The driver looks kernels up by symbol: a demangled name is resolved through the cubin.
                let symbol = info.as_ref().map_or(name, |i| i.name.as_str());
                Ok(Kernel(KernelInner::Driver {
                    func: module.function(symbol)?,
                    info: info.map(Arc::new),
                }))
            }
        }
    }
}

impl Module {
    /// The module variable (`__device__` or `__constant__`) called `name`: its device address and size, what
    /// `cuModuleGetGlobal` gives. On the direct path a C++ variable in a namespace also answers to its demangled
    /// name. Read and write it with [`Queue::copy_to_global`](super::Queue::copy_to_global) and
    /// [`Queue::copy_from_global`](super::Queue::copy_from_global) (or their pinned-memory forms), in stream
    /// order with the queue's launches.
    pub fn global(&self, name: &str) -> Result<Global> {
        let (symbol, device_ptr, size) = match &self.0 {
            ModuleInner::Direct(m) => {
                let g = m.global(name)?;
                (g.name, g.va, g.size)
            }
            ModuleInner::Driver { module, cubin } => {
                // The driver looks variables up by symbol: a demangled name is resolved through the cubin.
                let symbol = cubin
                    .as_ref()
                    .and_then(|c| c.global(name))
                    .map_or(name, |g| g.name.as_str());
                match module.global(symbol)? {
                    Some((ptr, size)) => (symbol.to_string(), ptr, size),
                    None => {
                        let available = cubin.as_ref().map_or_else(Vec::new, |c| {
                            c.globals().iter().map(|g| g.name.clone()).collect()
                        });
                        return Err(module::Error::NoSuchGlobal {
                            name: name.to_string(),
                            available,
                        }
                        .into());
                    }
                }
            }
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
    module: Module,
    name: String,
    device_ptr: u64,
    size: u64,
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

    pub(super) fn endpoint(&self, offset: u64) -> Endpoint {
        (
            self.device_ptr,
            self.size,
            offset,
            KeepAlive::Module(self.module.clone()),
        )
    }
}

/// A kernel of a loaded module.
#[derive(Clone, Debug)]
pub struct Kernel(KernelInner);

/// Which backend the kernel belongs to; private so that a new backend is not a breaking change.
#[derive(Clone, Debug)]
pub(super) enum KernelInner {
    /// A kernel of a direct-path module.
    Direct(module::Kernel),
    /// A kernel of a libcuda module, with its parameter table and resources when the cubin could be read.
    Driver {
        func: driver::Function,
        info: Option<Arc<KernelInfo>>,
    },
}

impl Kernel {
    pub(super) fn inner(&self) -> &KernelInner {
        &self.0
    }

    /// The backend whose module holds this kernel.
    pub fn backend(&self) -> Backend {
        match self.0 {
            KernelInner::Direct(_) => Backend::Direct,
            KernelInner::Driver { .. } => Backend::Driver,
        }
    }

    /// The direct path's kernel, when that backend loaded its module.
    pub fn direct(&self) -> Option<&module::Kernel> {
        match &self.0 {
            KernelInner::Direct(k) => Some(k),
            KernelInner::Driver { .. } => None,
        }
    }

    /// libcuda's function, when the driver backend loaded its module.
    pub fn driver(&self) -> Option<&driver::Function> {
        match &self.0 {
            KernelInner::Driver { func, .. } => Some(func),
            KernelInner::Direct(_) => None,
        }
    }

    /// The kernel's symbol (mangled, as the module names it).
    pub fn name(&self) -> &str {
        match &self.0 {
            KernelInner::Direct(k) => k.name(),
            KernelInner::Driver { func, .. } => func.name(),
        }
    }

    /// The cubin's attributes (absent for PTX loaded by the driver).
    pub fn info(&self) -> Option<&KernelInfo> {
        match &self.0 {
            KernelInner::Direct(k) => Some(k.info()),
            KernelInner::Driver { info, .. } => info.as_deref(),
        }
    }
}
