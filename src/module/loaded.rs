//! Modules: a cubin's image linked and uploaded into GPU memory, its kernels looked up by name.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tracing::debug;

use crate::rm::{GpuCore, Memory, MemoryDesc};

use super::cubin::{Cubin, GlobalSymbol, KernelInfo, PlacedGlobal};
use super::printf::{PrintfFifo, PrintfFifoCell, RuntimeLink};
use super::{Error, Result, image, jit};

/// Bytes of mapped memory after the code: the SM prefetches instructions past a kernel's end.
const PREFETCH_PADDING: u64 = 0x1000;

/// Every module load bumps this; a queue that has not invalidated its instruction caches since the newest
/// load does so before its next launch.
static GENERATION: AtomicU64 = AtomicU64::new(1);

/// A loaded cubin.
///
/// Loading is lazy by default, as CUDA's is since 12.2: the module's data (`__device__` and `__constant__`
/// variables, constant-bank templates) goes to GPU memory at load, each kernel's code at its first lookup
/// ([`Module::kernel`]) together with the code it calls. PyTorch's modules hold over a thousand kernels of which a
/// program launches a few; their image is laid out and allocated whole at load, so addresses never change.
/// `CUDA_MODULE_LOADING=EAGER`, the variable CUDA reads, uploads everything at load.
#[derive(Debug)]
pub struct Module {
    cubin: Cubin,
    image: Memory,
    /// The module-load generation of the newest upload into the image (see [`GENERATION`]).
    generation: AtomicU64,
    /// The ring `printf`/`assert` records go to, when the module calls them.
    printf: Option<Arc<PrintfFifo>>,
    /// Kernels that call an external APEX does not provide, or whose parameter table does not describe their
    /// parameter block, with the reason: refused when looked up.
    refused: Vec<(String, super::cubin::CubinError)>,
    /// `__device__` variables that live outside the image ([`Module::load_placed`]).
    placed: Vec<PlacedGlobal>,
    /// APEX's device runtime functions appended to the image, for the code calling them.
    runtime: Option<RuntimeLink>,
    /// Externals APEX does not provide: references link to 0 (only refused kernels make them).
    unsupported: Vec<String>,
    /// Per kernel, read from its code at its first lookup: the texture or surface instruction that refuses it.
    textures: Vec<std::sync::OnceLock<Option<super::cubin::CubinError>>>,
    /// Per image section: in GPU memory (set only once the whole upload it was part of is written).
    done: Vec<AtomicBool>,
    /// Serializes uploads.
    uploading: Mutex<Uploading>,
}

#[derive(Debug)]
struct Uploading {
    /// Code sections still to upload.
    code_left: usize,
}

/// The section of the module-wide `__constant__` bank (bank 3).
const CONSTANT_BANK: &str = ".nv.constant3";

/// Constant banks are bound by an address the QMD stores shifted right by 6.
const BANK_ALIGN: u64 = 64;

/// Most of a constant bank's variables whose homes are checked against the cubin's layout (a bank with more has an
/// evenly spaced sample checked, its first and last included): each is a question to CUDA.
const BANK_CHECKS: usize = 64;

/// Where the module's `__constant__` bank lives when `place` gives a home for its variables (CUDA's instance's bank,
/// which `cudaMemcpyToSymbol` writes): the bank's image range placed at the home of its first variable less that
/// variable's offset, where every variable checked (all, up to [`BANK_CHECKS`]; the compiler's constants aside) has
/// its home at the same place relative to it: one bank, laid out as the cubin's. `None` (the module's own bank) when
/// a variable checked has no home (a module-local one CUDA does not name), a home disagrees, or the bank would not be
/// 64-byte aligned.
fn shared_constant_bank(
    cubin: &Cubin,
    place: &dyn Fn(&GlobalSymbol) -> Option<VariableHome>,
) -> Option<PlacedGlobal> {
    let (index, section) = cubin
        .image_sections()
        .enumerate()
        .find(|(_, s)| s.name == CONSTANT_BANK)?;
    if cubin.section_stores_code_addresses(index) {
        // Function pointers in `__constant__` data: the other instance's bank points at its own code (and runtime).
        debug!("the constant bank holds code addresses; the module keeps its own");
        return None;
    }
    let vars: Vec<&GlobalSymbol> = cubin
        .globals()
        .iter()
        .filter(|g| g.section == CONSTANT_BANK && g.size > 0 && !g.is_compiler_constant())
        .collect();
    let base_of = |g: &GlobalSymbol| {
        let home = place(g)?;
        if home.size < g.size {
            return None;
        }
        home.address
            .checked_sub(g.image_offset.checked_sub(section.image_offset)?)
    };
    let first = vars.first()?;
    let Some(base) = base_of(first) else {
        debug!(variable = %first.name, "no home for the constant bank's first variable; the module keeps its own bank");
        return None;
    };
    let stride = vars.len().div_ceil(BANK_CHECKS).max(1);
    let checked = (stride..vars.len())
        .step_by(stride)
        .chain((vars.len() > 1).then_some(vars.len() - 1));
    for i in checked {
        let other = base_of(vars[i]);
        if other != Some(base) {
            debug!(
                base = format_args!("{base:#x}"),
                variable = %vars[i].name,
                other = ?other.map(|b| format!("{b:#x}")),
                "the constant bank's homes disagree with the cubin's layout; the module keeps its own"
            );
            return None;
        }
    }
    if base % BANK_ALIGN != 0 {
        debug!(
            base = format_args!("{base:#x}"),
            "the constant bank would be misaligned; the module keeps its own"
        );
        return None;
    }
    Some(PlacedGlobal {
        image_offset: section.image_offset,
        size: section.size,
        address: base,
    })
}

/// Whether modules load eagerly (`CUDA_MODULE_LOADING=EAGER`), read once.
fn eager_loading() -> bool {
    static EAGER: OnceLock<bool> = OnceLock::new();
    *EAGER.get_or_init(|| {
        std::env::var("CUDA_MODULE_LOADING").is_ok_and(|v| v.trim().eq_ignore_ascii_case("eager"))
    })
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
        Module::load_placed_as(gpu, bytes, printf, place, eager_loading())
    }

    /// As [`Module::load_placed`], all code uploaded at load when `eager`.
    pub(crate) fn load_placed_as(
        gpu: &Arc<GpuCore>,
        bytes: &[u8],
        printf: &PrintfFifoCell,
        place: &dyn Fn(&GlobalSymbol) -> Option<VariableHome>,
        eager: bool,
    ) -> Result<Arc<Module>> {
        let sm = gpu.info().sm_version;
        // Phase times for the debug log: a large module (PyTorch's) takes a program's thread for milliseconds.
        let started = std::time::Instant::now();
        // A cubin as it is; the best code of a fatbin or host binary; PTX compiled for this GPU.
        let (cubin_bytes, parsed) = image::parsed_cubin_for_device(bytes, sm, jit::Jit::system())?;
        let select_us = started.elapsed().as_micros();
        let cubin = match parsed {
            Some(c) => c,
            None => Cubin::parse_vec(cubin_bytes.into_owned()).map_err(|(e, _)| e)?,
        };
        cubin.check_arch(sm)?;
        let parse_us = started.elapsed().as_micros() - select_us;
        let (kernels, globals) = (cubin.kernels().len(), cubin.globals().len());
        let cubin_bytes = cubin.bytes().len();
        let placing = std::cell::Cell::new(std::time::Duration::ZERO);
        let timed_place = |g: &GlobalSymbol| {
            let t = std::time::Instant::now();
            let home = place(g);
            placing.set(placing.get() + t.elapsed());
            home
        };
        let m = Module::from_cubin(gpu, cubin, printf, &timed_place, eager);
        debug!(
            image_bytes = bytes.len(),
            cubin_bytes,
            kernels,
            globals,
            eager,
            select_us,
            parse_us,
            place_us = placing.get().as_micros(),
            total_us = started.elapsed().as_micros(),
            "module load phases"
        );
        m
    }

    /// Allocates the image of a parsed cubin (with APEX's device runtime appended if the module calls it) and
    /// uploads its data, and its code too when `eager`.
    fn from_cubin(
        gpu: &Arc<GpuCore>,
        mut cubin: Cubin,
        printf: &PrintfFifoCell,
        place: &dyn Fn(&GlobalSymbol) -> Option<VariableHome>,
        eager: bool,
    ) -> Result<Arc<Module>> {
        let mut placed = Vec::new();
        // Zero-size symbols (unsized `extern` arrays) cover no bytes: nothing to share. The compiler's constants are
        // never placed: each instance holds the same bytes, which nothing writes, and their names are not unique.
        let placeable =
            |g: &&GlobalSymbol| !g.is_constant() && g.size > 0 && !g.is_compiler_constant();
        // How many variables have each name, counted at the first home given.
        let mut names: Option<std::collections::HashMap<&str, usize>> = None;
        for g in cubin.globals().iter().filter(placeable) {
            if let Some(VariableHome { address, size }) = place(g) {
                let names = names.get_or_insert_with(|| {
                    let mut n = std::collections::HashMap::new();
                    for o in cubin.globals() {
                        *n.entry(o.name.as_str()).or_insert(0) += 1;
                    }
                    n
                });
                let count = names.get(g.name.as_str()).copied().unwrap_or(1);
                if count > 1 {
                    return Err(Error::AmbiguousGlobal {
                        name: g.name.clone(),
                        count,
                    });
                }
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
        if let Some(bank) = shared_constant_bank(&cubin, place) {
            placed.push(bank);
        }
        let plan = RuntimeLink::plan(cubin.sm_version(), cubin.externals(), cubin.image_size());
        // Cubins list each kernel's externals; where none does, every kernel is taken to call all of them.
        let listed = cubin.kernels().iter().any(|k| !k.externs.is_empty());
        // Externals APEX does not provide: the kernels that call them are refused when looked up, the others run.
        // Where the cubin does not say which kernel calls what, the whole module is refused before anything is
        // allocated.
        let mut refused: Vec<(String, super::cubin::CubinError)> = cubin
            .kernels()
            .iter()
            .filter_map(|k| {
                let why = k.parameter_table_problem()?;
                Some((
                    k.name.clone(),
                    super::cubin::CubinError::ParameterTable {
                        kernel: k.name.clone(),
                        why,
                    },
                ))
            })
            .collect();
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
        let unsupported = plan
            .unsupported
            .iter()
            .filter_map(|e| match e {
                super::cubin::CubinError::UnsupportedExtern { symbol, .. } => Some(symbol.clone()),
                _ => None,
            })
            .collect();
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
        if let (Some(rt), Some(fifo)) = (&runtime, &fifo) {
            let (at, code) = rt.link_region(fifo.va())?;
            image.write(at, &code)?;
        }
        let sections = cubin.image_section_count();
        let kernels = cubin.kernels().len();
        let code_left = (0..sections).filter(|&i| cubin.section_is_code(i)).count();
        let module = Module {
            cubin,
            image,
            generation: AtomicU64::new(0),
            printf: fifo,
            refused,
            placed,
            runtime,
            unsupported,
            textures: (0..kernels).map(|_| std::sync::OnceLock::new()).collect(),
            done: (0..sections).map(|_| AtomicBool::new(false)).collect(),
            uploading: Mutex::new(Uploading { code_left }),
        };
        // The data, and the code it refers to (function pointers, jump tables): anything may use it.
        let roots: Vec<usize> = (0..sections)
            .filter(|&i| eager || !module.cubin.section_is_code(i))
            .collect();
        module.upload(&mut module.lock_uploading(), roots)?;
        debug!(
            va = format_args!("{:#x}", module.image.va()),
            size,
            kernels = module.cubin.kernels().len(),
            code_sections_left = module.lock_uploading().code_left,
            "module loaded"
        );
        Ok(Arc::new(module))
    }

    fn lock_uploading(&self) -> std::sync::MutexGuard<'_, Uploading> {
        // Sections are marked done only after a whole upload is written: a panic leaves nothing half done.
        self.uploading.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn is_done(&self, section: usize) -> bool {
        self.done
            .get(section)
            .is_none_or(|d| d.load(Ordering::Acquire))
    }

    /// Links and writes `roots` and every section they refer to that is not in GPU memory yet, all or nothing:
    /// every section is linked before anything is written, so a section that fails to link leaves none of them
    /// marked (its next lookup fails the same way). A new generation when anything went up: queues invalidate
    /// their instruction caches before their next launch of the module.
    fn upload(&self, up: &mut Uploading, roots: Vec<usize>) -> Result<()> {
        let base = self.image.va();
        let resolve = |name: &str| {
            // Calls to an unsupported external stay 0: only kernels refused at lookup make them.
            self.runtime
                .as_ref()
                .and_then(|r| r.address(base, name))
                .or_else(|| self.unsupported.iter().any(|u| u == name).then_some(0))
        };
        let mut wanted = vec![false; self.done.len()];
        let mut work = roots;
        let mut linked = Vec::new();
        while let Some(i) = work.pop() {
            if self.is_done(i) || wanted[i] {
                continue;
            }
            wanted[i] = true;
            let mut bytes = Vec::new();
            let at = self
                .cubin
                .link_section(i, base, &mut bytes, &resolve, &self.placed)?;
            linked.push((i, at, bytes));
            work.extend(
                self.cubin
                    .section_refers_to(i)
                    .filter(|&j| !self.is_done(j) && !wanted[j]),
            );
        }
        if linked.is_empty() {
            return Ok(());
        }
        for (_, at, bytes) in &linked {
            self.image.write(*at, bytes)?;
        }
        let generation = GENERATION.fetch_add(1, Ordering::AcqRel) + 1;
        self.generation.store(generation, Ordering::Release);
        for (i, _, _) in &linked {
            if self.cubin.section_is_code(*i) {
                up.code_left -= 1;
            }
            self.done[*i].store(true, Ordering::Release);
        }
        Ok(())
    }

    /// Uploads kernel `index`'s code and what it calls, unless already done.
    fn upload_kernel(&self, index: usize) -> Result<()> {
        let Some(section) = self.cubin.kernel_section(index) else {
            return Ok(()); // no code of its own in the image (an empty kernel section): nothing to upload
        };
        // A lookup of a kernel already up (every launch of the queues' built-in kernels) costs one load.
        if self.is_done(section) {
            return Ok(());
        }
        let mut up = self.lock_uploading();
        if self.is_done(section) {
            return Ok(());
        }
        let started = std::time::Instant::now();
        self.upload(&mut up, vec![section])?;
        debug!(
            kernel = %self.cubin.kernels()[index].name,
            us = started.elapsed().as_micros(),
            code_sections_left = up.code_left,
            "kernel code uploaded"
        );
        Ok(())
    }

    /// The GPU the module is loaded on.
    pub fn gpu(&self) -> &Arc<GpuCore> {
        self.image.gpu()
    }

    /// The linked image as it is in GPU memory (for inspection: what the loader laid out and relocated), every
    /// kernel's code uploaded first ([`Module::load_all_kernels`]).
    pub fn image_bytes(&self) -> Result<Vec<u8>> {
        self.load_all_kernels()?;
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

    /// The address launches bind for the constant bank whose template is at `image_offset` in the image: the
    /// module's own copy, or where the bank was placed ([`Module::shares_constants`]).
    pub fn bank_va(&self, image_offset: u64) -> u64 {
        self.placed
            .iter()
            .find(|p| p.image_offset == image_offset)
            .map_or(self.base_va() + image_offset, |p| p.address)
    }

    /// Whether the module's `__constant__` bank is another instance's (placed at load, as CUDA's instance keeps it
    /// for `cudaMemcpyToSymbol`): writes through that instance's addresses reach this module's launches.
    pub fn shares_constants(&self) -> bool {
        self.cubin
            .image_sections()
            .find(|s| s.name == CONSTANT_BANK)
            .is_some_and(|s| self.placed.iter().any(|p| p.image_offset == s.image_offset))
    }

    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The kernel called `name`.
    pub fn kernel(self: &Arc<Self>, name: &str) -> Result<Kernel> {
        let index = self.kernel_index(name)?;
        let found = &self.cubin.kernels()[index].name;
        if let Some((_, e)) = self.refused.iter().find(|(k, _)| k == found) {
            return Err(Error::KernelRefused {
                kernel: found.clone(),
                reason: e.clone(),
            });
        }
        // Read once per kernel, from the code alone: a kernel's lookup is cheap after its first.
        if let Some(e) = self.textures[index].get_or_init(|| self.cubin.texture_use(index)) {
            return Err(Error::KernelRefused {
                kernel: found.clone(),
                reason: e.clone(),
            });
        }
        self.upload_kernel(index)?;
        Ok(Kernel {
            module: self.clone(),
            index,
        })
    }

    /// Whether kernel `name`'s code is in GPU memory (what `cuFuncIsLoaded` tells of a CUDA function): it goes up
    /// at the kernel's first [`Module::kernel`] lookup, with the code it calls, or at load under
    /// `CUDA_MODULE_LOADING=EAGER`.
    pub fn kernel_is_loaded(&self, name: &str) -> Result<bool> {
        let index = self.kernel_index(name)?;
        Ok(self
            .cubin
            .kernel_section(index)
            .is_none_or(|section| self.is_done(section)))
    }

    /// The index of the kernel `name` names (see [`Cubin::kernel`]), or the error a lookup gives.
    fn kernel_index(&self, name: &str) -> Result<usize> {
        self.cubin.kernel_index(name).map_err(|e| match e {
            super::cubin::CubinError::NoSuchKernel(_) => Error::NoSuchKernel {
                name: name.to_string(),
                available: self.kernel_names(),
            },
            e => e.into(),
        })
    }

    /// Uploads the code of every kernel not looked up yet (what `CUDA_MODULE_LOADING=EAGER` does at load), so that
    /// no later lookup spends time on it.
    pub fn load_all_kernels(&self) -> Result<()> {
        let mut up = self.lock_uploading();
        let roots = (0..self.done.len()).filter(|&i| !self.is_done(i)).collect();
        self.upload(&mut up, roots)
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
            .find(|p| {
                g.image_offset >= p.image_offset && g.image_offset - p.image_offset < p.size.max(1)
            })
            .map_or(self.base_va() + g.image_offset, |p| {
                p.address + (g.image_offset - p.image_offset)
            });
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
    // Pairs with the upload's release: the code of every generation read here is written.
    GENERATION.load(Ordering::Acquire)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rm::sim::SimConfig;
    use crate::sim::Simulator;

    fn kernel_named(name: &str) -> KernelInfo {
        let fixture = include_bytes!("../../kernels/conformance/templates.sm_90.cubin");
        let mut k = Cubin::parse(fixture).unwrap().kernels()[0].clone();
        k.name = name.to_owned();
        k
    }

    /// A kernel's lookup uploads its code and the code its relocations reach, nothing else; an upload whose code
    /// does not link writes and marks nothing, and fails again at the next lookup.
    #[test]
    fn lookups_upload_a_kernels_code_and_callees_all_or_nothing() {
        let (gpu, _sim) = Simulator::open(SimConfig::default()).unwrap();
        let bytes = |b: u8| vec![b; 32];
        let cubin = Cubin::synthetic(
            &[
                (".nv.global.init", false, bytes(0x11)),
                (".text.a", true, bytes(0xa1)),
                (".text.callee", true, bytes(0xb2)),
                (".text.c", true, bytes(0xc3)),
                (".text.d", true, bytes(0xd4)),
                (".text.broken", true, bytes(0xe5)),
            ],
            &[
                (1, 8, Ok((2, 0))),     // a calls callee
                (4, 8, Ok((5, 16))),    // d calls broken
                (5, 0, Err("missing")), // broken refers to an external nothing provides
            ],
            vec![
                (kernel_named("a"), 1),
                (kernel_named("c"), 3),
                (kernel_named("d"), 4),
            ],
        );
        let offsets: Vec<u64> = cubin.image_sections().map(|s| s.image_offset).collect();
        let m = Arc::new(
            Module::from_cubin(&gpu, cubin, &PrintfFifoCell::new(), &|_| None, false).unwrap(),
        );
        let read = |section: usize| {
            let mut b = vec![0u8; 32];
            m.image.read(offsets[section], &mut b).unwrap();
            b
        };
        let zeros = vec![0u8; 32];
        assert_eq!(read(0), bytes(0x11), "data goes up at load");
        for s in 1..6 {
            assert_eq!(read(s), zeros, "no code at load (section {s})");
        }
        let loaded = m.generation();

        m.kernel("a").unwrap();
        let mut a = bytes(0xa1);
        a[8..16].copy_from_slice(&(m.base_va() + offsets[2]).to_le_bytes());
        assert_eq!(read(1), a, "a, linked");
        assert_eq!(read(2), bytes(0xb2), "its callee with it");
        assert_eq!(read(3), zeros, "c is not looked up");
        assert!(m.kernel_is_loaded("a").unwrap() && !m.kernel_is_loaded("c").unwrap());
        let after_a = m.generation();
        assert!(after_a > loaded, "new code: a new generation");
        m.kernel("a").unwrap();
        assert_eq!(m.generation(), after_a, "nothing new the second time");

        for _ in 0..2 {
            let e = m.kernel("d").unwrap_err();
            assert!(e.to_string().contains("missing"), "{e}");
            assert_eq!(
                read(4),
                zeros,
                "d is not written when its callee fails to link"
            );
            assert_eq!(read(5), zeros);
            assert!(!m.kernel_is_loaded("d").unwrap());
            assert_eq!(m.generation(), after_a);
        }
        // Everything else still loads.
        assert!(
            m.load_all_kernels().is_err(),
            "the broken section still fails"
        );
        m.kernel("c").unwrap();
        assert_eq!(read(3), bytes(0xc3));
    }

    /// A kernel whose code, or code it calls (directly, or through a table of function pointers), holds a texture or
    /// surface instruction is refused at every lookup with the instruction named, and nothing of it goes up; the
    /// module's other kernels load.
    #[test]
    fn kernels_using_textures_or_surfaces_are_refused_at_lookup() {
        let (gpu, _sim) = Simulator::open(SimConfig::default()).unwrap();
        let plain = vec![0x11u8; 32];
        // A NOP, then `TEX.LL` as nvcc 13.0 emits it for sm_90 (low word 0x20000403080f7f60).
        let mut tex = 0x0000000000007918u64.to_le_bytes().to_vec();
        tex.extend_from_slice(&[0; 8]);
        tex.extend_from_slice(&0x20000403080f7f60u64.to_le_bytes());
        tex.extend_from_slice(&[0; 8]);
        // `SUST` first.
        let mut sust = 0x10000a0b04007f9du64.to_le_bytes().to_vec();
        sust.extend_from_slice(&[0; 24]);
        let cubin = Cubin::synthetic(
            &[
                (".text.caller", true, plain.clone()),
                (".text.sampler", true, tex),
                (".text.writer", true, sust),
                (".text.other", true, plain.clone()),
                (".text.indirect", true, plain),
                (".nv.global.init", false, vec![0; 16]),
            ],
            &[
                (0, 8, Ok((1, 0))), // caller calls sampler
                (4, 8, Ok((5, 0))), // indirect reads a table of function pointers...
                (5, 0, Ok((1, 0))), // ...that holds sampler
            ],
            vec![
                (kernel_named("caller"), 0),
                (kernel_named("writer"), 2),
                (kernel_named("other"), 3),
                (kernel_named("indirect"), 4),
            ],
        );
        let m = Arc::new(
            Module::from_cubin(&gpu, cubin, &PrintfFifoCell::new(), &|_| None, false).unwrap(),
        );
        for _ in 0..2 {
            match m.kernel("caller").unwrap_err() {
                Error::KernelRefused {
                    kernel,
                    reason:
                        crate::module::cubin::CubinError::TextureInstructions {
                            kind,
                            section,
                            offset,
                            ..
                        },
                } => {
                    assert_eq!(kernel, "caller");
                    assert_eq!(
                        (kind, section.as_str(), offset),
                        ("texture", ".text.sampler", 16)
                    );
                }
                e => panic!("{e}"),
            }
            assert!(
                !m.kernel_is_loaded("caller").unwrap(),
                "nothing of it goes up"
            );
        }
        let e = m.kernel("writer").unwrap_err();
        assert!(
            e.to_string().contains("surface instructions")
                && e.to_string().contains("APEX_BACKEND=driver"),
            "{e}"
        );
        let e = m.kernel("indirect").unwrap_err();
        assert!(e.to_string().contains(".text.sampler"), "{e}");
        m.kernel("other").unwrap();
    }

    /// A module loaded beside another instance binds that instance's `__constant__` bank when given its variables'
    /// homes (placed at the first variable's home less its offset, checked against the last one's): lookups answer
    /// inside it and launches bind it. Homes that disagree with the cubin's layout, or a bank launches could not
    /// bind (not 64-byte aligned), leave the module its own bank.
    #[test]
    fn the_constant_bank_goes_where_its_variables_homes_say() {
        const CUBIN: &[u8] = include_bytes!("../../kernels/conformance/module_data.sm_90.cubin");
        let (gpu, _sim) = Simulator::open(SimConfig::default()).unwrap();
        let section = Cubin::parse(CUBIN)
            .unwrap()
            .image_sections()
            .find(|s| s.name == CONSTANT_BANK)
            .cloned()
            .unwrap();
        // Homes laid out as the cubin's from `bank`, but `skewed`'s moved by `skew` bytes.
        let load = |bank: u64, skewed: &str, skew: u64| {
            let cubin = Cubin::parse(CUBIN).unwrap();
            let home = |g: &GlobalSymbol| {
                g.is_constant().then(|| VariableHome {
                    address: bank
                        + (g.image_offset - section.image_offset)
                        + if g.name == skewed { skew } else { 0 },
                    size: g.size,
                })
            };
            Module::from_cubin(&gpu, cubin, &PrintfFifoCell::new(), &home, false).unwrap()
        };
        let bank = 0x7_0000_0000;
        let m = load(bank, "", 0);
        assert!(m.shares_constants());
        assert_eq!(m.bank_va(section.image_offset), bank);
        let g = m.cubin().global("cdouble").unwrap().clone();
        assert_eq!(
            m.global("cdouble").unwrap().va,
            bank + g.image_offset - section.image_offset
        );
        // A misaligned bank; the last variable's home elsewhere; a middle one's.
        for (bank, skewed, skew) in [
            (bank + 8, "", 0),
            (bank, "cptr", 64),
            (bank, "ctable_zero", 16),
        ] {
            let m = load(bank, skewed, skew);
            assert!(
                !m.shares_constants(),
                "bank {bank:#x}, {skewed} off by {skew}"
            );
            assert_eq!(
                m.bank_va(section.image_offset),
                m.base_va() + section.image_offset
            );
            assert_eq!(
                m.global("cdouble").unwrap().va,
                m.base_va() + g.image_offset
            );
        }
    }

    /// A constant bank holding code addresses (a table of device-function pointers) stays the module's own: the other
    /// instance's bank points at that instance's code.
    #[test]
    fn a_constant_bank_with_code_addresses_is_never_shared() {
        let (gpu, _sim) = Simulator::open(SimConfig::default()).unwrap();
        let load = |to: Option<Result<(usize, u64), &str>>| {
            let relocations: Vec<_> = to.into_iter().map(|t| (1, 0, t)).collect();
            let c = Cubin::synthetic(
                &[
                    (".text.f", true, vec![0; 64]),
                    (CONSTANT_BANK, false, vec![0; 16]),
                    (".nv.global", false, vec![0; 16]),
                ],
                &relocations,
                vec![],
            );
            let at = c.section_offset(CONSTANT_BANK).unwrap();
            let c = c.with_globals(vec![GlobalSymbol {
                name: "table".into(),
                image_offset: at,
                size: 16,
                section: CONSTANT_BANK.into(),
                local: true,
            }]);
            let home = |g: &GlobalSymbol| {
                Some(VariableHome {
                    address: 0x7_0000_0000,
                    size: g.size,
                })
            };
            Module::from_cubin(&gpu, c, &PrintfFifoCell::new(), &home, false).unwrap()
        };
        assert!(load(None).shares_constants());
        assert!(load(Some(Ok((2, 0)))).shares_constants(), "a data address");
        assert!(!load(Some(Ok((0, 0)))).shares_constants(), "a code address");
    }

    /// The compiler's constants are never given a home (each instance holds the same bytes, and a linked module has
    /// several of one name); a home given for a name several variables have is refused, naming it.
    #[test]
    fn homes_go_by_unique_names_and_never_to_compiler_constants() {
        let (gpu, _sim) = Simulator::open(SimConfig::default()).unwrap();
        let cubin = || {
            let c = Cubin::synthetic(&[(".nv.global.init", false, vec![7; 64])], &[], vec![]);
            let global = |name: &str, at: u64, local: bool| GlobalSymbol {
                name: name.into(),
                image_offset: at,
                size: 8,
                section: ".nv.global.init".into(),
                local,
            };
            c.with_globals(vec![
                global("__unnamed_1", 0, true),
                global("counter", 8, true),
                global("__unnamed_1", 16, true),
                global("counter", 24, true),
                global("total", 32, false),
            ])
        };
        let asked = std::cell::RefCell::new(Vec::new());
        let home = |g: &GlobalSymbol, give: &[&str]| {
            asked.borrow_mut().push(g.name.clone());
            give.contains(&g.name.as_str()).then_some(VariableHome {
                address: 0x9000_0000,
                size: 8,
            })
        };
        let printf = PrintfFifoCell::new();
        let Err(e) = Module::from_cubin(
            &gpu,
            cubin(),
            &printf,
            &|g| home(g, &["counter", "total"]),
            false,
        ) else {
            panic!("a home for an ambiguous name was taken");
        };
        assert!(
            matches!(&e, Error::AmbiguousGlobal { name, count: 2 } if name == "counter"),
            "{e}"
        );
        assert!(e.to_string().contains("2 variables named `counter`"), "{e}");
        asked.borrow_mut().clear();
        let c = cubin();
        let data = c.section_offset(".nv.global.init").unwrap();
        let m = Module::from_cubin(&gpu, c, &printf, &|g| home(g, &["total"]), false).unwrap();
        assert_eq!(*asked.borrow(), ["counter", "counter", "total"]);
        // The constants and the unplaced counters hold their bytes in the module's own image.
        let mut b = vec![0u8; 32];
        m.image.read(data, &mut b).unwrap();
        assert_eq!(b, vec![7; 32]);
    }
}
