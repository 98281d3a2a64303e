//! `Cubin::parse` on arbitrary bytes; when it parses, every kernel is walked, `link` writes the image into a
//! buffer of `image_size()` bytes (inputs that claim more than 64 MiB of image are not linked), and the
//! invariants the launch layer relies on are checked.
#![no_main]

use apex::module::cubin::Cubin;
use libfuzzer_sys::fuzz_target;

/// Largest image linked: NOBITS sections can claim any size without bytes in the file.
const MAX_IMAGE: u64 = 64 << 20;

fuzz_target!(|data: &[u8]| {
    let Ok(cubin) = Cubin::parse(data) else {
        return;
    };
    let image_size = cubin.image_size();
    for sm in [80, 86, 89, 90, 100, 120] {
        let _ = cubin.check_arch(sm);
    }
    for section in cubin.image_sections() {
        let end = section.image_offset.checked_add(section.size);
        assert!(
            end.is_some_and(|e| e <= image_size),
            "section {section:?} outside the image ({image_size})"
        );
    }
    for k in cubin.kernels() {
        assert!(cubin.kernel(&k.name).is_ok());
        let end = k.code_offset.checked_add(k.code_size);
        assert!(
            end.is_some_and(|e| e <= image_size),
            "kernel {} code outside the image",
            k.name
        );
        assert!(k.registers > 0);
        assert!(k.params.windows(2).all(|w| w[0].ordinal < w[1].ordinal));
        for b in &k.const_banks {
            if let Some(offset) = b.image_offset {
                let end = offset.checked_add(b.size);
                assert!(
                    end.is_some_and(|e| e <= image_size),
                    "bank {} outside the image",
                    b.bank
                );
            }
            assert_eq!(k.const_bank(b.bank), Some(b));
        }
        let _ = format!("{k:?}");
    }
    if image_size <= MAX_IMAGE {
        let mut image = vec![0u8; image_size as usize];
        for base_va in [0, 0x2_0000_0000, 0xffff_ffff_ffff_0000] {
            let _ = cubin.link(base_va, &mut image);
        }
        if let Some(short) = image_size.checked_sub(1) {
            assert!(cubin.link(0, &mut image[..short as usize]).is_err());
        }
    }
});
