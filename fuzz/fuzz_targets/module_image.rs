//! The module loader on arbitrary bytes: fatbins and host ELFs (`.nv_fatbin`, `__nv_relfatbin`, several
//! containers), every entry's payload (zstd and LZ4 decompression, bounded sizes), the selection for several
//! SMs, and `image::resolve` (cubins, relocatable cubins, fatbins, PTX) with a compiler double in place of
//! nvJitLink. Seeds: tests/fixtures/modules/*.fatbin, module_data.ptx and fuzz/seeds/module_image/ (the fatbin
//! sections of two nvcc-built programs).
#![no_main]

use std::sync::{Arc, OnceLock};

use apex::module::cubin::Cubin;
use apex::module::fatbin::{self, FatbinEntryKind};
use apex::module::image::{self, PtxHandling};
use apex::module::jit::{Cache, Compiler, InputKind, Jit, JitError};
use apex::module::select;
use libfuzzer_sys::fuzz_target;

/// A real cubin for every compile, so resolution runs to the end.
#[derive(Debug)]
struct Canned;

impl Compiler for Canned {
    fn identity(&self) -> String {
        "fuzz".into()
    }

    fn compile(&self, _: InputKind, _: &[u8], _: &str) -> Result<Vec<u8>, JitError> {
        Ok(include_bytes!("../../kernels/apex_test_kernels.sm_90.cubin").to_vec())
    }
}

fn jit() -> &'static Jit {
    static JIT: OnceLock<Jit> = OnceLock::new();
    JIT.get_or_init(|| Jit::new(Arc::new(Canned), Cache::disabled()))
}

fuzz_target!(
    // No module cache: payloads that decompress large would otherwise be written to ~/.cache and read back.
    init: {
        let _ = apex::set_module_cache(apex::ModuleCache::disabled());
    },
    |data: &[u8]| {
        if let Ok(entries) = fatbin::entries(data) {
            for e in &entries {
                let _ = (e.to_string(), e.arch_name());
                if let Ok(payload) = fatbin::payload(data, e) {
                    assert!(payload.len() <= fatbin::MAX_PAYLOAD.max(e.payload_size));
                    if e.compressed && e.uncompressed_size != 0 {
                        assert_eq!(payload.len() as u64, e.uncompressed_size);
                    }
                    if e.kind == FatbinEntryKind::Cubin {
                        let _ = select::cubin_arch(&payload);
                    } else {
                        let _ = select::ptx_target(&payload);
                    }
                }
            }
            for sm in [80, 86, 90, 100] {
                let s = select::select(&entries, sm);
                assert_eq!(s.candidates.len() + s.refused.len(), entries.len());
                assert_eq!(s.describe(&entries).len(), entries.len());
            }
        }
        let _ = (select::cubin_arch(data), select::looks_like_ptx(data));
        for sm in [86, 90, 100] {
            if let Ok(r) = image::resolve(data, sm, jit(), PtxHandling::Compile) {
                let _ = Cubin::parse(r.code.bytes());
            }
            if let Err(e) = image::resolve(data, sm, jit(), PtxHandling::Keep) {
                let _ = e.to_string();
            }
        }
    }
);
