//! apex-trace: an `LD_PRELOAD` tracer for unmodified CUDA programs.
//!
//! It records the RM and UVM ioctls on `/dev/nvidia*` (names, key parameters, status, duration),
//! finds the program's GPFIFO channels from their allocation parameters, polls each channel's
//! USERD `GPPut` from a background thread and decodes new GPFIFO entries, their pushbuffer
//! segments and the QMDs they launch with APEX's decoders, and records driver-API launches
//! (`cuLaunchKernel*`, reached through `cuGetProcAddress` and `dlsym`) and the driver-API calls that order and
//! wait for work (event records, stream waits, queries, synchronizations, stream and event lifetimes).
//!
//! ```sh
//! APEX_TRACE_FILE=trace.jsonl LD_PRELOAD=target/release/libapex_trace.so ./program
//! ```
//!
//! `%p` in `APEX_TRACE_FILE` becomes the process id (one file per rank of a `torchrun` job). Without
//! `APEX_TRACE_FILE` nothing is written; a program that touched the GPU gets a summary on
//! stderr at exit (per kernel: launches, shapes, registers, shared memory, occupancy, advice).
//! `APEX_TRACE_SM_COUNT` sets the SM count for the occupancy advice (default 132, an H100/H200).

#![warn(missing_docs)]

mod calls;
pub mod decode;
mod hooks;
pub mod names;
pub mod record;
pub mod tracer;

pub use record::Record;
