//! Constant bank 0 as CUDA cubins for sm_90 expect it: 0x210 bytes of driver words, then the parameters at
//! the cubin's EIATTR_PARAM_CBANK offset. Only the words compiled code reads are filled (see
//! research/hopper-launch.md §6); the rest stay zero. Which those are was read from SASS: the sm_90 code of PyTorch
//! 2.11, cuDNN, NCCL, cuBLAS(Lt), cuSPARSE(Lt), cuSOLVER, cuRAND, nvcc 13 and Triton 3.6 reads 0x000-0x028, the
//! cluster words (0x140-0x164, 0x188), the parameter block's address (0x198) and 0x208, nothing else.

/// Driver words before the parameters on sm_90.
pub const DRIVER_BYTES: usize = 0x210;
/// The initial stack pointer every sm_90 kernel loads from `c[0x0][0x28]`.
pub const INITIAL_STACK: u32 = 0x00ff_fdc0;

const BLOCK_DIM: usize = 0x0;
const GRID_DIM: usize = 0xc;
const SHARED_WINDOW: usize = 0x18;
const LOCAL_WINDOW: usize = 0x20;
const STACK: usize = 0x28;
/// The grid barrier of a cooperative launch: high word at 0x44, low word at 0x48. Code that synchronizes the grid
/// (cooperative groups `grid.sync()`) reads the pair, traps when it is zero, and counts blocks in the word at
/// the address + 4 (read from the SASS nvcc 13 emits for `this_grid().sync()`).
const GRID_BARRIER_HI: usize = 0x44;
const GRID_BARRIER_LO: usize = 0x48;
/// Driver words a launch may write: up to the grid barrier's.
pub const LAUNCH_WORDS: usize = GRID_BARRIER_LO / 4 + 1;

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

/// First byte of the cluster words: `c[0x0][0x140]` to `c[0x0][0x188]`.
pub const CLUSTER_WORDS_START: usize = 0x140;
/// Words from [`CLUSTER_WORDS_START`] through the cluster size at 0x188.
pub const CLUSTER_WORDS: usize = (0x18c - CLUSTER_WORDS_START) / 4;
/// 1 when the grid runs as thread block clusters. ptxas lowers `barrier.cluster` in a kernel without
/// `__cluster_dims__` to `c[0x0][0x140] == 1 ? cluster barrier : bar.sync` (cluster_runtime in
/// kernels/conformance/cluster.sm_90.cubin), so a run-time cluster launch must set it.
const CLUSTER_FLAG: usize = 0x140;
/// `%cluster_nctaid`: the cluster shape (1, 1, 1 without clusters: libcuda's words for every plain launch).
const CLUSTER_DIM: usize = 0x144;
/// `%nclusterid`: the grid in clusters (the grid without clusters, as libcuda writes it for plain launches).
const CLUSTER_GRID: usize = 0x15c;
/// `%cluster_nctarank`: blocks per cluster (cluster_body reads its peer count here; 1 for plain launches).
const CLUSTER_SIZE: usize = 0x188;
/// The reciprocal of each cluster dimension as an f32 (1.0 without clusters): the compiler derives `%clusterid` as
/// `trunc(f32(%ctaid) * c[0x0][0x150 + 4i])` and `%cluster_ctaid` from it (SASS of nvcc 13 for both), and libcuda
/// writes `1.0f / dim` rounded to nearest (read back from its banks for cluster shapes 1-8 on an H200, 580.159.04).
const CLUSTER_RECIPROCAL: usize = 0x150;

/// First byte of the parameter block's address range: `c[0x0][0x198]` holds its start (the bank's address +
/// [`DRIVER_BYTES`]) and `c[0x0][0x1a0]` its end, as libcuda writes them. Code that takes a `__grid_constant__`
/// parameter's address (a `CUtensorMap` handed to the tensor memory accelerator, a by-value struct indexed at run
/// time) reads the start: 624 reads in PyTorch 2.11's sm_90 code, every Triton kernel given a host tensor
/// descriptor.
pub const PARAM_BLOCK_START: usize = 0x198;
/// Words from [`PARAM_BLOCK_START`]: start and end, 64 bits each.
pub const PARAM_BLOCK_WORDS: usize = 4;

/// The words at [`PARAM_BLOCK_START`] for a constant bank 0 at `bank_va` whose kernel takes `param_bytes` bytes of
/// parameters.
pub fn param_block_words(bank_va: u64, param_bytes: u32) -> [u32; PARAM_BLOCK_WORDS] {
    let start = bank_va + DRIVER_BYTES as u64;
    let end = start + u64::from(param_bytes);
    [
        start as u32,
        (start >> 32) as u32,
        end as u32,
        (end >> 32) as u32,
    ]
}

/// Writes the cluster words (`out` starts at [`CLUSTER_WORDS_START`], at least [`CLUSTER_WORDS`] long): the
/// cluster flag, shape, reciprocals of the shape, grid in clusters and blocks per cluster, or the words of a launch
/// without clusters. `grid` is in blocks and a multiple of `cluster` (checked before). Compiled code reads the flag,
/// the shape, the reciprocals, the grid in clusters and the size (`%cluster_nctaid`, `%clusterid`, `%nclusterid`,
/// `%cluster_nctarank` in nvcc 13's SASS). Every word written here equals libcuda's for a plain launch and for
/// cluster shapes of 1 to 8 blocks per dimension (read back from libcuda's banks by
/// `kernels/conformance/driver_words.cu`, H200, 580.159.04; `tests/gpu_driver_words.rs` compares them).
pub fn write_cluster_words(out: &mut [u32], grid: [u32; 3], cluster: Option<[u32; 3]>) {
    let w = |byte: usize| (byte - CLUSTER_WORDS_START) / 4;
    let c = cluster.unwrap_or([1, 1, 1]);
    out[w(CLUSTER_FLAG)] = u32::from(cluster.is_some());
    for i in 0..3 {
        out[w(CLUSTER_DIM) + i] = c[i];
        out[w(CLUSTER_GRID) + i] = grid[i] / c[i].max(1);
    }
    out[w(CLUSTER_SIZE)] = c[0].saturating_mul(c[1]).saturating_mul(c[2]);
    for (i, &dim) in c.iter().enumerate() {
        out[w(CLUSTER_RECIPROCAL) + i] = (1.0f32 / dim.max(1) as f32).to_bits();
    }
}

/// Writes the grid barrier's address for a cooperative launch (`None`: zero, as for every other launch).
pub fn write_grid_barrier(out: &mut [u32], barrier: Option<u64>) {
    let va = barrier.unwrap_or(0);
    out[GRID_BARRIER_HI / 4] = (va >> 32) as u32;
    out[GRID_BARRIER_LO / 4] = va as u32;
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

    #[test]
    fn cluster_words() {
        let mut cb = [0u32; DRIVER_BYTES / 4];
        let at = |byte: usize| byte / 4;
        let window = &mut cb[CLUSTER_WORDS_START / 4..][..CLUSTER_WORDS];
        // libcuda's words for add3d, grid (4, 3, 2), no cluster (cbank0_table.txt).
        write_cluster_words(window, [4, 3, 2], None);
        assert_eq!(cb[at(0x140)], 0);
        assert_eq!(&cb[at(0x144)..at(0x150)], &[1, 1, 1]);
        assert_eq!(&cb[at(0x15c)..at(0x168)], &[4, 3, 2]);
        assert_eq!(cb[at(0x188)], 1);
        assert_eq!(
            &cb[at(0x150)..at(0x15c)],
            &[0x3f80_0000; 3],
            "1.0 without clusters"
        );
        // cluster_runtime with clusters of 4 over 12 blocks: cluster.sync() takes the cluster barrier, and the
        // kernel counts 4 peers.
        let window = &mut cb[CLUSTER_WORDS_START / 4..][..CLUSTER_WORDS];
        write_cluster_words(window, [12, 1, 1], Some([4, 1, 1]));
        assert_eq!(cb[at(0x140)], 1);
        assert_eq!(&cb[at(0x144)..at(0x150)], &[4, 1, 1]);
        assert_eq!(&cb[at(0x15c)..at(0x168)], &[3, 1, 1]);
        assert_eq!(cb[at(0x188)], 4);
        // The reciprocals the compiler scales %ctaid by, as libcuda writes them (read back from its banks).
        assert_eq!(
            &cb[at(0x150)..at(0x15c)],
            &[0x3e80_0000, 0x3f80_0000, 0x3f80_0000]
        );
        // Nothing else between them is touched (libcuda's other words there are not written by APEX).
        assert!(cb[at(0x168)..at(0x188)].iter().all(|&w| w == 0));
    }

    /// libcuda's words for cluster shapes read back from its banks (`kernels/conformance/driver_words.cu`'s
    /// `bank_words`, H200, 580.159.04): the reciprocals round to nearest, which truncates every `%ctaid` of a
    /// grid of up to 2^16 clusters to its cluster.
    #[test]
    fn cluster_reciprocals_match_libcuda() {
        let seen: [([u32; 3], [u32; 3]); 6] = [
            ([3, 2, 1], [0x3eaa_aaab, 0x3f00_0000, 0x3f80_0000]),
            ([5, 1, 1], [0x3e4c_cccd, 0x3f80_0000, 0x3f80_0000]),
            ([6, 1, 1], [0x3e2a_aaab, 0x3f80_0000, 0x3f80_0000]),
            ([7, 1, 1], [0x3e12_4925, 0x3f80_0000, 0x3f80_0000]),
            ([1, 5, 1], [0x3f80_0000, 0x3e4c_cccd, 0x3f80_0000]),
            ([2, 2, 2], [0x3f00_0000; 3]),
        ];
        for (c, want) in seen {
            let mut cb = [0u32; CLUSTER_WORDS];
            let grid = [c[0] * 4, c[1] * 2, c[2]];
            write_cluster_words(&mut cb, grid, Some(c));
            let at = (0x150 - CLUSTER_WORDS_START) / 4;
            assert_eq!(&cb[at..at + 3], &want, "cluster {c:?}");
        }
        for dim in 1..=16u32 {
            let mut cb = [0u32; CLUSTER_WORDS];
            write_cluster_words(&mut cb, [dim, 1, 1], Some([dim, 1, 1]));
            let r = f32::from_bits(cb[(0x150 - CLUSTER_WORDS_START) / 4]);
            for ctaid in 0..(dim << 16) {
                assert_eq!(
                    (ctaid as f32 * r) as u32,
                    ctaid / dim,
                    "ctaid {ctaid} in clusters of {dim}"
                );
            }
        }
    }

    /// The parameter block's start and end as libcuda wrote them for `bank_words` (48 bytes of parameters) with its
    /// bank at 0x7fb7_1228_0000.
    #[test]
    fn param_block_words_match_libcuda() {
        assert_eq!(
            param_block_words(0x7fb7_1228_0000, 0x30),
            [0x1228_0210, 0x7fb7, 0x1228_0240, 0x7fb7]
        );
        assert_eq!(
            param_block_words(0x7fee_ae29_0000, 0),
            [0xae29_0210, 0x7fee, 0xae29_0210, 0x7fee],
            "no parameters (empty in research/hopper-launch-raw/cbank0_table.txt)"
        );
    }
}
