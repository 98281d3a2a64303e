//! The public API: one set of types over two backends. The direct path (our own channel, launches by
//! doorbell) is chosen when it can run; otherwise the CUDA driver API, with the reason available and logged.
//!
//! `APEX_BACKEND=direct|driver|auto` forces a choice (auto is the default).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tracing::info;

use crate::driver;

mod cuda_attach;
use crate::launch::printf::{PrintfFifo, PrintfFifoCell};
use crate::launch::{
    self, Arg, ComputeQueue, ComputeQueueConfig, LaunchConfig, Limits, cubin::KernelInfo,
};
use crate::pushbuf;
use crate::rm::{self, GpuCore, Memory, MemoryDesc, Placement};

/// Which implementation runs the work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// APEX's own channel: RM ioctls, pushbuffers, QMDs, doorbell.
    Direct,
    /// The CUDA driver API (libcuda).
    Driver,
}

/// What the caller (or `APEX_BACKEND`) asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendRequest {
    /// Use the direct path when it can run here, else the CUDA driver.
    Auto,
    /// Only the direct path: opening fails with the reason when it cannot run.
    Direct,
    /// Only the CUDA driver (libcuda), even where the direct path could run.
    Driver,
}

impl BackendRequest {
    /// Reads `APEX_BACKEND` (unset or empty = auto).
    pub fn from_env() -> Result<BackendRequest> {
        match std::env::var("APEX_BACKEND") {
            Err(_) => Ok(BackendRequest::Auto),
            Ok(v) => BackendRequest::parse(&v),
        }
    }

    /// Parses a request as `APEX_BACKEND` spells it (`direct`, `driver` or `cuda`, `auto` or empty), ignoring case.
    pub fn parse(v: &str) -> Result<BackendRequest> {
        match v.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(BackendRequest::Auto),
            "direct" => Ok(BackendRequest::Direct),
            "driver" | "cuda" => Ok(BackendRequest::Driver),
            _ => Err(Error::BadBackendVar(v.to_string())),
        }
    }
}

/// Why the direct path was not used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FallbackReason {
    /// `APEX_BACKEND=driver` (or `Backend::Driver` asked for).
    Requested,
    /// /dev/nvidiactl, /dev/nvidiaN or /dev/nvidia-uvm does not exist (no NVIDIA open kernel module loaded?).
    NoDeviceNodes(String),
    /// The device nodes exist but this user may not open them.
    PermissionDenied(String),
    /// The loaded driver is not of the branch whose RM structures APEX was built with.
    DriverBranch {
        /// The loaded driver's version.
        found: String,
        /// The branch APEX supports.
        expected: u32,
    },
    /// The GPU lists no channel/compute/usermode class in APEX's tables, or the launch recipe is not verified on it.
    UnsupportedGpu(String),
    /// The direct path failed for another reason (the error is kept).
    Failed(String),
}

impl FallbackReason {
    /// Classifies a direct-path error.
    pub fn from_direct_error(e: &launch::Error) -> FallbackReason {
        use crate::gpfifo::Error as G;
        use launch::Error as L;
        use pushbuf::Error as P;
        let rm_err = match e {
            L::Queue(P::Channel(G::Rm(r))) => Some(r),
            _ => None,
        };
        match (e, rm_err) {
            (_, Some(rm::Error::NoDeviceNode { path })) => {
                FallbackReason::NoDeviceNodes(path.clone())
            }
            (_, Some(rm::Error::PermissionDenied { path })) => {
                FallbackReason::PermissionDenied(path.clone())
            }
            (_, Some(rm::Error::DriverBranch { found, expected })) => {
                FallbackReason::DriverBranch {
                    found: found.clone(),
                    expected: *expected,
                }
            }
            (_, Some(e @ rm::Error::UnsupportedClass { .. })) => {
                FallbackReason::UnsupportedGpu(e.to_string())
            }
            (L::Unsupported(why), _) => FallbackReason::UnsupportedGpu(why.clone()),
            _ => FallbackReason::Failed(e.to_string()),
        }
    }
}

impl fmt::Display for FallbackReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FallbackReason::Requested => write!(f, "the CUDA driver backend was requested"),
            // The RM layer's sentences say what to do; one wording for both.
            FallbackReason::NoDeviceNodes(p) => rm::Error::NoDeviceNode { path: p.clone() }.fmt(f),
            FallbackReason::PermissionDenied(p) => {
                rm::Error::PermissionDenied { path: p.clone() }.fmt(f)
            }
            FallbackReason::DriverBranch { found, expected } => {
                write!(
                    f,
                    "the loaded NVIDIA driver is {found}, not of branch {expected}, which APEX's RM structures \
                     come from; install a {expected}.x open kernel module to use the direct path"
                )
            }
            FallbackReason::UnsupportedGpu(why) => {
                write!(f, "GPU not supported by the direct path: {why}")
            }
            FallbackReason::Failed(why) => write!(f, "the direct path failed: {why}"),
        }
    }
}

/// The backend chosen for a GPU and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// The backend that runs this GPU's work.
    pub backend: Backend,
    /// What was asked for (`APEX_BACKEND` or [`Gpu::open_with`]).
    pub requested: BackendRequest,
    /// Set when the driver backend runs instead of the direct path.
    pub fallback: Option<FallbackReason>,
}

impl fmt::Display for Selection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.backend, &self.fallback) {
            (Backend::Direct, _) => write!(f, "direct (own channel, doorbell launches)"),
            (Backend::Driver, Some(r)) => write!(f, "CUDA driver: {r}"),
            (Backend::Driver, None) => write!(f, "CUDA driver"),
        }
    }
}

/// Decides the backend from the request and what opening the direct path gave. Pure, so every case is tested.
pub fn choose<T>(
    request: BackendRequest,
    direct: impl FnOnce() -> std::result::Result<T, launch::Error>,
) -> (Option<T>, Selection) {
    match request {
        BackendRequest::Driver => (
            None,
            Selection {
                backend: Backend::Driver,
                requested: request,
                fallback: Some(FallbackReason::Requested),
            },
        ),
        BackendRequest::Direct | BackendRequest::Auto => match direct() {
            Ok(t) => (
                Some(t),
                Selection {
                    backend: Backend::Direct,
                    requested: request,
                    fallback: None,
                },
            ),
            Err(e) => (
                None,
                Selection {
                    backend: Backend::Driver,
                    requested: request,
                    fallback: Some(FallbackReason::from_direct_error(&e)),
                },
            ),
        },
    }
}

/// Errors of the public API.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum Error {
    /// The direct path failed.
    #[error(transparent)]
    Direct(#[from] launch::Error),
    /// The CUDA driver backend failed.
    #[error(transparent)]
    Driver(#[from] driver::Error),
    /// `APEX_BACKEND` holds something else than `direct`, `driver` or `auto`.
    #[error(
        "APEX_BACKEND={0:?} is not a backend APEX knows; set it to direct, driver or auto (or unset it)"
    )]
    BadBackendVar(String),
    /// The direct path was asked for (`APEX_BACKEND=direct`) and cannot run.
    #[error(
        "the direct path was requested (APEX_BACKEND=direct) but cannot run: {0}; or unset APEX_BACKEND to fall \
         back to the CUDA driver"
    )]
    DirectUnavailable(FallbackReason),
    /// Neither backend could open the GPU.
    #[error(
        "cannot open GPU {index} with either backend. The direct path cannot run: {direct}. The CUDA driver \
         backend cannot run either: {driver}."
    )]
    NoBackend {
        /// The GPU index asked for.
        index: usize,
        /// Why the direct path cannot run.
        direct: FallbackReason,
        /// Why the CUDA driver backend cannot run.
        driver: driver::Error,
    },
    /// An argument the caller passed is not valid; the text says which and why.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Objects of different GPUs or backends were used together.
    #[error(
        "the objects belong to different backends or GPUs; use buffers, modules and queues of the same Gpu together"
    )]
    Mismatch,
    /// A module file could not be read.
    #[error("cannot read the module file {}: {source}", path.display())]
    ReadModule {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl From<rm::Error> for Error {
    fn from(e: rm::Error) -> Error {
        Error::Direct(e.into())
    }
}

impl From<pushbuf::Error> for Error {
    fn from(e: pushbuf::Error) -> Error {
        Error::Direct(e.into())
    }
}

/// The public API's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What both backends report about the device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device's marketing name (`NVIDIA H200`).
    pub name: String,
    /// Compute capability as major × 10 + minor (90 for Hopper).
    pub sm_version: u32,
    /// Streaming multiprocessors on the device.
    pub sm_count: u32,
    /// Video memory, bytes.
    pub memory_bytes: u64,
}

/// What the CUDA driver reports about a context's device.
fn driver_info(ctx: &driver::Context) -> Result<DeviceInfo> {
    use cudarc::driver::sys::CUdevice_attribute as A;
    let major = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? as u32;
    let minor = ctx.attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? as u32;
    Ok(DeviceInfo {
        name: ctx.name()?,
        sm_version: major * 10 + minor,
        sm_count: ctx.attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
        memory_bytes: ctx.total_memory()?,
    })
}

#[derive(Debug)]
enum GpuInner {
    Direct(Arc<GpuCore>),
    Driver(Arc<driver::Context>),
}

/// An opened GPU, on the backend chosen for it: the handle every buffer, module and queue is made from.
///
/// Dropping it closes the GPU once the objects made from it are dropped too (they hold it alive).
///
/// ```no_run
/// # fn main() -> apex::Result<()> {
/// let gpu = apex::Gpu::open(0)?;
/// let info = gpu.info();
/// println!("{} (sm_{}, {} SMs): {}", info.name, info.sm_version, info.sm_count, gpu.selection());
/// let buffer = gpu.alloc(1 << 20)?;
/// assert_eq!(buffer.size(), 1 << 20);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Gpu {
    inner: GpuInner,
    selection: Selection,
    info: DeviceInfo,
    limits: Limits,
    /// The direct path's device printf FIFO, shared by this GPU's modules.
    printf: PrintfFifoCell,
    /// The CUDA context this GPU is attached to ([`Gpu::attach_cuda`]).
    cuda: Option<Arc<driver::CudaContext>>,
}

impl Gpu {
    /// Opens GPU `index` with the backend `APEX_BACKEND` asks for (auto by default).
    pub fn open(index: usize) -> Result<Gpu> {
        Gpu::open_with(index, BackendRequest::from_env()?)
    }

    /// Opens GPU `index` with the backend `request` asks for, regardless of `APEX_BACKEND`.
    pub fn open_with(index: usize, request: BackendRequest) -> Result<Gpu> {
        let (core, selection) = choose(request, || {
            let core = GpuCore::open(index)?;
            // Building a compute queue proves the launch path (QMD layout, windows, local memory) on this GPU.
            ComputeQueue::new(&core, ComputeQueueConfig::default())?;
            Ok(core)
        });
        let inner = match core {
            Some(core) => GpuInner::Direct(core),
            None => {
                let reason = selection
                    .fallback
                    .clone()
                    .unwrap_or(FallbackReason::Requested);
                if request == BackendRequest::Direct {
                    return Err(Error::DirectUnavailable(reason));
                }
                match driver::Context::new(index) {
                    Ok(ctx) => GpuInner::Driver(ctx),
                    Err(e) => {
                        return Err(Error::NoBackend {
                            index,
                            direct: reason,
                            driver: e,
                        });
                    }
                }
            }
        };
        let info = match &inner {
            GpuInner::Direct(c) => {
                let i = c.info();
                DeviceInfo {
                    name: i.name.clone(),
                    sm_version: i.sm_version,
                    sm_count: i.sm_count,
                    memory_bytes: i.memory_bytes,
                }
            }
            GpuInner::Driver(ctx) => driver_info(ctx)?,
        };
        info!(gpu = index, backend = ?selection.backend, reason = %selection, "APEX backend selected");
        let limits = Limits::for_sm(info.sm_version);
        Ok(Gpu {
            inner,
            selection,
            info,
            limits,
            printf: PrintfFifoCell::new(),
            cuda: None,
        })
    }

    /// The backend this GPU's work runs on.
    pub fn backend(&self) -> Backend {
        self.selection.backend
    }

    /// The backend and, for the driver backend, why the direct path is not used.
    pub fn selection(&self) -> &Selection {
        &self.selection
    }

    /// Name, compute capability, SM count and memory, as both backends report them.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The limits every launch is checked against before it is submitted (grid, block, shared memory, ...).
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The direct path's RM objects, when that is the backend.
    pub fn direct(&self) -> Option<&Arc<GpuCore>> {
        match &self.inner {
            GpuInner::Direct(c) => Some(c),
            GpuInner::Driver(_) => None,
        }
    }

    /// Device memory.
    pub fn alloc(&self, bytes: u64) -> Result<Buffer> {
        let inner = match &self.inner {
            GpuInner::Direct(c) => BufferInner::Direct(Memory::alloc(c, MemoryDesc::video(bytes))?),
            GpuInner::Driver(ctx) => BufferInner::Driver(driver::DeviceMemory::alloc(ctx, bytes)?),
        };
        Ok(Buffer {
            inner: Arc::new(inner),
            size: bytes,
        })
    }

    /// Pinned host memory the GPU can read and write.
    pub fn alloc_host(&self, bytes: u64) -> Result<HostBuffer> {
        let inner = match &self.inner {
            GpuInner::Direct(c) => HostInner::Direct(Memory::alloc(
                c,
                MemoryDesc::video(bytes)
                    .placement(Placement::SystemCached)
                    .with_cpu(),
            )?),
            GpuInner::Driver(ctx) => HostInner::Driver(driver::HostMemory::alloc(ctx, bytes)?),
        };
        Ok(HostBuffer {
            inner: Arc::new(inner),
            size: bytes,
        })
    }

    /// Loads a cubin, a fatbin, a host executable or shared library built by nvcc (its embedded fatbins), or
    /// PTX. The best code for this GPU is picked (see [`launch::select`]); PTX, and relocatable code
    /// (`nvcc -rdc=true`) that nothing else replaces, are compiled for it by nvJitLink on the direct path (see
    /// [`launch::jit`]) and by the driver on the driver backend.
    pub fn load_module(&self, image: &[u8]) -> Result<Module> {
        match &self.inner {
            GpuInner::Direct(c) => Ok(Module::Direct(launch::Module::load_with(
                c,
                image,
                &self.printf,
            )?)),
            GpuInner::Driver(ctx) => {
                use launch::image::{self, Code, PtxHandling};
                // The driver reads cubins, fatbins and PTX itself; code in host binaries is taken out, and
                // relocatable cubins linked, here first. The code picked also gives the cubin's attributes, so
                // launches are checked as on the direct path.
                let resolved = image::resolve(
                    image,
                    self.info.sm_version,
                    launch::jit::Jit::system(),
                    PtxHandling::Keep,
                );
                let prepare = match launch::select::cubin_arch(image) {
                    Some(arch) => arch.relocatable,
                    None => image.starts_with(b"\x7fELF"),
                };
                let m = match (&resolved, prepare) {
                    (Ok(r), true) => driver::Module::load(ctx, r.code.bytes())?,
                    (Err(e), true) => return Err(launch::Error::from(e.clone()).into()),
                    (_, false) => driver::Module::load(ctx, image)?,
                };
                let cubin = match &resolved {
                    Ok(r) => match &r.code {
                        Code::Cubin(b) => launch::cubin::Cubin::parse(b).ok(),
                        Code::Ptx(_) => None,
                    },
                    Err(_) => None,
                };
                Ok(Module::Driver {
                    module: m,
                    cubin: cubin.map(Arc::new),
                })
            }
        }
    }

    /// Loads a module from a file: anything [`Gpu::load_module`] takes, such as a program or shared library
    /// built by nvcc.
    pub fn load_module_file(&self, path: impl AsRef<std::path::Path>) -> Result<Module> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| Error::ReadModule {
            path: path.to_path_buf(),
            source,
        })?;
        self.load_module(&bytes)
    }

    /// Sets the size of the buffer kernels' `printf` output goes through before it is printed (what
    /// `cudaDeviceSetLimit(cudaLimitPrintfFifoSize)` sets; 1 MiB by default). Output that does not fit between
    /// two synchronizations is dropped, as in CUDA. Must come before a module that uses `printf` or `assert` is
    /// loaded.
    pub fn set_printf_fifo_size(&self, bytes: u64) -> Result<()> {
        match &self.inner {
            GpuInner::Direct(_) => self
                .printf
                .set_size(bytes)
                .map_err(|current| launch::Error::PrintfFifoFixed { current }.into()),
            GpuInner::Driver(ctx) => Ok(ctx.set_printf_fifo_size(bytes)?),
        }
    }

    /// A queue: launches and copies on it run in order, like a CUDA stream.
    pub fn queue(&self) -> Result<Queue> {
        let inner = match &self.inner {
            GpuInner::Direct(c) => QueueInner::Direct(Box::new(ComputeQueue::new(
                c,
                ComputeQueueConfig::default(),
            )?)),
            GpuInner::Driver(ctx) => QueueInner::Driver {
                stream: driver::Stream::new(ctx)?,
                ptrs: driver::ParamPtrs::with_capacity(driver::MAX_PARAMS),
            },
        };
        Ok(Queue {
            inner,
            driver_chain: 0,
            limits: self.limits,
            keep: Vec::new(),
            staging: None,
            cuda: self.cuda.clone().map(cuda_attach::CudaOrder::new),
        })
    }
}

#[derive(Debug)]
enum BufferInner {
    Direct(Memory),
    Driver(driver::DeviceMemory),
}

/// Device memory.
#[derive(Clone, Debug)]
pub struct Buffer {
    inner: Arc<BufferInner>,
    size: u64,
}

impl Buffer {
    /// The device address kernels use.
    pub fn device_ptr(&self) -> u64 {
        match &*self.inner {
            BufferInner::Direct(m) => m.va(),
            BufferInner::Driver(m) => m.ptr(),
        }
    }

    /// Bytes allocated.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The kernel argument for this buffer's address.
    pub fn arg(&self) -> Arg<'static> {
        Arg::Ptr(self.device_ptr())
    }
}

#[derive(Debug)]
enum HostInner {
    Direct(Memory),
    Driver(driver::HostMemory),
}

/// Pinned host memory, readable and writable by the GPU.
#[derive(Clone, Debug)]
pub struct HostBuffer {
    inner: Arc<HostInner>,
    size: u64,
}

impl HostBuffer {
    /// The address the GPU uses for it.
    pub fn device_ptr(&self) -> u64 {
        match &*self.inner {
            HostInner::Direct(m) => m.va(),
            HostInner::Driver(m) => m.ptr(),
        }
    }

    /// Bytes allocated.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Copies `data` into the buffer at `offset` by the CPU (the memory is mapped); range-checked.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        match &*self.inner {
            HostInner::Direct(m) => Ok(m.write(offset, data)?),
            HostInner::Driver(m) => Ok(m.write(offset, data)?),
        }
    }

    /// Copies from the buffer at `offset` into `out` by the CPU; range-checked.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        match &*self.inner {
            HostInner::Direct(m) => Ok(m.read(offset, out)?),
            HostInner::Driver(m) => Ok(m.read(offset, out)?),
        }
    }
}

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
pub enum Module {
    /// Loaded by APEX onto the direct path.
    Direct(Arc<launch::Module>),
    /// Loaded by libcuda; the parsed cubin, when APEX could read it, checks arguments before launching.
    Driver {
        /// libcuda's module.
        module: Arc<driver::Module>,
        /// The cubin APEX parsed from the same bytes, if it could.
        cubin: Option<Arc<launch::cubin::Cubin>>,
    },
}

impl Module {
    /// The kernel `name` (the mangled symbol, or the demangled name with or without its parameter list).
    pub fn kernel(&self, name: &str) -> Result<Kernel> {
        match self {
            Module::Direct(m) => Ok(Kernel::Direct(m.kernel(name)?)),
            Module::Driver { module, cubin } => {
                let info = match cubin {
                    Some(c) => Some(c.kernel(name).map_err(launch::Error::from)?.clone()),
                    None => None,
                };
                // The driver looks kernels up by symbol: a demangled name is resolved through the cubin.
                let symbol = info.as_ref().map_or(name, |i| i.name.as_str());
                Ok(Kernel::Driver {
                    func: module.function(symbol)?,
                    info: info.map(Arc::new),
                })
            }
        }
    }
}

impl Module {
    /// The module variable (`__device__` or `__constant__`) called `name`: its device address and size, what
    /// `cuModuleGetGlobal` gives. On the direct path a C++ variable in a namespace also answers to its demangled
    /// name. Read and write it with [`Queue::copy_to_global`] and [`Queue::copy_from_global`] (or their
    /// pinned-memory forms), in stream order with the queue's launches.
    pub fn global(&self, name: &str) -> Result<Global> {
        let (symbol, device_ptr, size) = match self {
            Module::Direct(m) => {
                let g = m.global(name)?;
                (g.name, g.va, g.size)
            }
            Module::Driver { module, cubin } => {
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
                        return Err(launch::Error::NoSuchGlobal {
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

    fn backend(&self) -> Backend {
        match self.module {
            Module::Direct(_) => Backend::Direct,
            Module::Driver { .. } => Backend::Driver,
        }
    }

    /// The device address of `bytes` at `offset`, checked against the variable.
    fn range(&self, offset: u64, bytes: u64) -> Result<u64> {
        if offset.checked_add(bytes).is_none_or(|end| end > self.size) {
            return Err(launch::Error::GlobalRange {
                name: self.name.clone(),
                size: self.size,
                offset,
                bytes,
            }
            .into());
        }
        Ok(self.device_ptr + offset)
    }

    fn endpoint(&self, offset: u64) -> Endpoint {
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
pub enum Kernel {
    /// A kernel of a direct-path module.
    Direct(launch::Kernel),
    /// A kernel of a libcuda module, with its parameter table when the cubin could be read.
    Driver {
        /// libcuda's function handle.
        func: driver::Function,
        /// The kernel's parameters and resources from the cubin, when APEX could read it.
        info: Option<Arc<KernelInfo>>,
    },
}

impl Kernel {
    /// The cubin's attributes (absent for PTX loaded by the driver).
    pub fn info(&self) -> Option<&KernelInfo> {
        match self {
            Kernel::Direct(k) => Some(k.info()),
            Kernel::Driver { info, .. } => info.as_deref(),
        }
    }
}

enum QueueInner {
    Direct(Box<ComputeQueue>),
    Driver {
        stream: driver::Stream,
        ptrs: driver::ParamPtrs,
    },
}

/// A completion point on a queue. Waiting on it also prints what the queue's kernels `printf`ed so far, and
/// reports a failed device `assert` as [`launch::Error::Assert`].
#[derive(Clone, Debug)]
pub struct Fence(FenceInner);

#[derive(Clone, Debug)]
enum FenceInner {
    Direct {
        fence: pushbuf::Fence,
        printf: Option<Arc<PrintfFifo>>,
    },
    /// The driver backend's fences complete with their stream (a conservative wait).
    Driver(Arc<StreamWatch>),
}

/// Lets a driver-backend fence wait on its stream without borrowing the queue.
#[derive(Debug)]
pub struct StreamWatch {
    ctx: Arc<driver::Context>,
    stream: driver::StreamRef,
}

impl Fence {
    fn direct(fence: pushbuf::Fence, q: &ComputeQueue) -> Fence {
        Fence(FenceInner::Direct {
            fence,
            printf: q.printf_fifo().cloned(),
        })
    }

    fn driver(stream: &driver::Stream) -> Fence {
        Fence(FenceInner::Driver(Arc::new(StreamWatch {
            ctx: stream.context().clone(),
            stream: stream.handle(),
        })))
    }

    /// Waits until the work before the fence is complete (at most `timeout`), then prints kernel `printf` output.
    pub fn wait(&self, timeout: Duration) -> Result<()> {
        match &self.0 {
            FenceInner::Direct { fence, printf } => {
                Ok(launch::settle(printf.as_ref(), fence.wait(timeout))?)
            }
            FenceInner::Driver(w) => w.wait(timeout),
        }
    }

    /// Whether the work before the fence is complete (no waiting, no printing).
    pub fn is_done(&self) -> bool {
        match &self.0 {
            FenceInner::Direct { fence, .. } => fence.is_done(),
            FenceInner::Driver(w) => w.is_idle(),
        }
    }
}

impl StreamWatch {
    fn is_idle(&self) -> bool {
        self.stream.is_idle(&self.ctx).unwrap_or(false)
    }

    fn wait(&self, timeout: Duration) -> Result<()> {
        let start = std::time::Instant::now();
        loop {
            if self.stream.is_idle(&self.ctx)? {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(Error::Driver(driver::Error::Call {
                    call: "fence wait",
                    code: 0,
                    name: format!("timed out after {timeout:?}"),
                }));
            }
            std::thread::yield_now();
        }
    }
}

/// Launches and copies in order on one GPU, like a CUDA stream; each returns a [`Fence`] or waits.
///
/// `Send` but not `Sync`: one thread at a time submits (one queue per thread).
///
/// ```no_run
/// use apex::{Gpu, LaunchConfig};
/// # fn main() -> apex::Result<()> {
/// let gpu = Gpu::open(0)?;
/// let empty = gpu.load_module_file("kernels/apex_test_kernels.sm_90.cubin")?.kernel("empty")?;
/// let mut q = gpu.queue()?;
/// for _ in 0..1000 {
///     // SAFETY: the empty kernel touches no memory.
///     unsafe { q.launch(&empty, &LaunchConfig::linear(1, 32), &[])? };
/// }
/// q.synchronize()?; // every launch above has completed
/// # Ok(())
/// # }
/// ```
pub struct Queue {
    inner: QueueInner,
    /// Chained launches made on the driver backend since the chain last ended.
    driver_chain: usize,
    limits: Limits,
    /// Buffers used by copies in flight, released when their fences complete.
    keep: Vec<(Fence, KeepAlive)>,
    staging: Option<HostBuffer>,
    /// Ordering with the attached CUDA context's streams.
    cuda: Option<cuda_attach::CudaOrder>,
}

#[derive(Debug)]
#[allow(dead_code)]
enum KeepAlive {
    Device(Buffer),
    Host(HostBuffer),
    Module(Module),
}

/// One side of a copy: device address, buffer size, offset, and the buffer, kept alive while the copy runs.
type Endpoint = (u64, u64, u64, KeepAlive);

impl Buffer {
    fn endpoint(&self, offset: u64) -> Endpoint {
        (
            self.device_ptr(),
            self.size,
            offset,
            KeepAlive::Device(self.clone()),
        )
    }
}

impl HostBuffer {
    fn endpoint(&self, offset: u64) -> Endpoint {
        (
            self.device_ptr(),
            self.size,
            offset,
            KeepAlive::Host(self.clone()),
        )
    }
}

const STAGING_BYTES: u64 = 32 << 20;

impl fmt::Debug for Queue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Queue")
            .field("backend", &self.backend())
            .finish()
    }
}

impl Queue {
    /// The backend this queue submits to.
    pub fn backend(&self) -> Backend {
        match self.inner {
            QueueInner::Direct(_) => Backend::Direct,
            QueueInner::Driver { .. } => Backend::Driver,
        }
    }

    /// The direct path's compute queue, when that is the backend.
    pub fn direct(&mut self) -> Option<&mut ComputeQueue> {
        match &mut self.inner {
            QueueInner::Direct(q) => Some(q),
            QueueInner::Driver { .. } => None,
        }
    }

    /// Launches `kernel` with `args`, checked against the kernel's parameter table and the device limits before
    /// anything is submitted.
    ///
    /// # Safety
    /// The kernel may read and write any memory its arguments lead it to; the caller guarantees those buffers
    /// are not in use elsewhere until the fence completes.
    pub unsafe fn launch(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<Fence> {
        self.driver_chain = 0;
        match (&mut self.inner, kernel) {
            // SAFETY: forwarded to the caller.
            (QueueInner::Direct(q), Kernel::Direct(k)) => {
                let f = unsafe { q.launch(k, cfg, args)? };
                Ok(Fence::direct(f, q))
            }
            (QueueInner::Driver { stream, ptrs }, Kernel::Driver { func, info }) => {
                // SAFETY: forwarded to the caller.
                unsafe { driver_launch(stream, ptrs, &self.limits, func, info, cfg, args)? };
                Ok(Fence::driver(stream))
            }
            _ => Err(Error::Mismatch),
        }
    }

    /// Launches a kernel that synchronizes its whole grid (cooperative groups `this_grid().sync()`), as
    /// `cuLaunchCooperativeKernel` does: refused unless every block can be resident at once.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch).
    pub unsafe fn launch_cooperative(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<Fence> {
        self.driver_chain = 0;
        match (&mut self.inner, kernel) {
            (QueueInner::Direct(q), Kernel::Direct(k)) => {
                // SAFETY: forwarded to the caller.
                let f = unsafe { q.launch_cooperative(k, cfg, args)? };
                Ok(Fence::direct(f, q))
            }
            (QueueInner::Driver { stream, ptrs }, Kernel::Driver { func, info }) => {
                if cfg.cluster.is_some() {
                    return Err(Error::InvalidArgument(
                        "a run-time cluster shape on a cooperative launch (the driver backend launches \
                         cooperative kernels with cuLaunchCooperativeKernel, which takes none)"
                            .into(),
                    ));
                }
                if let Some(info) = info {
                    launch::queue_validate(info, cfg, &self.limits)?;
                }
                check_driver_args(func, info.as_deref(), args)?;
                ptrs.clear();
                for a in args {
                    ptrs.push(arg_ptr(a));
                }
                // SAFETY: each pointer refers into `args`, alive for the call, with the size the kernel declares
                // (checked above); the rest is the caller's contract.
                unsafe {
                    stream.launch_cooperative(
                        func,
                        cfg.grid,
                        cfg.block,
                        cfg.shared_bytes,
                        ptrs.as_mut_slice(),
                    )?
                };
                Ok(Fence::driver(stream))
            }
            _ => Err(Error::Mismatch),
        }
    }

    /// Records `kernel` as the next link of a chain of dependent launches, ended by [`end_chain`](Self::end_chain).
    /// On the direct path each link is scheduled by the GPU when the one before completes, with no round trip
    /// through the channel's front end (as a CUDA graph runs), and long chains are sent part by part while they are
    /// recorded. On the driver backend links are launched on the stream at once, which orders them the same way.
    /// Any other launch or copy on the queue ends the chain first.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch).
    pub unsafe fn launch_chained(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<()> {
        match (&mut self.inner, kernel) {
            // SAFETY: forwarded to the caller.
            (QueueInner::Direct(q), Kernel::Direct(k)) => unsafe {
                q.record_launch_chained(k, cfg, args)?
            },
            (QueueInner::Driver { stream, ptrs }, Kernel::Driver { func, info }) => {
                // SAFETY: forwarded to the caller.
                unsafe { driver_launch(stream, ptrs, &self.limits, func, info, cfg, args)? };
                self.driver_chain += 1;
            }
            _ => return Err(Error::Mismatch),
        }
        Ok(())
    }

    /// Ends the chain recorded by [`launch_chained`](Self::launch_chained) and submits it; the fence completes when
    /// its last launch has. An error if no chained launch was recorded since the chain last ended.
    pub fn end_chain(&mut self) -> Result<Fence> {
        match &mut self.inner {
            QueueInner::Direct(q) => {
                let f = q.end_chain()?;
                Ok(Fence::direct(f, q))
            }
            QueueInner::Driver { stream, .. } => {
                if std::mem::take(&mut self.driver_chain) == 0 {
                    return Err(launch::Error::NoChain.into());
                }
                Ok(Fence::driver(stream))
            }
        }
    }

    /// Waits until everything submitted so far is complete.
    pub fn synchronize(&mut self) -> Result<()> {
        self.driver_chain = 0;
        match &mut self.inner {
            QueueInner::Direct(q) => q.synchronize()?,
            QueueInner::Driver { stream, .. } => stream.synchronize()?,
        }
        self.keep.clear();
        Ok(())
    }

    fn prune(&mut self) {
        self.keep.retain(|(f, _)| !f.is_done());
    }

    /// Copies pinned host memory to the device (asynchronous; both buffers are kept alive until done).
    pub fn copy_host_to_device(
        &mut self,
        src: &HostBuffer,
        src_offset: u64,
        dst: &Buffer,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<Fence> {
        self.copy_kept(
            src.endpoint(src_offset),
            dst.endpoint(dst_offset),
            bytes,
            false,
        )
    }

    /// Copies device memory to pinned host memory (asynchronous).
    pub fn copy_device_to_host(
        &mut self,
        src: &Buffer,
        src_offset: u64,
        dst: &HostBuffer,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<Fence> {
        self.copy_kept(
            src.endpoint(src_offset),
            dst.endpoint(dst_offset),
            bytes,
            false,
        )
    }

    /// Copies between device buffers (asynchronous). On the direct path the SMs copy (a built-in kernel): the
    /// copy engine moves device memory at a twentieth of the HBM's bandwidth.
    pub fn copy_device_to_device(
        &mut self,
        src: &Buffer,
        src_offset: u64,
        dst: &Buffer,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<Fence> {
        self.copy_kept(
            src.endpoint(src_offset),
            dst.endpoint(dst_offset),
            bytes,
            true,
        )
    }

    /// Checks both ranges, copies, and keeps both buffers alive until the copy's fence completes.
    fn copy_kept(
        &mut self,
        (src, src_size, src_offset, src_keep): Endpoint,
        (dst, dst_size, dst_offset, dst_keep): Endpoint,
        bytes: u64,
        device_to_device: bool,
    ) -> Result<Fence> {
        // Other work ends a chain, on both backends.
        self.driver_chain = 0;
        check_range(src_size, src_offset, bytes)?;
        check_range(dst_size, dst_offset, bytes)?;
        let (s, d) = (src + src_offset, dst + dst_offset);
        let f = match &mut self.inner {
            QueueInner::Direct(q) if device_to_device && bytes > 0 => {
                // SAFETY: both ranges were checked against their device buffers, which stay alive until done.
                let f = unsafe { q.copy_device(s, d, bytes)? };
                let f = Fence::direct(f, q);
                self.prune();
                f
            }
            _ => self.copy_raw(s, d, bytes)?,
        };
        self.keep.push((f.clone(), src_keep));
        self.keep.push((f.clone(), dst_keep));
        Ok(f)
    }

    fn copy_raw(&mut self, src: u64, dst: u64, bytes: u64) -> Result<Fence> {
        if bytes == 0 {
            return Err(Error::InvalidArgument("a copy of 0 bytes".into()));
        }
        self.prune();
        match &mut self.inner {
            QueueInner::Direct(q) => {
                let f = q.copy(src, dst, bytes)?;
                Ok(Fence::direct(f, q))
            }
            QueueInner::Driver { stream, .. } => {
                // SAFETY: the queue keeps both buffers alive until the copy's fence completes.
                unsafe { stream.copy(dst, src, bytes)? };
                Ok(Fence::driver(stream))
            }
        }
    }

    /// Writes `data` into the module variable `dst` at byte `offset` (cudaMemcpyToSymbol), after the work
    /// submitted to this queue so far; returns when the copy is complete, so every later launch, on this queue or
    /// another, sees it. A `__constant__` variable included: every launch invalidates the SMs' constant caches.
    pub fn copy_to_global(
        &mut self,
        gpu: &Gpu,
        dst: &Global,
        offset: u64,
        data: &[u8],
    ) -> Result<()> {
        self.same_backend(dst)?;
        let at = dst.range(offset, data.len() as u64)?;
        self.upload_to(gpu, at, data)
    }

    /// Reads `out.len()` bytes of the module variable `src` from byte `offset` (cudaMemcpyFromSymbol), after the
    /// work submitted to this queue so far; returns when the copy is complete.
    pub fn copy_from_global(
        &mut self,
        gpu: &Gpu,
        src: &Global,
        offset: u64,
        out: &mut [u8],
    ) -> Result<()> {
        self.same_backend(src)?;
        let at = src.range(offset, out.len() as u64)?;
        self.download_from(gpu, at, out)
    }

    /// Copies pinned host memory into a module variable (asynchronous, in stream order; cudaMemcpyToSymbolAsync).
    /// Launches on other queues see it once the fence has completed.
    pub fn copy_host_to_global(
        &mut self,
        src: &HostBuffer,
        src_offset: u64,
        dst: &Global,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<Fence> {
        self.same_backend(dst)?;
        dst.range(dst_offset, bytes)?;
        self.copy_kept(
            src.endpoint(src_offset),
            dst.endpoint(dst_offset),
            bytes,
            false,
        )
    }

    /// Copies a module variable into pinned host memory (asynchronous, in stream order;
    /// cudaMemcpyFromSymbolAsync).
    pub fn copy_global_to_host(
        &mut self,
        src: &Global,
        src_offset: u64,
        dst: &HostBuffer,
        dst_offset: u64,
        bytes: u64,
    ) -> Result<Fence> {
        self.same_backend(src)?;
        src.range(src_offset, bytes)?;
        self.copy_kept(
            src.endpoint(src_offset),
            dst.endpoint(dst_offset),
            bytes,
            false,
        )
    }

    fn same_backend(&self, g: &Global) -> Result<()> {
        if g.backend() == self.backend() {
            Ok(())
        } else {
            Err(Error::Mismatch)
        }
    }

    /// Copies pageable host memory to the device; returns when the copy is complete.
    pub fn upload(&mut self, gpu: &Gpu, dst: &Buffer, dst_offset: u64, data: &[u8]) -> Result<()> {
        check_range(dst.size, dst_offset, data.len() as u64)?;
        self.upload_to(gpu, dst.device_ptr() + dst_offset, data)
    }

    /// Copies `data` to the device address `dst` (checked by the caller) in stream order; returns when complete.
    fn upload_to(&mut self, gpu: &Gpu, dst: u64, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        if let QueueInner::Driver { stream, .. } = &mut self.inner {
            return Ok(stream.upload(dst, data)?);
        }
        let staging = self.staging(gpu)?;
        let half = STAGING_BYTES / 2;
        let mut fences: [Option<Fence>; 2] = [None, None];
        for (i, chunk) in data.chunks(half as usize).enumerate() {
            let slot = i % 2;
            if let Some(f) = fences[slot].take() {
                f.wait(Duration::from_secs(30))?;
            }
            staging.write(slot as u64 * half, chunk)?;
            let off = (i as u64) * half;
            fences[slot] = Some(self.copy_raw(
                staging.device_ptr() + slot as u64 * half,
                dst + off,
                chunk.len() as u64,
            )?);
        }
        for f in fences.into_iter().flatten() {
            f.wait(Duration::from_secs(30))?;
        }
        Ok(())
    }

    /// Copies device memory to pageable host memory; returns when the copy is complete.
    pub fn download(
        &mut self,
        gpu: &Gpu,
        src: &Buffer,
        src_offset: u64,
        out: &mut [u8],
    ) -> Result<()> {
        check_range(src.size, src_offset, out.len() as u64)?;
        self.download_from(gpu, src.device_ptr() + src_offset, out)
    }

    /// Copies from the device address `src` (checked by the caller) into `out` in stream order; returns when
    /// complete.
    fn download_from(&mut self, gpu: &Gpu, src: u64, out: &mut [u8]) -> Result<()> {
        if out.is_empty() {
            return Ok(());
        }
        if let QueueInner::Driver { stream, .. } = &mut self.inner {
            return Ok(stream.download(src, out)?);
        }
        let staging = self.staging(gpu)?;
        let half = STAGING_BYTES / 2;
        let n = out.len().div_ceil(half as usize);
        let mut pending: Option<(usize, Fence)> = None;
        for i in 0..=n {
            // Start chunk i while the CPU drains chunk i-1.
            let next = if i < n {
                let slot = (i % 2) as u64;
                let off = i as u64 * half;
                let len = (out.len() as u64 - off).min(half);
                Some((
                    i,
                    self.copy_raw(src + off, staging.device_ptr() + slot * half, len)?,
                ))
            } else {
                None
            };
            if let Some((j, f)) = pending.take() {
                f.wait(Duration::from_secs(30))?;
                let off = j as u64 * half;
                let len = (out.len() as u64 - off).min(half) as usize;
                staging.read(
                    (j % 2) as u64 * half,
                    &mut out[off as usize..off as usize + len],
                )?;
            }
            pending = next;
        }
        Ok(())
    }

    fn staging(&mut self, gpu: &Gpu) -> Result<HostBuffer> {
        if self.staging.is_none() {
            self.staging = Some(gpu.alloc_host(STAGING_BYTES)?);
        }
        self.staging
            .clone()
            .ok_or(Error::InvalidArgument("staging buffer".into()))
    }
}

fn check_range(size: u64, offset: u64, len: u64) -> Result<()> {
    if offset.checked_add(len).is_none_or(|e| e > size) {
        return Err(Error::InvalidArgument(format!(
            "range {offset:#x}+{len:#x} outside a {size:#x}-byte buffer"
        )));
    }
    Ok(())
}

/// Checks and launches one kernel on the driver backend's stream.
///
/// # Safety
/// As for [`Queue::launch`].
unsafe fn driver_launch(
    stream: &mut driver::Stream,
    ptrs: &mut driver::ParamPtrs,
    limits: &Limits,
    func: &driver::Function,
    info: &Option<Arc<KernelInfo>>,
    cfg: &LaunchConfig,
    args: &[Arg<'_>],
) -> Result<()> {
    if let Some(info) = info {
        launch::queue_validate(info, cfg, limits)?;
    }
    check_driver_args(func, info.as_deref(), args)?;
    ptrs.clear();
    for a in args {
        ptrs.push(arg_ptr(a));
    }
    match cfg.cluster {
        // A run-time cluster shape goes through cuLaunchKernelEx; a compile-time one needs nothing.
        // SAFETY: each pointer refers into `args`, alive for the call, with the size the kernel declares (checked
        // above); the rest is the caller's contract.
        Some(cluster) => unsafe {
            stream.launch_cluster(
                func,
                cfg.grid,
                cfg.block,
                cfg.shared_bytes,
                cluster,
                ptrs.as_mut_slice(),
            )?
        },
        // SAFETY: as above.
        None => unsafe {
            stream.launch(
                func,
                cfg.grid,
                cfg.block,
                cfg.shared_bytes,
                ptrs.as_mut_slice(),
            )?
        },
    };
    Ok(())
}

fn check_driver_args(
    func: &driver::Function,
    info: Option<&KernelInfo>,
    args: &[Arg<'_>],
) -> Result<()> {
    // Named only when an error needs it: nothing is allocated on the launch path.
    let name = || info.map_or_else(|| func.name().to_string(), |i| i.name.clone());
    let params = func.params();
    if args.len() != params.len() {
        return Err(launch::Error::Params(launch::ParamError::Count {
            kernel: name(),
            expected: params.len(),
            given: args.len(),
        })
        .into());
    }
    if args.len() > driver::MAX_PARAMS {
        return Err(Error::InvalidArgument(format!(
            "{} parameters (at most {})",
            args.len(),
            driver::MAX_PARAMS
        )));
    }
    for (index, (a, &(_, size))) in args.iter().zip(params).enumerate() {
        if a.size() != size as usize {
            return Err(launch::Error::Params(launch::ParamError::Size {
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

fn arg_ptr(a: &Arg<'_>) -> *mut std::ffi::c_void {
    match a {
        Arg::I8(v) => v as *const i8 as *mut _,
        Arg::U8(v) => v as *const u8 as *mut _,
        Arg::I16(v) => v as *const i16 as *mut _,
        Arg::U16(v) => v as *const u16 as *mut _,
        Arg::I32(v) => v as *const i32 as *mut _,
        Arg::U32(v) => v as *const u32 as *mut _,
        Arg::I64(v) => v as *const i64 as *mut _,
        Arg::U64(v) | Arg::Ptr(v) => v as *const u64 as *mut _,
        Arg::F32(v) => v as *const f32 as *mut _,
        Arg::F64(v) => v as *const f64 as *mut _,
        Arg::Bytes(b) => b.as_ptr() as *mut _,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rm_err(e: rm::Error) -> launch::Error {
        launch::Error::from(e)
    }

    #[test]
    fn types_that_cross_threads() {
        fn send_sync<T: Send + Sync>() {}
        fn send<T: Send>() {}
        send_sync::<Gpu>();
        send_sync::<Buffer>();
        send_sync::<HostBuffer>();
        send_sync::<Module>();
        send_sync::<Kernel>();
        send_sync::<Fence>();
        send::<Queue>();
        send_sync::<crate::rm::GpuCore>();
        send_sync::<crate::rm::Memory>();
        send_sync::<crate::launch::Module>();
        send_sync::<crate::launch::Kernel>();
        send::<crate::launch::ComputeQueue>();
        send::<crate::gpfifo::Channel>();
    }

    #[test]
    fn apex_backend_variable() {
        assert_eq!(BackendRequest::parse("").unwrap(), BackendRequest::Auto);
        assert_eq!(
            BackendRequest::parse("Direct").unwrap(),
            BackendRequest::Direct
        );
        assert_eq!(
            BackendRequest::parse(" driver ").unwrap(),
            BackendRequest::Driver
        );
        assert!(matches!(
            BackendRequest::parse("fast"),
            Err(Error::BadBackendVar(_))
        ));
    }

    #[test]
    fn auto_prefers_the_direct_path() {
        let (t, s) = choose(BackendRequest::Auto, || Ok(7));
        assert_eq!((t, s.backend, s.fallback), (Some(7), Backend::Direct, None));
    }

    #[test]
    fn forcing_the_driver_skips_the_direct_path() {
        let (t, s) = choose::<()>(BackendRequest::Driver, || {
            panic!("must not open the direct path")
        });
        assert_eq!(
            (t, s.backend, s.fallback),
            (None, Backend::Driver, Some(FallbackReason::Requested))
        );
    }

    #[test]
    fn each_reason_is_classified() {
        let cases: Vec<(launch::Error, FallbackReason)> = vec![
            (
                rm_err(rm::Error::NoDeviceNode {
                    path: "/dev/nvidiactl".into(),
                }),
                FallbackReason::NoDeviceNodes("/dev/nvidiactl".into()),
            ),
            (
                rm_err(rm::Error::PermissionDenied {
                    path: "/dev/nvidia0".into(),
                }),
                FallbackReason::PermissionDenied("/dev/nvidia0".into()),
            ),
            (
                rm_err(rm::Error::DriverBranch {
                    found: "570.86.15".into(),
                    expected: 580,
                }),
                FallbackReason::DriverBranch {
                    found: "570.86.15".into(),
                    expected: 580,
                },
            ),
            (
                rm_err(rm::Error::UnsupportedClass {
                    what: "GPFIFO channel",
                    count: 2,
                    listed: "0x0080 0x2080".into(),
                }),
                FallbackReason::UnsupportedGpu(
                    rm::Error::UnsupportedClass {
                        what: "GPFIFO channel",
                        count: 2,
                        listed: "0x0080 0x2080".into(),
                    }
                    .to_string(),
                ),
            ),
            (
                launch::Error::Unsupported("sm_80".into()),
                FallbackReason::UnsupportedGpu("sm_80".into()),
            ),
        ];
        for (err, want) in cases {
            let (t, s) = choose::<()>(BackendRequest::Auto, || Err(err));
            assert!(t.is_none());
            assert_eq!(s.backend, Backend::Driver);
            assert_eq!(s.fallback, Some(want.clone()), "{want}");
            assert!(!s.to_string().is_empty());
        }
        let (_, s) = choose::<()>(BackendRequest::Auto, || {
            Err(rm_err(rm::Error::NoSuchGpu { index: 3, count: 1 }))
        });
        assert!(
            matches!(s.fallback, Some(FallbackReason::Failed(m)) if m.contains("out of range"))
        );
    }
}
