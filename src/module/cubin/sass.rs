//! What a kernel's machine code uses that the direct path cannot give it, read from the SASS itself.
//!
//! Texture and surface instructions (`tex2D`, `tex1Dfetch`, `surf2Dwrite`, ... on texture and surface objects)
//! index the texture header and sampler pools the CUDA driver binds in its own channels; APEX's channels bind none,
//! so such a kernel would read descriptors from nowhere and fault. Nothing in the cubin's attributes says a kernel
//! uses them: the instructions do. On Hopper (sm_90) every instruction is 16 bytes and its low 9 bits name the
//! operation (bits 9-11 choose operand forms, bits 12-15 the predicate). Seen with nvcc 13.0 and cuobjdump (H200,
//! 2026-11-28): the bindless forms `TEX` 0x160, `TLD4` 0x163, `TLD` 0x166, `TXD` 0x16c, `TXQ` 0x16f, `SULD` 0x199,
//! `SUST` 0x19d, `SURED` 0x19f; the forms next to them (bound textures, `TMML`, surface atomics) lie in the same two
//! blocks, which no other operation used in 1.2 million instructions of PyTorch's sm_90 kernels (the nearest,
//! 0x181-0x189, are the loads, stores and `SHFL`).

/// The 9-bit operation codes of texture instructions on sm_90: `TEX` to `TXQ` with their bound forms.
const TEXTURE_OPS: std::ops::RangeInclusive<u16> = 0x160..=0x170;

/// Those of surface instructions: `SULD`, `SUST`, `SURED`, `SUATOM` and their bound forms.
const SURFACE_OPS: std::ops::RangeInclusive<u16> = 0x198..=0x19f;

/// `BPT` (`BPT.TRAP`: what `__trap()` and `asm("trap;")` compile to).
const BPT: u16 = 0x15c;

/// `CALL.ABS`: a call to an absolute address, which is how sm_90 code calls an external function (`__assertfail`,
/// `vprintf`); calls to the module's own device functions are `CALL.REL`.
const CALL_ABS: u16 = 0x143;

/// The operation code of a 16-byte sm_90 instruction.
fn op(word: &[u8]) -> u16 {
    u16::from_le_bytes([word[0], word[1]]) & 0x1ff
}

/// The byte offset of the first trap instruction in `code` (machine code for `sm`) that a thread can reach: a `BPT`
/// right after a `CALL.ABS` follows a call that does not return (the compiler places one after `__assertfail`, which
/// under APEX ends the thread), so it is not counted. `None` for code of other architectures, whose encodings were
/// not checked. Seen with nvcc 13.0 (H200, 2026-11-28): `BPT.TRAP 0x1` is `0x000000040000795c`, and the asserts
/// looked at in PyTorch's kernels are each followed by one after their `CALL.ABS.NOINC`. Reachable ones guard
/// libraries' fatal paths (`examples/cubin_scan`: in the own code of 66 of PyTorch 2.11's 21 742 sm_90 kernels and
/// of 838 of cuBLASLt 13's 10 626).
pub(crate) fn reachable_trap(code: &[u8], sm: u32) -> Option<usize> {
    if sm / 10 != 9 {
        return None;
    }
    let mut previous = 0;
    code.chunks_exact(16).enumerate().find_map(|(i, word)| {
        let this = op(word);
        let trap = this == BPT && previous != CALL_ABS;
        previous = this;
        trap.then_some(i * 16)
    })
}

/// The first texture or surface instruction in `code` (machine code for `sm`): its kind and byte offset. `None` for
/// code of other architectures, whose encodings were not checked.
pub(crate) fn texture_or_surface(code: &[u8], sm: u32) -> Option<(&'static str, usize)> {
    if sm / 10 != 9 {
        return None;
    }
    code.chunks_exact(16).enumerate().find_map(|(i, word)| {
        let op = op(word);
        let kind = if TEXTURE_OPS.contains(&op) {
            "texture"
        } else if SURFACE_OPS.contains(&op) {
            "surface"
        } else {
            return None;
        };
        Some((kind, i * 16))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An instruction's low 64 bits, as cuobjdump prints them, and zero high bits.
    fn word(low: u64) -> [u8; 16] {
        let mut w = [0u8; 16];
        w[..8].copy_from_slice(&low.to_le_bytes());
        w
    }

    fn code(words: &[u64]) -> Vec<u8> {
        words.iter().flat_map(|&w| word(w)).collect()
    }

    // Encodings cuobjdump showed for nvcc 13.0's sm_90 output.
    const TEX_LL: u64 = 0x20000403080f7f60;
    const TLD4_G: u64 = 0x200004ff0c0c7f63;
    const TLD_LZ: u64 = 0x000004ff05067f66;
    const TXD: u64 = 0x2000040c140e7f6c;
    const TXQ: u64 = 0x0000040019197f6f;
    const SULD: u64 = 0x10000a0004007f99;
    const SUST: u64 = 0x10000a0b04007f9d;
    const SURED: u64 = 0x10000a1104007f9f;
    // Others, from the same output and from the test kernels: LDG, STG, LDS, SHFL, EXIT, BRA, NOP.
    const OTHERS: [u64; 7] = [
        0x0000000402027981,
        0x0000000402007986,
        0x0000000002027984,
        0x0c00001f00037f89,
        0x000000000000794d,
        0xfffffffc00fc7947,
        0x0000000000007918,
    ];

    #[test]
    fn texture_and_surface_instructions_are_found_where_they_are() {
        for (w, kind) in [
            (TEX_LL, "texture"),
            (TLD4_G, "texture"),
            (TLD_LZ, "texture"),
            (TXD, "texture"),
            (TXQ, "texture"),
            (SULD, "surface"),
            (SUST, "surface"),
            (SURED, "surface"),
        ] {
            let c = code(&[OTHERS[0], OTHERS[1], w, OTHERS[4]]);
            assert_eq!(texture_or_surface(&c, 90), Some((kind, 32)), "{w:#x}");
        }
    }

    const BPT_TRAP: u64 = 0x000000040000795c;
    const CALL_ABS_NOINC: u64 = 0x0000000002007343;
    /// `CALL.REL.NOINC` to a device function of the module.
    const CALL_REL_NOINC: u64 = 0x0000000000007944;

    #[test]
    fn a_trap_a_thread_can_reach_is_found_and_one_after_an_external_call_is_not() {
        let exit = OTHERS[4];
        // `__trap()`: found where it is.
        let c = code(&[OTHERS[0], BPT_TRAP, exit]);
        assert_eq!(reachable_trap(&c, 90), Some(16));
        // After `__assertfail`'s call, which does not return: unreachable.
        let c = code(&[OTHERS[0], CALL_ABS_NOINC, BPT_TRAP, exit]);
        assert_eq!(reachable_trap(&c, 90), None);
        // After a call to the module's own function, which returns: reachable.
        let c = code(&[CALL_REL_NOINC, BPT_TRAP, exit]);
        assert_eq!(reachable_trap(&c, 90), Some(16));
        // The second of two, the first excused.
        let c = code(&[CALL_ABS_NOINC, BPT_TRAP, OTHERS[0], BPT_TRAP]);
        assert_eq!(reachable_trap(&c, 90), Some(48));
        assert_eq!(reachable_trap(&code(&OTHERS), 90), None);
        assert_eq!(reachable_trap(&code(&[BPT_TRAP]), 80), None);
    }

    #[test]
    fn other_instructions_and_other_architectures_are_not_taken_for_them() {
        assert_eq!(texture_or_surface(&code(&OTHERS), 90), None);
        assert_eq!(texture_or_surface(&[], 90), None);
        // A partial last word is not an instruction.
        assert_eq!(texture_or_surface(&word(TEX_LL)[..8], 90), None);
        // Encodings of other architectures were not checked: nothing is claimed for them.
        assert_eq!(texture_or_surface(&code(&[TEX_LL]), 80), None);
        assert_eq!(texture_or_surface(&code(&[TEX_LL]), 100), None);
        assert_eq!(
            texture_or_surface(&code(&[TEX_LL]), 90),
            Some(("texture", 0))
        );
    }
}
