//! Modules: a cubin's image linked and uploaded into GPU memory, its kernels looked up by name.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tracing::debug;

use crate::rm::{GpuCore, Memory, MemoryDesc};

use super::cubin::{Cubin, GlobalSymbol, KernelInfo, PlacedGlobal};
use super::printf::{PrintfFifo, PrintfFifoCell, RuntimeLink};
use super::{Error, Result, image, jit};

/// Bytes of zeroed, mapped memory after the code: the SM prefetches instructions past a kernel's end.
const PREFETCH_PADDING: u64 = 0x1000;

/// Every module load bumps this; a queue that has not invalidated its instruction caches since the newest
/// load does so before its next launch.
static GENERATION: AtomicU64 = AtomicU64::new(1);

/// A loaded cubin.
#[derive(Debug)]
pub struct Module {
    cubin: Cubin,
    image: Memory,
    generation: u64,
    /// The ring `printf`/`assert` records go to, when the module calls them.
    printf: Option<Arc<PrintfFifo>>,
    /// Kernels that call an external APEX does not provide, with the reason: refused when looked up.
    refused: Vec<(String, super::cubin::CubinError)>,
    /// `__device__` variables that live outside the image ([`Module::load_placed`]).
    placed: Vec<PlacedGlobal>,
}

impl Module {
    /// Loads a cubin; the best code for this GPU out of a fatbin, or out of a host executable or library built by
    /// nvcc; or PTX, compiled for this GPU by nvJitLink (see the `module::image` layer). A module that calls `printf` or
    /// `assert` gets a printf FIFO of its own ([`Module::load_with`] shares one).
    pub fn load(gpu: &Arc<GpuCore>, bytes: &[u8]) -> Result<Arc<Module>> {
        Module::load_with(gpu, bytes, &PrintfFifoCell::new())
    }

    /// As [`Module::load`], with `printf` the FIFO (created on first need) that the module's `printf` and
    /// `assert` write to: one per GPU, as CUDA has one per context.
    pub fn load_with(
        gpu: &Arc<GpuCore>,
        bytes: &[u8],
        printf: &PrintfFifoCell,
    ) -> Result<Arc<Module>> {
        Module::load_placed(gpu, bytes, printf, &|_| None)
    }

    /// As [`Module::load_with`], with the module's `__device__` variables where `place` says they already live
    /// (`None`: in the module's own image, as usual). For a module CUDA also loaded in the context APEX is attached
    /// to, `place` gives CUDA's addresses (`cuModuleGetGlobal`), and kernels of both instances then read and write
    /// the same variables. `__constant__` variables live in the constant bank launches bind and are never placed.
    /// A placed variable must be at least as large as the module's (else [`Error::GlobalRange`]).
    pub fn load_placed(
        gpu: &Arc<GpuCore>,
        bytes: &[u8],
        printf: &PrintfFifoCell,
        place: &dyn Fn(&GlobalSymbol) -> Option<VariableHome>,
    ) -> Result<Arc<Module>> {
        let sm = gpu.info().sm_version;
        // Phase times for the debug log: a large module (PyTorch's) takes a program's thread for milliseconds.
        let started = std::time::Instant::now();
        // A cubin as it is; the best code of a fatbin or host binary; PTX compiled for this GPU.
        let (cubin_bytes, parsed) = image::parsed_cubin_for_device(bytes, sm, jit::Jit::system())?;
        let select_us = started.elapsed().as_micros();
        let cubin = match parsed {
            Some(c) => c,
            None => Cubin::parse(&cubin_bytes)?,
        };
        cubin.check_arch(sm)?;
        let parse_us = started.elapsed().as_micros() - select_us;
        let (kernels, globals) = (cubin.kernels().len(), cubin.globals().len());
        let placing = std::cell::Cell::new(std::time::Duration::ZERO);
        let timed_place = |g: &GlobalSymbol| {
            let t = std::time::Instant::now();
            let home = place(g);
            placing.set(placing.get() + t.elapsed());
            home
        };
        let m = Module::from_cubin(gpu, cubin, printf, &timed_place);
        debug!(
            image_bytes = bytes.len(),
            cubin_bytes = cubin_bytes.len(),
            kernels,
            globals,
            select_us,
            parse_us,
            place_us = placing.get().as_micros(),
            total_us = started.elapsed().as_micros(),
            "module load phases"
        );
        m
    }

    /// Links and uploads a parsed cubin, with APEX's device runtime appended if the module calls it.
    fn from_cubin(
        gpu: &Arc<GpuCore>,
        mut cubin: Cubin,
        printf: &PrintfFifoCell,
        place: &dyn Fn(&GlobalSymbol) -> Option<VariableHome>,
    ) -> Result<Arc<Module>> {
        let mut placed = Vec::new();
        // Zero-size symbols (unsized `extern` arrays) cover no bytes: nothing to share.
        for g in cubin
            .globals()
            .iter()
            .filter(|g| !g.is_constant() && g.size > 0)
        {
            if let Some(VariableHome { address, size }) = place(g) {
                if size < g.size {
                    return Err(Error::GlobalRange {
                        name: g.name.clone(),
                        size,
                        offset: 0,
                        bytes: g.size,
                    });
                }
                placed.push(PlacedGlobal {
                    image_offset: g.image_offset,
                    size: g.size,
                    address,
                });
            }
        }
        let plan = RuntimeLink::plan(cubin.sm_version(), cubin.externals(), cubin.image_size());
        // Cubins list each kernel's externals; where none does, every kernel is taken to call all of them.
        let listed = cubin.kernels().iter().any(|k| !k.externs.is_empty());
        // Externals APEX does not provide: the kernels that call them are refused when looked up, the others run.
        // Where the cubin does not say which kernel calls what, the whole module is refused before anything is
        // allocated.
        let mut refused = Vec::new();
        if let Some(e) = plan.unsupported.first() {
            if !listed {
                return Err(e.clone().into());
            }
            for k in cubin.kernels() {
                if let Some(e) = plan.refusal_for(&k.externs) {
                    refused.push((k.name.clone(), e.clone()));
                }
            }
        }
        let runtime = plan.link;
        let fifo = match &runtime {
            Some(_) => Some(printf.get_or_create(gpu)?),
            None => None,
        };
        if let Some(rt) = &runtime {
            // Kernels that call the runtime need its registers and stack too.
            for k in cubin.kernels_mut() {
                let externs = listed.then_some(&k.externs[..]);
                let (registers, stack) = rt.kernel_needs(externs, k.registers, k.min_stack_size);
                k.registers = registers;
                k.min_stack_size = stack;
            }
        }
        let image_size = runtime
            .as_ref()
            .map_or(cubin.image_size(), |r| r.image_size);
        let size = image_size.max(4) + PREFETCH_PADDING;
        let image = Memory::alloc(gpu, MemoryDesc::video(size).with_cpu().low())?;
        let mut linked = vec![0u8; image.size() as usize];
        let base = image.va();
        let unsupported = |name: &str| {
            plan.unsupported.iter().any(
                |e| matches!(e, super::cubin::CubinError::UnsupportedExtern { symbol, .. } if symbol == name),
            )
        };
        cubin.link_placed(
            base,
            &mut linked,
            &|name| {
                // Calls to an unsupported external stay 0: only kernels refused at lookup make them.
                runtime
                    .as_ref()
                    .and_then(|r| r.address(base, name))
                    .or_else(|| unsupported(name).then_some(0))
            },
            &placed,
        )?;
        if let (Some(rt), Some(fifo)) = (&runtime, &fifo) {
            rt.link(&mut linked, fifo.va())?;
        }
        image.write(0, &linked)?;
        let generation = GENERATION.fetch_add(1, Ordering::Relaxed) + 1;
        debug!(
            va = format_args!("{:#x}", image.va()),
            size,
            kernels = cubin.kernels().len(),
            "module loaded"
        );
        Ok(Arc::new(Module {
            cubin,
            image,
            generation,
            printf: fifo,
            refused,
            placed,
        }))
    }

    /// The GPU the module is loaded on.
    pub fn gpu(&self) -> &Arc<GpuCore> {
        self.image.gpu()
    }

    /// The linked image as it is in GPU memory (for inspection: what the loader laid out and relocated).
    pub fn image_bytes(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.image.size() as usize];
        self.image.read(0, &mut out)?;
        Ok(out)
    }

    /// The printf FIFO the module's kernels write to, if they call `printf` or `assert`.
    pub fn printf_fifo(&self) -> Option<&Arc<PrintfFifo>> {
        self.printf.as_ref()
    }

    /// The cubin the module was loaded from (the code picked for the GPU, linked).
    pub fn cubin(&self) -> &Cubin {
        &self.cubin
    }

    /// GPU address of the linked image.
    pub fn base_va(&self) -> u64 {
        self.image.va()
    }

    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// The kernel called `name`.
    pub fn kernel(self: &Arc<Self>, name: &str) -> Result<Kernel> {
        let found = match self.cubin.kernel(name) {
            Ok(k) => k.name.clone(),
            Err(super::cubin::CubinError::NoSuchKernel(_)) => {
                return Err(Error::NoSuchKernel {
                    name: name.to_string(),
                    available: self.kernel_names(),
                });
            }
            Err(e) => return Err(e.into()),
        };
        if let Some((_, e)) = self.refused.iter().find(|(k, _)| *k == found) {
            return Err(Error::KernelRefused {
                kernel: found,
                reason: e.clone(),
            });
        }
        let index = self
            .cubin
            .kernels()
            .iter()
            .position(|k| k.name == found)
            .ok_or_else(|| Error::NoSuchKernel {
                name: name.to_string(),
                available: self.kernel_names(),
            })?;
        Ok(Kernel {
            module: self.clone(),
            index,
        })
    }

    /// The symbols of the module's kernels (mangled), in the cubin's order.
    pub fn kernel_names(&self) -> Vec<String> {
        self.cubin
            .kernels()
            .iter()
            .map(|k| k.name.clone())
            .collect()
    }

    /// The module-scope variable (`__device__` or `__constant__`) called `name` (its symbol, or the demangled
    /// name of a C++ variable in a namespace): its GPU address and size, what `cuModuleGetGlobal` gives. Copies
    /// through a queue ([`ComputeQueue::copy`](crate::launch::ComputeQueue::copy)) are ordered with its launches; a
    /// `__constant__` variable lives in the constant bank launches bind, and every launch's QMD invalidates the
    /// SMs' constant caches, so launches after the copy read the new value.
    pub fn global(&self, name: &str) -> Result<Global> {
        let g = self.cubin.global(name).ok_or_else(|| Error::NoSuchGlobal {
            name: name.to_string(),
            available: self.global_names(),
        })?;
        let va = self
            .placed
            .iter()
            .find(|p| p.image_offset == g.image_offset)
            .map_or(self.base_va() + g.image_offset, |p| p.address);
        Ok(Global {
            name: g.name.clone(),
            va,
            size: g.size,
            constant: g.is_constant(),
        })
    }

    /// The names of the module's `__device__` and `__constant__` variables.
    pub fn global_names(&self) -> Vec<String> {
        self.cubin
            .globals()
            .iter()
            .map(|g| g.name.clone())
            .collect()
    }
}

/// Where a module variable lives when it is not in the module's own image ([`Module::load_placed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VariableHome {
    /// GPU address.
    pub address: u64,
    /// Bytes there (at least the variable's size).
    pub size: u64,
}

/// A module-scope variable of a loaded module (see [`Module::global`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Global {
    /// The variable's symbol.
    pub name: String,
    /// GPU address.
    pub va: u64,
    /// Bytes.
    pub size: u64,
    /// `__constant__` data, which kernels read through a constant bank.
    pub constant: bool,
}

impl Global {
    /// [`Error::GlobalRange`] unless `bytes` at `offset` lie inside the variable.
    pub fn check_range(&self, offset: u64, bytes: u64) -> Result<()> {
        if offset.checked_add(bytes).is_none_or(|end| end > self.size) {
            return Err(Error::GlobalRange {
                name: self.name.clone(),
                size: self.size,
                offset,
                bytes,
            });
        }
        Ok(())
    }
}

/// The newest module generation (see [`Module`]).
pub(crate) fn newest_generation() -> u64 {
    GENERATION.load(Ordering::Relaxed)
}

/// A kernel of a loaded module.
#[derive(Clone, Debug)]
pub struct Kernel {
    module: Arc<Module>,
    index: usize,
}

impl Kernel {
    /// The kernel's attributes and parameter table from the cubin.
    pub fn info(&self) -> &KernelInfo {
        &self.module.cubin.kernels()[self.index]
    }

    /// The kernel's symbol (mangled).
    pub fn name(&self) -> &str {
        &self.info().name
    }

    /// The module the kernel belongs to (kept loaded by the kernel).
    pub fn module(&self) -> &Arc<Module> {
        &self.module
    }

    /// GPU address of the kernel's first instruction.
    pub fn program_va(&self) -> u64 {
        self.module.base_va() + self.info().code_offset
    }
}
