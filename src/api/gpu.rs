//! An opened GPU: the backend choice, device facts, and the factory for buffers, modules and queues.

use std::sync::{Arc, Mutex};

use tracing::info;

use super::backend::Backed;
use super::{
    Backend, BackendRequest, Buffer, Error, FallbackReason, HostBuffer, Module, Result, Selection,
    choose,
};
use crate::driver;
use crate::launch::{self, ComputeQueue, ComputeQueueConfig, LaunchMemory, Limits};
use crate::module;
use crate::module::printf::{AssertAction, AssertFailure, PrintfFifoCell};
use crate::rm::{GpuCore, Memory, MemoryDesc, Placement};

/// What both backends report about the device.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
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

/// An opened GPU: RM's objects or libcuda's context.
pub(super) type GpuInner = Backed<Arc<GpuCore>, Arc<driver::Context>>;

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
    pub(super) inner: GpuInner,
    pub(super) selection: Selection,
    pub(super) info: DeviceInfo,
    pub(super) limits: Limits,
    /// The direct path's device printf FIFO, shared by this GPU's modules.
    pub(super) printf: PrintfFifoCell,
    /// The CUDA context this GPU is attached to ([`Gpu::attach_cuda`]).
    pub(super) cuda: Option<Arc<driver::CudaContext>>,
    /// The compute queue that proved the direct path when the GPU was opened or attached, kept for the first
    /// [`queue`](Gpu::queue) that can use it: building a queue costs milliseconds (channel, launch slots, local
    /// memory), and the proof would otherwise be built and dropped only for the first queue to build it again.
    pub(super) spare: SpareQueue,
}

/// The proving queue [`Gpu`] keeps for its first queue (see [`Gpu::spare`]).
#[derive(Default)]
pub(super) struct SpareQueue(Mutex<Option<Box<ComputeQueue>>>);

impl SpareQueue {
    /// Keeps `queue` for the first queue built with the default configuration.
    pub(super) fn new(queue: Option<ComputeQueue>) -> SpareQueue {
        SpareQueue(Mutex::new(queue.map(Box::new)))
    }

    /// Whether the queue is still kept.
    pub(super) fn is_kept(&self) -> bool {
        self.0.lock().map(|q| q.is_some()).unwrap_or(false)
    }

    /// The kept queue, if one is left; later calls get `None`.
    pub(super) fn take(&self) -> Option<Box<ComputeQueue>> {
        // A poisoned lock only means another thread panicked while taking it: the slot is still an Option.
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

impl std::fmt::Debug for SpareQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kept = self.0.lock().map(|q| q.is_some()).unwrap_or(false);
        f.debug_struct("SpareQueue").field("kept", &kept).finish()
    }
}

impl Gpu {
    /// Opens GPU `index` with the backend `APEX_BACKEND` asks for (auto by default).
    pub fn open(index: usize) -> Result<Gpu> {
        Gpu::open_with(index, BackendRequest::from_env()?)
    }

    /// Opens GPU `index` with the backend `request` asks for, regardless of `APEX_BACKEND`.
    pub fn open_with(index: usize, request: BackendRequest) -> Result<Gpu> {
        Gpu::open_in(index, request, false)
    }

    pub(super) fn open_in(index: usize, request: BackendRequest, peer: bool) -> Result<Gpu> {
        let (core, selection) = choose(request, || {
            let core = if peer {
                GpuCore::open_peer(index)?
            } else {
                GpuCore::open(index)?
            };
            // Building a compute queue proves the launch path (QMD layout, windows, local memory) on this GPU; it is
            // kept for the first queue.
            let proof = ComputeQueue::new(&core, ComputeQueueConfig::default())?;
            Ok((core, proof))
        });
        let mut proof = None;
        let inner = match core {
            Some((core, queue)) => {
                proof = Some(queue);
                Backed::Direct(core)
            }
            None => {
                let reason = selection
                    .fallback
                    .clone()
                    .unwrap_or(FallbackReason::Requested);
                if request == BackendRequest::Direct {
                    return Err(Error::DirectUnavailable(reason));
                }
                match driver::Context::new(index) {
                    Ok(ctx) => Backed::Driver(ctx),
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
        info!(gpu = index, backend = ?selection.backend, reason = %selection, "APEX backend selected");
        Gpu::assemble(inner, selection, None, proof)
    }

    /// A GPU over `inner`: its device facts, the limits launches are checked against, and a fresh printf FIFO.
    pub(super) fn assemble(
        inner: GpuInner,
        selection: Selection,
        cuda: Option<Arc<driver::CudaContext>>,
        proof: Option<ComputeQueue>,
    ) -> Result<Gpu> {
        let info = match &inner {
            Backed::Direct(c) => {
                let i = c.info();
                DeviceInfo {
                    name: i.name.clone(),
                    sm_version: i.sm_version,
                    sm_count: i.sm_count,
                    memory_bytes: i.memory_bytes,
                }
            }
            Backed::Driver(ctx) => driver_info(ctx)?,
        };
        let limits = Limits::for_sm(info.sm_version);
        Ok(Gpu {
            inner,
            selection,
            info,
            limits,
            printf: PrintfFifoCell::new(),
            cuda,
            spare: SpareQueue::new(proof),
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
        self.inner.direct()
    }

    /// The CUDA driver backend's context, when that is the backend.
    pub fn driver(&self) -> Option<&Arc<driver::Context>> {
        self.inner.driver()
    }

    /// Device memory.
    pub fn alloc(&self, bytes: u64) -> Result<Buffer> {
        let inner = match &self.inner {
            Backed::Direct(c) => Backed::Direct(Memory::alloc(c, MemoryDesc::video(bytes))?),
            Backed::Driver(ctx) => Backed::Driver(driver::DeviceMemory::alloc(ctx, bytes)?),
        };
        Ok(Buffer {
            inner: Arc::new(inner),
            size: bytes,
        })
    }

    /// Pinned host memory the GPU can read and write.
    pub fn alloc_host(&self, bytes: u64) -> Result<HostBuffer> {
        let inner = match &self.inner {
            Backed::Direct(c) => Backed::Direct(Memory::alloc(
                c,
                MemoryDesc::video(bytes)
                    .placement(Placement::SystemCached)
                    .with_cpu(),
            )?),
            Backed::Driver(ctx) => Backed::Driver(driver::HostMemory::alloc(ctx, bytes)?),
        };
        Ok(HostBuffer {
            inner: Arc::new(inner),
            size: bytes,
        })
    }

    /// Loads a cubin, a fatbin, a host executable or shared library built by nvcc (its embedded fatbins), or
    /// PTX. The best code for this GPU is picked (the newest SASS the device runs, else PTX); PTX, and relocatable
    /// code (`nvcc -rdc=true`) that nothing else replaces, are compiled for it by nvJitLink on the direct path and by
    /// the driver on the driver backend.
    pub fn load_module(&self, image: &[u8]) -> Result<Module> {
        match &self.inner {
            Backed::Direct(c) => Ok(Module::from_direct(module::Module::load_with(
                c,
                image,
                &self.printf,
            )?)),
            Backed::Driver(ctx) => Ok(Module::from_driver(driver::LoadedModule::load(
                ctx,
                image,
                self.info.sm_version,
            )?)),
        }
    }

    /// As [`Gpu::load_module`], with the module's `__device__` variables living where `place(name, size)` says
    /// instead of in memory of the module's own (`None`: its own copy; a home smaller than `size` is refused). For a module a CUDA
    /// program also loaded in the context this GPU is attached to ([`Gpu::attach_cuda`]), `place` gives CUDA's
    /// addresses (`cuModuleGetGlobal`), and APEX's kernels and CUDA's then share those variables (a random
    /// generator's state, a counter, a lookup table written at run time) instead of each updating a copy.
    /// `__constant__` variables are never placed (they live in the constant bank launches bind), nor are the
    /// constants the compiler made ([`GlobalSymbol::is_compiler_constant`](crate::module::cubin::GlobalSymbol::is_compiler_constant):
    /// string literals, assert messages), which hold the same bytes in every instance. A home given for a name that
    /// several of the module's variables have (module-local variables of the objects it was linked from) is refused
    /// with [`module::Error::AmbiguousGlobal`](crate::module::Error::AmbiguousGlobal).
    ///
    /// Direct path only: on the driver backend the module is CUDA's own instance already, and this returns
    /// [`Error::InvalidArgument`].
    pub fn load_module_sharing(
        &self,
        image: &[u8],
        place: &dyn Fn(&str, u64) -> Option<crate::VariableHome>,
    ) -> Result<Module> {
        match &self.inner {
            Backed::Direct(c) => Ok(Module::from_direct(module::Module::load_placed(
                c,
                image,
                &self.printf,
                &|g| (!g.is_constant()).then(|| place(&g.name, g.size)).flatten(),
            )?)),
            Backed::Driver(_) => Err(Error::InvalidArgument(
                "placing a module's variables needs the direct path; on the driver backend load the module with \
                 load_module"
                    .into(),
            )),
        }
    }

    /// As [`Gpu::load_module_sharing`], and with the module's `__constant__` bank where `constants(name, size)` says
    /// its variables live. Given CUDA's addresses for them (`cuModuleGetGlobal` of a `__constant__` variable points
    /// into CUDA's instance's bank, which `cudaMemcpyToSymbol` writes), APEX's launches bind CUDA's bank instead of
    /// a copy, so the program's writes to `__constant__` variables reach APEX's kernels too (every launch
    /// invalidates the SMs' constant caches, and so does every replay of a graph with such a module's kernels). The
    /// bank is shared only where its variables' homes (every one, up to 64; an even sample beyond) agree with the
    /// cubin's layout and the bank is 64-byte aligned, as launches bind banks; otherwise the module keeps a bank of
    /// its own ([`Module::shares_constants`] says which).
    ///
    /// Direct path only, as [`Gpu::load_module_sharing`].
    pub fn load_module_sharing_constants(
        &self,
        image: &[u8],
        place: &dyn Fn(&str, u64) -> Option<crate::VariableHome>,
        constants: &dyn Fn(&str, u64) -> Option<crate::VariableHome>,
    ) -> Result<Module> {
        match &self.inner {
            Backed::Direct(c) => Ok(Module::from_direct(module::Module::load_placed(
                c,
                image,
                &self.printf,
                &|g| match g.is_constant() {
                    true => constants(&g.name, g.size),
                    false => place(&g.name, g.size),
                },
            )?)),
            Backed::Driver(_) => Err(Error::InvalidArgument(
                "placing a module's variables needs the direct path; on the driver backend load the module with \
                 load_module"
                    .into(),
            )),
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
            Backed::Direct(_) => self
                .printf
                .set_size(bytes)
                .map_err(|current| launch::Error::PrintfFifoFixed { current }.into()),
            Backed::Driver(ctx) => Ok(ctx.set_printf_fifo_size(bytes)?),
        }
    }

    /// Sets how a failed device-side `assert` ends in kernels this GPU's direct-path queues launch (modules loaded
    /// before or after): [`AssertAction::Trap`] (the default, as CUDA: the channel group faults and the wait that
    /// sees it returns the assertion) or [`AssertAction::EndThread`] (the failing thread records the failure and
    /// ends, nothing faults, and the next wait returns the assertion, or [`take_device_asserts`] collects it).
    /// On the driver backend asserts are CUDA's own and only `Trap` is accepted.
    ///
    /// [`take_device_asserts`]: Gpu::take_device_asserts
    pub fn set_assert_action(&self, action: AssertAction) -> Result<()> {
        match (&self.inner, action) {
            (Backed::Direct(_), _) => Ok(self
                .printf
                .set_assert_action(action)
                .map_err(launch::Error::from)?),
            (Backed::Driver(_), AssertAction::Trap) => Ok(()),
            (Backed::Driver(_), _) => Err(Error::InvalidArgument(
                "AssertAction::EndThread needs the direct path: on the CUDA driver backend a failed assert is \
                 CUDA's own trap"
                    .into(),
            )),
        }
    }

    /// Whether a kernel failed an `assert` that ended its thread ([`AssertAction::EndThread`]) since
    /// [`take_device_asserts`](Gpu::take_device_asserts) last ran. One read of a CPU-cached word: cheap enough for
    /// every synchronization. Ask once the work that may have failed is known complete.
    pub fn device_assert_pending(&self) -> bool {
        self.printf.get().is_some_and(|f| f.assert_seen())
    }

    /// The failed device asserts recorded since the last call ([`AssertAction::EndThread`]), taken out of the
    /// printf FIFO without printing them (`printf` output found with them is printed as usual), for a caller that
    /// reports them its own way.
    pub fn take_device_asserts(&self) -> Result<Vec<AssertFailure>> {
        match self.printf.get() {
            Some(f) => Ok(f.take_asserts().map_err(launch::Error::from)?.asserts),
            None => Ok(Vec::new()),
        }
    }
}

/// How [`Gpu::queue_with`] builds a queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueOptions {
    /// Where the direct path keeps the ring, pushbuffer and launch slots: [`LaunchMemory::Video`] (the default)
    /// completes each launch soonest, [`LaunchMemory::Host`] costs the CPU least per launch.
    pub launch_memory: LaunchMemory,
    /// Whether the GPU's front end polls for the queue's work instead of being woken by a doorbell (off by
    /// default). The queue publishes GPFIFO entries ahead, each waiting at a gate word in host memory; a launch is
    /// then cached stores into the next entry's slot and one store to the gate, with no doorbell (an uncached store
    /// to the GPU; in video launch memory a store fence still orders the slot's write-combined words first).
    /// Submissions too large for a slot (255 words: a launch with an inline QMD fits, a copy of over about 16 GiB
    /// does not) and graph replays go through the ring with a doorbell as usual. The driver backend has nothing to
    /// poll and ignores the option.
    ///
    /// The trade, measured on an H100 (BENCHMARKS.md): with [`LaunchMemory::Host`] a launch completes 1.4-1.8 µs
    /// sooner (5.7-5.9 against 7.4-7.5 µs: the front end fetches no GPFIFO entry over PCIe before it sees the
    /// work); with video launch memory it completes 0.5-0.7 µs later (the front end sees a store to host memory on
    /// its next poll later than it answers a doorbell), so video memory without polling stays the soonest to
    /// complete. The CPU cost of a launch call stays the same within the run-to-run spread: the gate store costs
    /// what the doorbell did.
    ///
    /// While idle, the queue's channel stays parked at its gate, polling one word over PCIe, and the scheduler
    /// keeps returning to it: other queues' launches on the engine complete later (3.4-3.5 µs became 5.1-5.3 µs beside
    /// two idle polled queues), until the polled queue is dropped. Meant for one launch-bound queue per GPU.
    /// Refused on a GPU attached to a CUDA context ([`Gpu::attach_cuda`]): the queue's channel would be one of
    /// CUDA's channel group.
    pub polled: bool,
    /// Whether the queue chains dependent launches on the GPU by itself (off by default; the direct path only).
    ///
    /// A launch made while the queue's earlier work is still running is held as the next link of a chain that the
    /// GPU's work distributor schedules itself (as a CUDA graph runs, and as
    /// a [`chained`](crate::Launch::chained) launch records one) instead of being sent with a wait in the
    /// channel's front end; a launch made while the queue is idle is sent at once, as usual, so a lone launch
    /// completes as soon as on any queue. The links held so far are sent when a later call on the queue finds the
    /// GPU has finished what was sent, when a part of
    /// [`ComputeQueueConfig::chain_part`](crate::backend::direct::ComputeQueueConfig::chain_part) links is full, first thing
    /// in any other call on the queue (a copy, a wait, [`Queue::synchronize`](crate::Queue::synchronize),
    /// [`Queue::flush`](crate::Queue::flush)), and when the queue is dropped.
    ///
    /// A [`Fence`](crate::Fence) of a held launch completes once it has been sent: before waiting on it from
    /// another thread, or on memory its kernel writes, while making no other call on the queue, call
    /// [`Queue::flush`](crate::Queue::flush). Plain, programmatic and prepared launches are chained; cooperative
    /// launches are sent as usual. On an H100, GPT-2 small with plain launch calls took the CUDA graph's time per
    /// token on such a queue (BENCHMARKS.md).
    pub chained: bool,
}

impl QueueOptions {
    /// Sets [`launch_memory`](Self::launch_memory).
    pub fn launch_memory(mut self, memory: LaunchMemory) -> QueueOptions {
        self.launch_memory = memory;
        self
    }

    /// Sets [`polled`](Self::polled).
    pub fn polled(mut self, polled: bool) -> QueueOptions {
        self.polled = polled;
        self
    }

    /// Sets [`chained`](Self::chained).
    pub fn chained(mut self, chained: bool) -> QueueOptions {
        self.chained = chained;
        self
    }
}
