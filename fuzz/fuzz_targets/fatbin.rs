//! `fatbin::entries` on arbitrary bytes (a fatbin, or a host ELF with `.nv_fatbin`/`__nv_relfatbin` sections),
//! every entry's payload (zstd and LZ4 decompression included), `select_cubin` for several SMs, and
//! `Cubin::parse` on what it selects. `module_image` fuzzes the whole loader.
#![no_main]

use apex::module::cubin::Cubin;
use apex::module::{fatbin, select};
use libfuzzer_sys::fuzz_target;

fuzz_target!(
    // No module cache: payloads that decompress large would otherwise be written to ~/.cache and read back.
    init: {
        let _ = apex::set_module_cache(apex::ModuleCache::disabled());
    },
    |data: &[u8]| {
        let _ = fatbin::is_fatbin(data);
        if let Ok(entries) = fatbin::entries(data) {
            for e in &entries {
                let _ = e.to_string();
                if let Ok(payload) = fatbin::payload(data, e) {
                    if e.compression.is_none() {
                        assert_eq!(payload.len(), e.payload_size);
                    }
                }
            }
        }
        for sm in [80, 90, 100] {
            match select::select_cubin(data, sm) {
                Ok(cubin) => {
                    let _ = Cubin::parse(&cubin);
                }
                Err(e) => {
                    let _ = e.to_string();
                }
            }
        }
    }
);
