//! The JSON-lines records the tracer writes: one per ioctl, channel, GPFIFO entry, QMD launch,
//! driver-API launch and driver-API stream or event call, and a summary at exit. Every type round-trips through serde.

use serde::{Deserialize, Serialize};

/// One line of the trace file.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Record {
    /// An ioctl on an NVIDIA device node.
    Ioctl(IoctlRecord),
    /// A GPFIFO channel the program allocated.
    Channel(ChannelRecord),
    /// A GPFIFO entry the program submitted, with the methods of its pushbuffer segment.
    Submission(SubmissionRecord),
    /// A QMD scheduled with SEND_PCAS_A (a kernel launch, or one of CUDA's "null" QMDs); `source` says where
    /// it was read from.
    Launch(LaunchRecord),
    /// A QMD written by an inline upload, launched or not: the nodes of a CUDA graph are uploaded once and
    /// then scheduled by the GPU itself (as another QMD's dependent), never by SEND_PCAS_A. `source` is
    /// `upload`, `qmd_va` where it was written.
    QmdUpload(LaunchRecord),
    /// A kernel launch through the CUDA driver API.
    DriverLaunch(DriverLaunchRecord),
    /// A driver-API call that orders or waits for work (event records, stream waits, queries,
    /// synchronizations, stream and event creation and destruction, host functions).
    DriverCall(DriverCallRecord),
    /// Totals and per-kernel summaries, written at exit.
    Summary(SummaryRecord),
}

/// One ioctl on an NVIDIA device node.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct IoctlRecord {
    /// Nanoseconds since the tracer started.
    pub t_ns: u64,
    /// How long the ioctl took, in nanoseconds.
    pub dur_ns: u64,
    /// The file descriptor it was issued on.
    pub fd: i32,
    /// `nvidiactl`, `nvidia0`, `nvidia-uvm`, ...
    pub node: String,
    /// The ioctl request number (direction, size, type and number, as `_IOC` packs them).
    pub request: u64,
    /// Escape name (`RM_ALLOC`) or UVM ioctl name (`UVM_REGISTER_GPU`); `None` when unknown.
    pub name: Option<String>,
    /// Allocated class (RM_ALLOC).
    pub class: Option<u32>,
    /// The allocated class's name from the class headers (`AMPERE_CHANNEL_GPFIFO_A`, ...), where known.
    pub class_name: Option<String>,
    /// RM control command (RM_CONTROL).
    pub cmd: Option<u32>,
    /// The control command's name (`NV2080_CTRL_CMD_GPU_GET_INFO_V2`, ...), where known.
    pub cmd_name: Option<String>,
    /// Key parameters (handles, sizes, addresses), by field name.
    pub params: Vec<(String, u64)>,
    /// `NV_STATUS` from the parameter structure, where it has one.
    pub status: Option<u32>,
    /// Return value of ioctl(2), and errno when it failed.
    pub ret: i32,
    /// errno, when the ioctl failed (`ret` is -1).
    pub errno: Option<i32>,
}

/// A GPFIFO channel the program allocated.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ChannelRecord {
    /// Nanoseconds since the tracer started.
    pub t_ns: u64,
    /// The channel's RM handle (`hObjectNew` of its RM_ALLOC); submissions name their channel by it.
    pub handle: u32,
    /// The channel's GPFIFO class (`HOPPER_CHANNEL_GPFIFO_A`, ...).
    pub class: u32,
    /// The class's name from the class headers, where known.
    pub class_name: Option<String>,
    /// GPU VA of the ring (CUDA maps it for the CPU at the same address).
    pub gpfifo_va: u64,
    /// Number of GPFIFO entries in the ring (`gpFifoEntries`).
    pub entries: u32,
    /// RM handle of the memory holding the channel's USERD (`hUserdMemory[0]`), where GP_PUT is written.
    pub userd_handle: u32,
    /// Byte offset of the USERD in that memory (`userdOffset[0]`).
    pub userd_offset: u64,
}

/// One method write, with runs of inline data folded into one record.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct MethodRecord {
    /// The subchannel the method was sent on (the class bound there decodes it).
    pub subchannel: u8,
    /// The method's byte offset in its class, as the class headers define it.
    pub offset: u32,
    /// Method name without class prefix; `None` when the class does not define the offset.
    pub name: Option<String>,
    /// The data word written (the first one of a folded run).
    pub value: u32,
    /// Non-zero or named fields: name, value, value name.
    pub fields: Vec<(String, u32, Option<String>)>,
    /// For a folded run of `LOAD_INLINE_DATA`: the number of words (`value` is the first one) and up
    /// to 24 of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run: Option<(u32, Vec<u32>)>,
}

/// Words that could not be decoded, kept raw.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Undecoded {
    /// Why decoding stopped (the decoder's error).
    pub reason: String,
    /// The segment's words, raw (empty when the segment was not mapped for the CPU).
    pub words: Vec<u32>,
}

/// One GPFIFO entry and the pushbuffer segment it points at.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct SubmissionRecord {
    /// Nanoseconds since the tracer started.
    pub t_ns: u64,
    /// RM handle of the channel (see [`ChannelRecord::handle`]).
    pub channel: u32,
    /// Ring slot.
    pub slot: u32,
    /// The raw 64-bit GPFIFO entry.
    pub entry: u64,
    /// GPU VA of the pushbuffer segment the entry points at.
    pub va: u64,
    /// Length of the segment, in 32-bit words.
    pub dwords: u32,
    /// The segment's methods, decoded.
    pub methods: Vec<MethodRecord>,
    /// What could not be decoded (the segment could not be read, or a malformed method), if anything.
    pub undecoded: Option<Undecoded>,
}

/// A constant bank a QMD binds.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ConstBankRecord {
    /// The constant bank's slot (0 holds the launch parameters).
    pub index: u32,
    /// GPU VA of the bank.
    pub address: u64,
    /// Size of the bank in bytes.
    pub size: u32,
}

/// A QMD scheduled with SEND_PCAS_A.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct LaunchRecord {
    /// Nanoseconds since the tracer started.
    pub t_ns: u64,
    /// RM handle of the channel that scheduled it.
    pub channel: u32,
    /// GPU VA of the QMD.
    pub qmd_va: u64,
    /// QMD major version (3 on Ampere, 4 on Hopper, 5 on Blackwell).
    pub qmd_version: u8,
    /// `inline` (uploaded in the pushbuffer) or `memory` (read from a CPU mapping).
    pub source: String,
    /// A kernel launch (grid > 0), as opposed to CUDA's "null" QMDs.
    pub kernel: bool,
    /// Grid size in blocks, x y z.
    pub grid: [u32; 3],
    /// Block size in threads, x y z.
    pub block: [u32; 3],
    /// Registers per thread.
    pub registers: u32,
    /// SHARED_MEMORY_SIZE: static (with the 1 KiB reserve on sm_90) + dynamic.
    pub shared_bytes: u32,
    /// GPU VA of the kernel's first instruction.
    pub program_address: u64,
    /// The constant banks the QMD binds.
    pub const_banks: Vec<ConstBankRecord>,
    /// Every non-zero QMD field.
    pub fields: Vec<(String, u64)>,
}

/// A driver-API launch (cuLaunchKernel / cuLaunchKernelEx).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct DriverLaunchRecord {
    /// Nanoseconds since the tracer started.
    pub t_ns: u64,
    /// How long the call took, in nanoseconds.
    pub dur_ns: u64,
    /// The entry point called (`cuLaunchKernel`, `cuLaunchKernelEx`).
    pub api: String,
    /// The `CUfunction` handle launched.
    pub function: u64,
    /// The kernel's name, from the driver's `cuFuncGetName` (`cuKernelGetName`), where it answered.
    pub name: Option<String>,
    /// Grid size in blocks, x y z.
    pub grid: [u32; 3],
    /// Block size in threads, x y z.
    pub block: [u32; 3],
    /// Dynamic shared memory per block, in bytes (`sharedMemBytes`).
    pub shared_bytes: u32,
    /// The `CUstream` handle it was launched on (0 for the default stream).
    pub stream: u64,
    /// The `CUresult` returned (0 is `CUDA_SUCCESS`).
    pub result: i32,
}

/// A driver-API call on streams and events: what a program (or a library such as NCCL) does to order its work,
/// in the order the calls returned on each thread.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct DriverCallRecord {
    /// Nanoseconds since the tracer started, when the call began.
    pub t_ns: u64,
    /// How long the call took, in nanoseconds.
    pub dur_ns: u64,
    /// The entry point called (`cuEventRecord`, `cuStreamWaitEvent_ptsz`, ...).
    pub api: String,
    /// The calling thread's kernel thread id.
    pub thread: u64,
    /// The `CUstream` the call names (0 for the legacy default stream), or created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<u64>,
    /// The `CUevent` the call names, or created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event: Option<u64>,
    /// The call's flags argument, where it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flags: Option<u64>,
    /// The `CUresult` returned (0 is `CUDA_SUCCESS`, 600 `CUDA_ERROR_NOT_READY`).
    pub result: i32,
}

/// How often one driver-API entry point was called.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct CallCount {
    /// The entry point.
    pub api: String,
    /// Calls traced.
    pub count: u64,
}

/// How often one launch shape occurred.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ShapeCount {
    /// Grid size in blocks, x y z.
    pub grid: [u32; 3],
    /// Block size in threads, x y z.
    pub block: [u32; 3],
    /// Shared memory per block, in bytes.
    pub shared_bytes: u32,
    /// How many launches had this shape.
    pub count: u64,
}

/// Per-kernel totals.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct KernelSummary {
    /// The kernel's name, where known.
    pub name: Option<String>,
    /// GPU VA of the kernel's code (`None` for kernels seen in driver launches).
    pub program_address: Option<u64>,
    /// Number of launches.
    pub launches: u64,
    /// Launch shapes, most frequent first.
    pub shapes: Vec<ShapeCount>,
    /// Registers per thread, from the last QMD that launched it (0 for driver-API kernels).
    pub registers: u32,
    /// Shared memory per block in bytes (SHARED_MEMORY_SIZE), from the last QMD that launched it (0 for driver-API
    /// kernels).
    pub shared_bytes: u32,
    /// Occupancy of the most frequent shape, and advice, from `apex::launch::occupancy`.
    pub occupancy: Option<String>,
    /// Advice on the launch shapes (idle SMs, a limiter worth changing), one line each.
    pub advice: Vec<String>,
}

/// Written at exit.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct SummaryRecord {
    /// ioctls traced.
    pub ioctls: u64,
    /// GPFIFO channels allocated.
    pub channels: u64,
    /// GPFIFO entries traced.
    pub submissions: u64,
    /// QMDs scheduled with SEND_PCAS_A that launch a kernel.
    pub qmd_launches: u64,
    /// Driver-API launches.
    pub driver_launches: u64,
    /// Driver-API stream and event calls, by entry point, most frequent first.
    #[serde(default)]
    pub driver_calls: Vec<CallCount>,
    /// Submissions with words that could not be decoded.
    pub undecoded: u64,
    /// Records lost because the queue was full.
    pub dropped: u64,
    /// Kernels seen in QMDs (by program address, named where a driver launch matched).
    pub kernels: Vec<KernelSummary>,
    /// Kernels seen in driver launches, by name.
    pub driver_kernels: Vec<KernelSummary>,
}
