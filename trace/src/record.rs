//! The JSON-lines records the tracer writes: one per ioctl, channel, GPFIFO entry, QMD launch and
//! driver-API launch, and a summary at exit. Every type round-trips through serde.

use serde::{Deserialize, Serialize};

/// One line of the trace file.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Record {
    Ioctl(IoctlRecord),
    Channel(ChannelRecord),
    Submission(SubmissionRecord),
    Launch(LaunchRecord),
    /// A QMD written by an inline upload, launched or not: the nodes of a CUDA graph are uploaded once and
    /// then scheduled by the GPU itself (as another QMD's dependent), never by SEND_PCAS_A. `source` is
    /// `upload`, `qmd_va` where it was written.
    QmdUpload(LaunchRecord),
    DriverLaunch(DriverLaunchRecord),
    Summary(SummaryRecord),
}

/// One ioctl on an NVIDIA device node.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct IoctlRecord {
    /// Nanoseconds since the tracer started.
    pub t_ns: u64,
    pub dur_ns: u64,
    pub fd: i32,
    /// `nvidiactl`, `nvidia0`, `nvidia-uvm`, ...
    pub node: String,
    pub request: u64,
    /// Escape name (`RM_ALLOC`) or UVM ioctl name (`UVM_REGISTER_GPU`); `None` when unknown.
    pub name: Option<String>,
    /// Allocated class (RM_ALLOC).
    pub class: Option<u32>,
    pub class_name: Option<String>,
    /// RM control command (RM_CONTROL).
    pub cmd: Option<u32>,
    pub cmd_name: Option<String>,
    /// Key parameters (handles, sizes, addresses), by field name.
    pub params: Vec<(String, u64)>,
    /// `NV_STATUS` from the parameter structure, where it has one.
    pub status: Option<u32>,
    /// Return value of ioctl(2), and errno when it failed.
    pub ret: i32,
    pub errno: Option<i32>,
}

/// A GPFIFO channel the program allocated.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ChannelRecord {
    pub t_ns: u64,
    pub handle: u32,
    pub class: u32,
    pub class_name: Option<String>,
    /// GPU VA of the ring (CUDA maps it for the CPU at the same address).
    pub gpfifo_va: u64,
    pub entries: u32,
    pub userd_handle: u32,
    pub userd_offset: u64,
}

/// One method write, with runs of inline data folded into one record.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct MethodRecord {
    pub subchannel: u8,
    pub offset: u32,
    /// Method name without class prefix; `None` when the class does not define the offset.
    pub name: Option<String>,
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
    pub reason: String,
    pub words: Vec<u32>,
}

/// One GPFIFO entry and the pushbuffer segment it points at.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct SubmissionRecord {
    pub t_ns: u64,
    pub channel: u32,
    /// Ring slot.
    pub slot: u32,
    pub entry: u64,
    pub va: u64,
    pub dwords: u32,
    pub methods: Vec<MethodRecord>,
    pub undecoded: Option<Undecoded>,
}

/// A constant bank a QMD binds.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ConstBankRecord {
    pub index: u32,
    pub address: u64,
    pub size: u32,
}

/// A QMD scheduled with SEND_PCAS_A.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct LaunchRecord {
    pub t_ns: u64,
    pub channel: u32,
    pub qmd_va: u64,
    pub qmd_version: u8,
    /// `inline` (uploaded in the pushbuffer) or `memory` (read from a CPU mapping).
    pub source: String,
    /// A kernel launch (grid > 0), as opposed to CUDA's "null" QMDs.
    pub kernel: bool,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub registers: u32,
    /// SHARED_MEMORY_SIZE: static (with the 1 KiB reserve on sm_90) + dynamic.
    pub shared_bytes: u32,
    pub program_address: u64,
    pub const_banks: Vec<ConstBankRecord>,
    /// Every non-zero QMD field.
    pub fields: Vec<(String, u64)>,
}

/// A driver-API launch (cuLaunchKernel / cuLaunchKernelEx).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct DriverLaunchRecord {
    pub t_ns: u64,
    pub dur_ns: u64,
    pub api: String,
    pub function: u64,
    pub name: Option<String>,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
    pub stream: u64,
    pub result: i32,
}

/// How often one launch shape occurred.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct ShapeCount {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
    pub count: u64,
}

/// Per-kernel totals.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct KernelSummary {
    pub name: Option<String>,
    pub program_address: Option<u64>,
    pub launches: u64,
    pub shapes: Vec<ShapeCount>,
    pub registers: u32,
    pub shared_bytes: u32,
    /// Occupancy of the most frequent shape, and advice, from `apex::launch::occupancy`.
    pub occupancy: Option<String>,
    pub advice: Vec<String>,
}

/// Written at exit.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct SummaryRecord {
    pub ioctls: u64,
    pub channels: u64,
    pub submissions: u64,
    pub qmd_launches: u64,
    pub driver_launches: u64,
    pub undecoded: u64,
    /// Records lost because the queue was full.
    pub dropped: u64,
    /// Kernels seen in QMDs (by program address, named where a driver launch matched).
    pub kernels: Vec<KernelSummary>,
    /// Kernels seen in driver launches, by name.
    pub driver_kernels: Vec<KernelSummary>,
}
