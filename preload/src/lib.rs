//! apex-preload: an `LD_PRELOAD` library that makes an unmodified CUDA program's kernel launches go through APEX.
//!
//! Preloaded into a program (the CUDA runtime, the driver API, PyTorch), it records every module and library the
//! program loads (`cuModuleLoad*`, `cuLibraryLoad*`) and the functions and kernels it takes from them, attaches APEX
//! to each CUDA context at its first launch there ([`apex::Gpu::attach_cuda`]), and sends each `cuLaunchKernel` (and
//! `cuLaunchKernelEx` whose attributes it can honour) on a stream it has taken over through an APEX queue of its own
//! in that context. Copies between the host and the device, device-to-device copies and memsets on those streams run
//! on the queues too; synchronizations are answered from APEX's fences where everything they wait for is APEX's
//! ([`order`]); kernels that call `assert` run on APEX, and a failed assert is replayed through libcuda so the
//! program sees CUDA's own report ([`asserts`]). Everything else — and every launch it refuses, with a typed
//! [`Refusal`] — goes to libcuda, ordered with the queues: the program sees the order it asked for.
//!
//! ```sh
//! apex run -- ./program          # or: APEX_PRELOAD_STATS=stats.json LD_PRELOAD=target/release/libapex_preload.so ./program
//! ```
//!
//! Environment: `APEX_PRELOAD=off` forwards everything (and still counts), and so do `CUDA_LAUNCH_BLOCKING=1` (libcuda's
//! launches are then synchronous, APEX's would not be) and a CUDA tool injected into the process (compute-sanitizer,
//! Nsight: they see only libcuda's work); while a profiler records through CUPTI (torch.profiler), launches go to
//! libcuda too (`cupti.rs`); `APEX_PRELOAD_TAKEOVER=earned` (the
//! default) leaves each stream's launches to libcuda until they have cost, at about 3 µs saved per launch, what its
//! takeover costs (an attach, a queue: milliseconds; the modules its kernels need loaded: up to hundreds of ms), so a program too short to earn APEX's set-up back never pays
//! for it (launches before are counted as `warmup`), `first` takes every stream over at its first launch, a number
//! after that many launches (`takeover.rs`); with `earned`, a program whose last runs (the same executable and
//! command line, up to three) each made launches enough to pay for its takeover from the first launch on has each
//! context attached at its first launch, further streams still paying for their queues (`history.rs`: a record per program in APEX's cache directory, `runs/`, written at exit;
//! `APEX_PRELOAD_HISTORY=0` neither reads nor writes them); `APEX_PRELOAD_STATS=FILE` writes a JSON
//! summary at exit ([`stats::Summary`]; `%p` in FILE becomes the process id, one file per process of a job);
//! `APEX_PRELOAD_QUEUES=N` (default 8) bounds the queues, one per stream taken over (once every queue serves a
//! stream, the queue of a stream that has launched nothing for a while, its work complete, goes to the next new
//! stream); `APEX_PRELOAD_ALLOC_CACHE=MIB|off` bounds the
//! allocation cache that serves `cuMemAlloc` and `cuMemAllocAsync` (`APEX_PRELOAD_ALLOC_ASYNC=off`: not the
//! second) ([`alloc_cache`], default 1024 MiB); `APEX_PRELOAD_LOG=LEVEL` (`info`, `debug`, ...) sends the
//! library's `tracing` events to stderr; `APEX_PRELOAD_PROFILE=1` adds where a launch's time goes to the summary;
//! `APEX_PRELOAD_LAUNCH_MEMORY=host` puts the queues' launch memory in host memory; `APEX_PRELOAD_CHAINED=1` makes
//! them chained queues (launches made while a queue is busy held as GPU-scheduled links, sent by the next CUDA call
//! other than a launch on the same stream; opt-in, see docs/attach-cuda.md); `APEX_PRELOAD_WATCHDOG=SECONDS` dumps
//! every thread's stack when one call into the preload hangs; `APEX_PRELOAD_SETUP=background` (opt-in) attaches,
//! builds each stream's queue and loads each module on a thread of the preload's while the launches that need them
//! go to libcuda (counted as `warmup` in the summary, not as refusals), and `APEX_PRELOAD_SETUP=inline` (the default) makes them
//! on the program's thread at the launch that needs them, which then goes through APEX (every launch taken over from
//! the first; the background set-up left a PyTorch decode loop slower, its modules loading behind the first tokens); `APEX_PRELOAD_QUEUES_AHEAD=N` (default 0) keeps N queues built ahead of
//! the next new streams (each holds GPU memory, its local memory alone about 430 MB on an H100). How it works and what it refuses: docs/attach-cuda.md, section 8.

pub mod alloc_cache;
pub mod asserts;
pub mod attrs;
pub mod check;
mod cuda;
mod cupti;
mod engine;
mod exit_safe;
mod history;
mod hooks;
pub mod image;
mod lock;
pub mod order;
mod profile;
pub mod refusal;
pub mod registry;
mod setup;
pub mod stats;
mod takeover;
mod watchdog;

pub use refusal::Refusal;
