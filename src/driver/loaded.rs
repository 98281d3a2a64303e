//! The driver backend's side of [`crate::Module`] and [`crate::Kernel`]: libcuda's module with the cubin APEX
//! parsed from the same bytes, and its functions with their parameter tables, so launches are checked as on the
//! direct path and demangled names resolve.

use std::sync::Arc;

use super::{BackendError, BackendResult, Context, Function, Module};
use crate::launch::params::{Arg, pack, pack_table};
use crate::launch::{self, ParamError};
use crate::module::{
    self,
    cubin::{Cubin, KernelInfo},
};

/// A module libcuda loaded, with the cubin its code came from when APEX could read it (not PTX).
#[derive(Clone, Debug)]
pub struct LoadedModule {
    module: Arc<Module>,
    cubin: Option<Arc<Cubin>>,
}

impl LoadedModule {
    /// Loads `image` (a cubin, fatbin, PTX, or a host executable or shared library built by nvcc) into `ctx`.
    /// The driver reads cubins, fatbins and PTX itself; code in host binaries is taken out, and relocatable cubins
    /// linked, here first. The code picked for `sm_version` also gives the cubin's attributes.
    pub fn load(ctx: &Arc<Context>, image: &[u8], sm_version: u32) -> BackendResult<LoadedModule> {
        use module::image::{self as img, Code, PtxHandling};
        let resolved = img::resolve(
            image,
            sm_version,
            module::jit::Jit::system(),
            PtxHandling::Keep,
        );
        let prepare = match module::select::cubin_arch(image) {
            Some(arch) => arch.relocatable,
            None => image.starts_with(b"\x7fELF"),
        };
        let m = match (&resolved, prepare) {
            (Ok(r), true) => Module::load(ctx, r.code.bytes())?,
            (Err(e), true) => return Err(module::Error::from(e.clone()).into()),
            (_, false) => Module::load(ctx, image)?,
        };
        let cubin = match &resolved {
            Ok(r) => match &r.code {
                Code::Cubin(b) => Cubin::parse(b).ok(),
                Code::Ptx(_) => None,
            },
            Err(_) => None,
        };
        Ok(LoadedModule {
            module: m,
            cubin: cubin.map(Arc::new),
        })
    }

    /// libcuda's module.
    pub fn module(&self) -> &Arc<Module> {
        &self.module
    }

    /// The cubin, as APEX parsed it, when the code was one APEX could read.
    pub fn cubin(&self) -> Option<&Cubin> {
        self.cubin.as_deref()
    }

    /// The kernel `name` (the mangled symbol, or the demangled name when the cubin could be read).
    pub fn kernel(&self, name: &str) -> BackendResult<Kernel> {
        let info = match &self.cubin {
            Some(c) => Some(c.kernel(name).map_err(module::Error::from)?.clone()),
            None => None,
        };
        // The driver looks kernels up by symbol: a demangled name is resolved through the cubin.
        let symbol = info.as_ref().map_or(name, |i| i.name.as_str());
        Ok(Kernel {
            func: self.module.function(symbol)?,
            info: info.map(Arc::new),
        })
    }

    /// The module variable `name`: its symbol, device address and size (`cuModuleGetGlobal`).
    pub fn global(&self, name: &str) -> BackendResult<(String, u64, u64)> {
        // The driver looks variables up by symbol: a demangled name is resolved through the cubin.
        let symbol = self
            .cubin
            .as_ref()
            .and_then(|c| c.global(name))
            .map_or(name, |g| g.name.as_str());
        match self.module.global(symbol)? {
            Some((ptr, size)) => Ok((symbol.to_string(), ptr, size)),
            None => {
                let available = self.cubin.as_ref().map_or_else(Vec::new, |c| {
                    c.globals().iter().map(|g| g.name.clone()).collect()
                });
                Err(module::Error::NoSuchGlobal {
                    name: name.to_string(),
                    available,
                }
                .into())
            }
        }
    }
}

/// A kernel of a [`LoadedModule`], with its parameter table and resources when the cubin could be read.
#[derive(Clone, Debug)]
pub struct Kernel {
    func: Function,
    info: Option<Arc<KernelInfo>>,
}

impl Kernel {
    /// libcuda's function.
    pub fn function(&self) -> &Function {
        &self.func
    }

    /// The cubin's attributes (absent for PTX).
    pub fn info(&self) -> Option<&KernelInfo> {
        self.info.as_deref()
    }

    /// The kernel's symbol.
    pub fn name(&self) -> &str {
        self.func.name()
    }

    /// Packs `args` into `out` by the cubin's parameter table when APEX read it, else by the one libcuda reports;
    /// checked as a launch's arguments are (count, sizes). Returns the bytes written.
    pub fn pack(&self, args: &[Arg<'_>], out: &mut [u8]) -> BackendResult<usize> {
        let n = match &self.info {
            Some(info) => pack(info, args, out),
            None => pack_table(self.func.name(), self.func.params(), args, out),
        };
        Ok(n.map_err(launch::Error::from)?)
    }

    /// Checks `args` against the function's parameters: their number and each one's size.
    pub(super) fn check_args(&self, args: &[Arg<'_>]) -> BackendResult<()> {
        // Named only when an error needs it: nothing is allocated on the launch path.
        let name = || {
            self.info
                .as_ref()
                .map_or_else(|| self.func.name().to_string(), |i| i.name.clone())
        };
        let params = self.func.params();
        if args.len() != params.len() {
            return Err(launch::Error::Params(ParamError::Count {
                kernel: name(),
                expected: params.len(),
                given: args.len(),
            })
            .into());
        }
        if args.len() > super::MAX_PARAMS {
            return Err(BackendError::InvalidArgument(format!(
                "{} parameters (at most {})",
                args.len(),
                super::MAX_PARAMS
            )));
        }
        for (index, (a, &(_, size))) in args.iter().zip(params).enumerate() {
            if a.size() != size as usize {
                return Err(launch::Error::Params(ParamError::Size {
                    kernel: name(),
                    index,
                    expected: size,
                    given: a.size(),
                })
                .into());
            }
        }
        Ok(())
    }
}
