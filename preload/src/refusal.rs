//! Why a launch goes to libcuda instead of an APEX queue.

/// Why the preload leaves a launch to libcuda. Every refusal is counted ([`crate::stats`]) and logged once per
/// function and reason through `tracing`; the launch itself then runs on libcuda after a sync point, so the
/// program's results do not depend on it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// `APEX_PRELOAD=off`.
    #[error("the takeover is off (APEX_PRELOAD=off)")]
    Disabled,
    /// `CUDA_LAUNCH_BLOCKING=1`: libcuda makes every launch synchronous, so that an error shows at the launch that
    /// caused it; APEX's launches are asynchronous, so the takeover is off and libcuda runs everything.
    #[error(
        "the takeover is off: CUDA_LAUNCH_BLOCKING=1 makes every launch synchronous, as libcuda runs them"
    )]
    LaunchBlocking,
    /// A CUDA tool is injected into the process (`CUDA_INJECTION64_PATH`; compute-sanitizer's
    /// `NV_SANITIZER_INJECTION_PORT_BASE`): it sees, checks and times only the work libcuda runs, so the takeover is
    /// off.
    #[error(
        "the takeover is off: a CUDA tool is injected (compute-sanitizer, Nsight), which sees only libcuda's work"
    )]
    ToolInjected,
    /// A profiler records GPU activity through CUPTI (torch.profiler, a CUPTI client of the program's own): it sees
    /// only libcuda's work, so launches go to libcuda while it records.
    #[error("a profiler records GPU activity through CUPTI, which sees only libcuda's work")]
    Profiled,
    /// The takeover ended before the program did: the CUDA context APEX had joined was destroyed or reset
    /// (`cuCtxDestroy`, `cudaDeviceReset`), and APEX does not join the context CUDA makes after it.
    #[error("the takeover ended when {0}; work after it stays on libcuda")]
    Ended(String),
    /// APEX could not join the program's CUDA context.
    #[error("APEX could not attach to the CUDA context: {0}")]
    AttachFailed(String),
    /// APEX attached, but on the CUDA driver backend: launching through it would only add a layer.
    #[error("APEX attached on the CUDA driver backend ({0}); launches stay on libcuda")]
    DriverBackend(String),
    /// No CUDA context is current on the launching thread.
    #[error("no CUDA context is current on the launching thread")]
    NoContext,
    /// A kernel of APEX's failed a device assert in this context, which was reported as CUDA reports it: the context
    /// is unusable from then on, and libcuda answers every call.
    #[error("a device assert failed in this context; libcuda answers from then on")]
    AssertReported,
    /// A stream is being captured into a CUDA graph: launches must reach libcuda to be captured.
    #[error("a stream is being captured into a CUDA graph")]
    Capturing,
    /// The stream was made with a priority above the default (`cudaStreamCreateWithPriority`): libcuda schedules
    /// its work ahead of other streams', which APEX's queues, all of one priority, would not.
    #[error(
        "the stream has a priority above the default ({0}), which libcuda schedules and APEX's queues would not"
    )]
    StreamPriority(i32),
    /// Every APEX queue the preload may build serves another stream.
    #[error("all {0} APEX queues serve other streams (APEX_PRELOAD_QUEUES)")]
    TooManyStreams(usize),
    /// Building the stream's APEX queue failed.
    #[error("the stream's APEX queue could not be built: {0}")]
    QueueFailed(String),
    /// The program asked libcuda for a driver entry point whose variant the preload does not know, so ordering with
    /// it cannot be kept: the takeover is off from then on.
    #[error(
        "the program uses `{0}` in a variant the preload does not interpose; the takeover is off"
    )]
    UnknownEntryPoint(String),
    /// The function or kernel handle did not come from a module or library the preload saw loaded, and the driver
    /// could not name its owner.
    #[error("the function was not obtained from a module or library the preload saw loaded")]
    UnknownFunction,
    /// The function's module or library was loaded before the preload saw it (or by a path it does not interpose).
    #[error("the function's module or library was not seen loaded")]
    UnknownModule,
    /// The module's image could not be found or its length not determined.
    #[error("the module image cannot be read: {0}")]
    UnreadableImage(String),
    /// APEX's loader refused the module (no code for this GPU, PTX that nvJitLink cannot compile, ...).
    #[error("APEX refused the module: {0}")]
    ModuleRefused(String),
    /// The module has a device-writable global that CUDA's instance of the module does not give an address for (or
    /// a smaller one than the cubin says): APEX could not share it, and the two copies would diverge.
    #[error(
        "the module has the device-writable global `{0}`, which CUDA's instance of the module does not expose (or \
         exposes at another size); CUDA's and APEX's copies would diverge"
    )]
    ModuleGlobals(String),
    /// The program asked libcuda for the address of one of the module's `__constant__` globals (or a managed one):
    /// APEX's copy would no longer match, so the module's kernels stay on libcuda from then on.
    #[error(
        "the program took the address of a managed global of this module, or of a __constant__ one whose bank APEX could not share with CUDA's instance; its kernels stay on libcuda"
    )]
    GlobalsEscaped,
    /// APEX refused the kernel (an external it does not provide, a name it does not find, ...).
    #[error("APEX refused the kernel: {0}")]
    KernelRefused(String),
    /// The kernel calls the device runtime (`printf`, `malloc`, or `assert` where asserts could not be set to end
    /// their thread), whose output or error APEX cannot report as CUDA does.
    #[error("the kernel calls `{0}`, whose output or error APEX cannot report as CUDA does")]
    DeviceRuntime(String),
    /// Parameters missing, or passed through an `extra` array other than one packed buffer
    /// (`CU_LAUNCH_PARAM_BUFFER_POINTER` and `..._SIZE`, which is taken) no longer than the kernel's parameters, or
    /// given both ways.
    #[error(
        "kernel parameters are missing, or passed in an `extra` array other than one packed buffer no longer than \
         the kernel's parameters"
    )]
    ExtraParams,
    /// A `cuLaunchKernelEx` attribute the preload cannot honour.
    #[error("launch attribute {id} ({name}) = {value} cannot be honoured{}", others_text(*others))]
    LaunchAttribute {
        /// `CUlaunchAttributeID`.
        id: u32,
        /// Its name.
        name: &'static str,
        /// The first word of its value.
        value: u32,
        /// The ids (below 64, a bit each) of the launch's other attributes that cannot be honoured either.
        others: u64,
    },
    /// The program set a function attribute APEX does not apply (cluster shape, non-portable cluster size, ...).
    #[error("the program set function attribute {0}, which APEX does not apply")]
    FunctionAttribute(i32),
    /// The program raised the context's stack size limit, which APEX's queues do not follow.
    #[error(
        "the program raised the context's stack size (cuCtxSetLimit); APEX's queues do not follow it"
    )]
    ContextLimit,
    /// APEX refused the launch configuration (grid, block, shared memory, cluster shape).
    #[error("APEX refused the launch: {0}")]
    LaunchRefused(String),
    /// The APEX launch failed after it was checked.
    #[error("the APEX launch failed: {0}")]
    LaunchFailed(String),
    /// The preload's own state was lost to an internal error; it forwards everything from then on.
    #[error("an internal error turned the takeover off")]
    Internal,
}

/// ", also 5, 12" for the other attribute ids set in `others` (empty when there are none).
fn others_text(others: u64) -> String {
    if others == 0 {
        return String::new();
    }
    let ids: Vec<String> = (0..64)
        .filter(|b| others & (1 << b) != 0)
        .map(|b| b.to_string())
        .collect();
    format!(" (also refused in this launch: {})", ids.join(", "))
}

impl Refusal {
    /// A short stable label, for counters and the JSON summary.
    pub fn label(&self) -> &'static str {
        match self {
            Refusal::Disabled => "disabled",
            Refusal::LaunchBlocking => "launch_blocking",
            Refusal::ToolInjected => "cuda_tool",
            Refusal::Profiled => "profiled",
            Refusal::Ended(_) => "takeover_ended",
            Refusal::AttachFailed(_) => "attach_failed",
            Refusal::DriverBackend(_) => "driver_backend",
            Refusal::NoContext => "no_context",
            Refusal::AssertReported => "assert_reported",
            Refusal::Capturing => "capturing",
            Refusal::StreamPriority(_) => "stream_priority",
            Refusal::TooManyStreams(_) => "too_many_streams",
            Refusal::QueueFailed(_) => "queue_failed",
            Refusal::UnknownEntryPoint(_) => "unknown_entry_point",
            Refusal::UnknownFunction => "unknown_function",
            Refusal::UnknownModule => "unknown_module",
            Refusal::UnreadableImage(_) => "unreadable_image",
            Refusal::ModuleRefused(_) => "module_refused",
            Refusal::ModuleGlobals(_) => "module_globals",
            Refusal::GlobalsEscaped => "globals_escaped",
            Refusal::KernelRefused(_) => "kernel_refused",
            Refusal::DeviceRuntime(_) => "device_runtime",
            Refusal::ExtraParams => "extra_params",
            Refusal::LaunchAttribute { .. } => "launch_attribute",
            Refusal::FunctionAttribute(_) => "function_attribute",
            Refusal::ContextLimit => "context_limit",
            Refusal::LaunchRefused(_) => "launch_refused",
            Refusal::LaunchFailed(_) => "launch_failed",
            Refusal::Internal => "internal",
        }
    }

    /// Whether the refusal holds for every later launch of the same function (cached with it), rather than for
    /// this launch's configuration or the process's state now.
    pub fn is_per_function(&self) -> bool {
        matches!(
            self,
            Refusal::UnknownFunction
                | Refusal::UnknownModule
                | Refusal::UnreadableImage(_)
                | Refusal::ModuleRefused(_)
                | Refusal::ModuleGlobals(_)
                | Refusal::GlobalsEscaped
                | Refusal::KernelRefused(_)
                | Refusal::DeviceRuntime(_)
                | Refusal::FunctionAttribute(_)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_distinct_and_messages_say_why() {
        let all = [
            Refusal::Disabled,
            Refusal::LaunchBlocking,
            Refusal::ToolInjected,
            Refusal::Profiled,
            Refusal::Ended("x".into()),
            Refusal::AttachFailed("x".into()),
            Refusal::DriverBackend("x".into()),
            Refusal::NoContext,
            Refusal::AssertReported,
            Refusal::Capturing,
            Refusal::StreamPriority(-1),
            Refusal::TooManyStreams(8),
            Refusal::QueueFailed("x".into()),
            Refusal::UnknownEntryPoint("cuX".into()),
            Refusal::UnknownFunction,
            Refusal::UnknownModule,
            Refusal::UnreadableImage("x".into()),
            Refusal::ModuleRefused("x".into()),
            Refusal::ModuleGlobals("g".into()),
            Refusal::GlobalsEscaped,
            Refusal::KernelRefused("x".into()),
            Refusal::DeviceRuntime("vprintf".into()),
            Refusal::ExtraParams,
            Refusal::LaunchAttribute {
                id: 6,
                name: "programmatic stream serialization",
                value: 1,
                others: 1 << 12,
            },
            Refusal::FunctionAttribute(13),
            Refusal::ContextLimit,
            Refusal::LaunchRefused("x".into()),
            Refusal::LaunchFailed("x".into()),
            Refusal::Internal,
        ];
        let labels: std::collections::BTreeSet<_> = all.iter().map(Refusal::label).collect();
        assert_eq!(labels.len(), all.len());
        assert!(
            Refusal::DeviceRuntime("vprintf".into())
                .to_string()
                .contains("vprintf")
        );
        assert!(Refusal::TooManyStreams(8).to_string().contains('8'));
        assert!(Refusal::ModuleGlobals("g".into()).is_per_function());
        assert!(!Refusal::Capturing.is_per_function());
        assert!(!Refusal::LaunchRefused("x".into()).is_per_function());
    }
}
