//! Constant bank 0 as CUDA cubins for sm_90 expect it: 0x210 bytes of driver words, then the parameters at
//! the cubin's EIATTR_PARAM_CBANK offset. Only the words the compiled code reads are filled (see
//! research/hopper-launch.md §6); the rest stay zero.

/// Driver words before the parameters on sm_90.
pub const DRIVER_BYTES: usize = 0x210;
/// The initial stack pointer every sm_90 kernel loads from c[0x0][0x28].
pub const INITIAL_STACK: u32 = 0x00ff_fdc0;

const BLOCK_DIM: usize = 0x0;
const GRID_DIM: usize = 0xc;
const SHARED_WINDOW: usize = 0x18;
const LOCAL_WINDOW: usize = 0x20;
const STACK: usize = 0x28;

/// Writes the driver words of cbank0 for one launch into `out` (at least [`DRIVER_BYTES`] long, words
/// not listed here must already be zero).
pub fn write_driver_words(
    out: &mut [u32],
    block: [u32; 3],
    grid: [u32; 3],
    shared_window: u64,
    local_window: u64,
) {
    let w = |byte: usize| byte / 4;
    out[w(BLOCK_DIM)..w(BLOCK_DIM) + 3].copy_from_slice(&block);
    out[w(GRID_DIM)..w(GRID_DIM) + 3].copy_from_slice(&grid);
    out[w(SHARED_WINDOW)] = shared_window as u32;
    out[w(SHARED_WINDOW) + 1] = (shared_window >> 32) as u32;
    out[w(LOCAL_WINDOW)] = local_window as u32;
    out[w(LOCAL_WINDOW) + 1] = (local_window >> 32) as u32;
    out[w(STACK)] = INITIAL_STACK;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_words_libcuda_uploads() {
        let mut cb = [0u32; DRIVER_BYTES / 4];
        write_driver_words(
            &mut cb,
            [32, 1, 1],
            [2, 1, 1],
            0x7fef_0000_0000,
            0x7fee_b500_0000,
        );
        // From research/hopper-launch-raw/cbank0_table.txt for add<<<2,32>>>.
        assert_eq!(&cb[0..6], &[32, 1, 1, 2, 1, 1]);
        assert_eq!(&cb[6..8], &[0, 0x7fef]);
        assert_eq!(&cb[8..10], &[0xb500_0000, 0x7fee]);
        assert_eq!(cb[10], 0x00ff_fdc0);
        assert_eq!(
            cb[0x208 / 4],
            0,
            "c[0x0][0x208] is read as a 64-bit zero before every global access"
        );
    }
}
