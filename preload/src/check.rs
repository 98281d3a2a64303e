//! What the preload refuses in a module or kernel the direct path would load: state that would diverge between
//! CUDA's instance of the module and APEX's, and device-runtime calls whose effects APEX reports only at its own
//! synchronize.

use apex::launch::cubin::{Cubin, KernelInfo};

use crate::Refusal;

/// Externals whose effects the program would miss on an APEX queue: `printf` output and `assert` failures reach the
/// host only when APEX synchronizes its queue (the program synchronizes CUDA's streams); allocation functions APEX
/// refuses anyway.
const DEVICE_RUNTIME: &[&str] = &["vprintf", "__assertfail", "malloc", "free", "__cudaCDP2"];

fn is_device_runtime(symbol: &str) -> bool {
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
pub fn module_refusal(cubin: &Cubin) -> Option<Refusal> {
    // Kernels that do not list their externals are each taken to call all of the module's.
    let listed = cubin.kernels().iter().any(|k| !k.externs.is_empty());
    if !listed && let Some(e) = cubin.externals().iter().find(|e| is_device_runtime(e)) {
        return Some(Refusal::DeviceRuntime(e.clone()));
    }
    None
}

/// Why this kernel may not run on an APEX queue, if one applies: it calls the device runtime.
pub fn kernel_refusal(kernel: &KernelInfo) -> Option<Refusal> {
    kernel
        .externs
        .iter()
        .find(|e| is_device_runtime(e))
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
        assert_eq!(module_refusal(&c), None);
        for k in c.kernels() {
            assert_eq!(kernel_refusal(k), None, "{}", k.name);
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
        assert_eq!(module_refusal(&c), None);
    }

    #[test]
    fn printf_and_assert_kernels_are_refused_by_name() {
        let c = cubin("kernels/conformance/printf_kernels.sm_90.cubin");
        let refused: Vec<_> = c.kernels().iter().filter_map(kernel_refusal).collect();
        assert!(!refused.is_empty());
        assert!(refused.iter().all(
            |r| matches!(r, Refusal::DeviceRuntime(s) if s == "vprintf" || s == "__assertfail")
        ));
    }

    #[test]
    fn malloc_kernels_are_refused_and_their_neighbours_are_not() {
        let c = cubin("kernels/conformance/externs.sm_90.cubin");
        let (calls, plain): (Vec<_>, Vec<_>) =
            c.kernels().iter().partition(|k| !k.externs.is_empty());
        assert!(!calls.is_empty());
        for k in &calls {
            let runtime = k.externs.iter().any(|e| is_device_runtime(e));
            assert_eq!(
                kernel_refusal(k).is_some(),
                runtime,
                "{} calls {:?}",
                k.name,
                k.externs
            );
        }
        for k in plain {
            assert_eq!(kernel_refusal(k), None, "{}", k.name);
        }
    }
}
