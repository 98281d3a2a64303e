//! What the preload refuses in a module or kernel the direct path would load: state that would diverge between
//! CUDA's instance of the module and APEX's, and device-runtime calls whose effects APEX cannot report as CUDA does.
//! `__assertfail` is not one of them once the attach set failed asserts to end their thread (the preload replays
//! them through libcuda: [`crate::asserts`]).

use apex::module::cubin::{Cubin, KernelInfo};

use crate::Refusal;

/// Externals whose effects the program would miss on an APEX queue: `printf` output reaches the host only when APEX
/// drains its own FIFO (libcuda prints its kernels' output at its synchronizations, interleaved by time), a failed
/// `assert` traps unless it was set to end its thread; allocation functions APEX refuses anyway.
const DEVICE_RUNTIME: &[&str] = &["vprintf", "__assertfail", "malloc", "free", "__cudaCDP2"];

/// The external the preload can report as CUDA does when asserts end their thread.
const ASSERT: &str = "__assertfail";

/// Whether `symbol` is a device-runtime call the preload must leave to libcuda (`asserts`: failed asserts end their
/// thread and are replayed, so `__assertfail` is not one).
fn is_device_runtime(symbol: &str, asserts: bool) -> bool {
    if asserts && symbol == ASSERT {
        return false;
    }
    DEVICE_RUNTIME.iter().any(|d| symbol.starts_with(d))
}

/// Why no kernel of this module may run on an APEX queue, if one applies: the module calls the device runtime and
/// its kernels do not say which of them do.
///
/// Its `__device__` variables are no reason: APEX's instance uses CUDA's (`Gpu::load_module_sharing` with the
/// addresses `cuModuleGetGlobal` gives), and a variable CUDA cannot place refuses the module
/// ([`Refusal::ModuleGlobals`]). `__constant__` variables are read-only on the device; the program can change them
/// only through their address, which the preload watches (`cuModuleGetGlobal`, `cuLibraryGetGlobal`:
/// [`Refusal::GlobalsEscaped`]).
pub fn module_refusal(cubin: &Cubin, asserts: bool) -> Option<Refusal> {
    // Kernels that do not list their externals are each taken to call all of the module's.
    let listed = cubin.kernels().iter().any(|k| !k.externs.is_empty());
    if !listed
        && let Some(e) = cubin
            .externals()
            .iter()
            .find(|e| is_device_runtime(e, asserts))
    {
        return Some(Refusal::DeviceRuntime(e.clone()));
    }
    None
}

/// Why this kernel may not run on an APEX queue, if one applies: it calls the device runtime (`asserts`: failed
/// asserts end their thread, so `__assertfail` alone is no reason).
pub fn kernel_refusal(kernel: &KernelInfo, asserts: bool) -> Option<Refusal> {
    kernel
        .externs
        .iter()
        .find(|e| is_device_runtime(e, asserts))
        .map(|e| Refusal::DeviceRuntime(e.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cubin(path: &str) -> Cubin {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let bytes = std::fs::read(root.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
        Cubin::parse(&bytes).unwrap()
    }

    #[test]
    fn plain_kernels_pass() {
        let c = cubin("kernels/apex_test_kernels.sm_90.cubin");
        assert_eq!(module_refusal(&c, false), None);
        for k in c.kernels() {
            assert_eq!(kernel_refusal(k, false), None, "{}", k.name);
        }
    }

    #[test]
    fn device_writable_globals_do_not_refuse_the_module_by_themselves() {
        // They are placed at CUDA's instance's addresses when APEX loads the module.
        let c = cubin("kernels/conformance/module_data.sm_90.cubin");
        assert!(
            c.globals().iter().any(|g| !g.is_constant()),
            "fixture has __device__ data"
        );
        assert_eq!(module_refusal(&c, false), None);
    }

    #[test]
    fn printf_and_assert_kernels_are_refused_by_name() {
        let c = cubin("kernels/conformance/printf_kernels.sm_90.cubin");
        let refused: Vec<_> = c
            .kernels()
            .iter()
            .filter_map(|k| kernel_refusal(k, false))
            .collect();
        assert!(!refused.is_empty());
        assert!(refused.iter().all(
            |r| matches!(r, Refusal::DeviceRuntime(s) if s == "vprintf" || s == "__assertfail")
        ));
        assert!(
            refused
                .iter()
                .any(|r| matches!(r, Refusal::DeviceRuntime(s) if s == "__assertfail")),
            "the fixture has an assert-only kernel"
        );
        // With asserts ending their thread, only printf kernels stay on libcuda.
        let refused: Vec<_> = c
            .kernels()
            .iter()
            .filter_map(|k| kernel_refusal(k, true))
            .collect();
        assert!(!refused.is_empty());
        assert!(
            refused
                .iter()
                .all(|r| matches!(r, Refusal::DeviceRuntime(s) if s == "vprintf"))
        );
    }

    #[test]
    fn malloc_kernels_are_refused_and_their_neighbours_are_not() {
        let c = cubin("kernels/conformance/externs.sm_90.cubin");
        let (calls, plain): (Vec<_>, Vec<_>) =
            c.kernels().iter().partition(|k| !k.externs.is_empty());
        assert!(!calls.is_empty());
        for k in &calls {
            let runtime = k.externs.iter().any(|e| is_device_runtime(e, false));
            assert_eq!(
                kernel_refusal(k, false).is_some(),
                runtime,
                "{} calls {:?}",
                k.name,
                k.externs
            );
        }
        for k in plain {
            assert_eq!(kernel_refusal(k, false), None, "{}", k.name);
        }
    }
}
