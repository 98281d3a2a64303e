//! `printf` and `assert` in kernels on the direct path.
//!
//! nvcc compiles `printf(fmt, ...)` into a call of the external device function `vprintf(fmt, args)` (the
//! arguments packed in local memory, each at an offset aligned to its size) and `assert(e)` into a call of
//! `__assertfail(message, file, line, function, char_size)`. Neither is in the module: the CUDA driver links its own
//! implementations at load time. APEX links its own instead: a device runtime written in CUDA C
//! (`kernels/apex_printf.cu`, compiled relocatable by `kernels/build.sh` and committed), whose two functions
//! follow the same calling convention ptxas assumes for the driver's (checked against the SASS ptxas emits around
//! the call: arguments in R4.., return address in R20, R2 and R16–R31 preserved; the runtime is compiled with the
//! same ABI, saves what it uses and touches no constant bank but bank 0's driver words). [`DeviceRuntime`]
//! reads that object; [`super::Module`] appends the functions a module calls to its image and points the
//! module's references at them.
//!
//! The runtime writes one record per call into a ring in video memory, a [`PrintfFifo`] shared by the modules of
//! one GPU (the size is set before first use, as `cudaLimitPrintfFifoSize`; 1 MiB by default, as CUDA). The host
//! drains it when a queue synchronizes, when a fence is waited on through the public API, and when a queue is
//! dropped, and prints each record to standard output formatted as C's `printf` would (the C library formats each
//! conversion). Records that do not fit are dropped, as CUDA drops output past a full buffer; the count is logged.
//! A failed `assert` writes its record and traps: the channel faults, and the wait that sees the fault returns
//! [`launch::Error::Assert`](crate::launch::Error::Assert) naming the message, file, line, function, block and
//! thread. With [`AssertAction::EndThread`] it writes its record, sets a word in host memory and ends its thread
//! instead, so the channel (and the channel group it shares, a CUDA context's when attached) lives on; the next wait
//! returns the same error, or a host that reports asserts itself takes the records ([`PrintfFifo::take_asserts`]).
//!
//! This module is one unit: the runtime linked into a module at load time, the FIFO its code writes to (created when
//! the first module that needs it loads, so it lives here, beside the loader, on `rm` memory only), and the host's
//! reading of the records. The launch layer decides when to drain: `launch::settle` (on a synchronize, a wait, a
//! dropped queue) drains the FIFO and turns a fault caused by an assertion into
//! [`launch::AssertError`](crate::launch::AssertError), which holds the channel's fault and so lives in `launch`.
//!
//! Record layout (little-endian, 8-byte fields, each record a multiple of 8 bytes):
//! - `u32 kind` (1 printf, 2 assert; written last, after a fence), `u32 bytes of the record`;
//! - printf: the format string, NUL-terminated, padded to 8; then one slot per argument, in format order: 8 bytes
//!   for an integer, double or pointer (as the caller packed it, zero-extended), and for `%s` a `u64` length
//!   (`u64::MAX` for a null pointer) then the bytes, padded to 8;
//! - assert: `u64 line`, `u64 block.x | block.y << 32`, `u64 block.z | thread.x << 32`, `u64 thread.y | thread.z
//!   << 32`, then the message, file and function as `%s` slots.
//!
//! The code is split by concern: `runtime` ([`DeviceRuntime`], read from its object, and linking its functions
//! into a module's image), `fifo` ([`PrintfFifo`] and the host's half of the ring protocol), `record` (decoding
//! one record) and `format` (formatting a `printf` record as C's `printf` would).

mod fifo;
mod format;
mod record;
mod runtime;
#[cfg(test)]
mod tests;

pub use fifo::{
    AssertAction, DEFAULT_FIFO_BYTES, Drained, PrintfFifo, PrintfFifoCell, RingMemory, take_records,
};
pub use format::{PrintfArg, format_printf};
pub use record::{AssertFailure, DeviceRecord, RecordError, decode_record};
pub(crate) use runtime::RuntimeLink;
pub use runtime::{DeviceRuntime, RuntimeFunction, unsupported_extern_reason};
