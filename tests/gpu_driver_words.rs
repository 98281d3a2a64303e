//! Constant bank 0's driver words on a GPU, APEX's against libcuda's in one process (run with `--include-ignored` on
//! an NVIDIA GPU with libcuda): every word sm_90 code was seen to read (the launch shape, the cluster words and the
//! reciprocals `%clusterid` is derived with, the parameter block's address a grid constant's address is taken from),
//! and what kernels compute from them. A binary of its own: a test that kills libcuda's context elsewhere would
//! leave no driver backend to compare with.

use std::time::Duration;

use apex::{Arg, Backend, Gpu, LaunchConfig};

#[path = "support/gpu.rs"]
mod support_gpu;

const DRIVER_WORDS: &[u8] = include_bytes!("../kernels/conformance/driver_words.sm_90.cubin");
const T: Duration = Duration::from_secs(20);

fn gpu(b: Backend) -> Gpu {
    support_gpu::open(b)
}

fn words(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|w| u32::from_le_bytes(w.try_into().unwrap()))
        .collect()
}

/// The launch shapes the driver-word comparison runs: a plain launch, then clusters of every size from 1 to 8 in
/// each dimension (the reciprocals of 3, 5, 6 and 7 are not exact).
const WORD_SHAPES: [([u32; 3], Option<[u32; 3]>); 9] = [
    ([4, 3, 2], None),
    ([8, 1, 1], Some([1, 1, 1])),
    ([8, 1, 1], Some([2, 1, 1])),
    ([6, 4, 1], Some([3, 2, 1])),
    ([3, 10, 1], Some([1, 5, 1])),
    ([12, 1, 1], Some([6, 1, 1])),
    ([2, 2, 14], Some([1, 1, 7])),
    ([4, 4, 4], Some([2, 2, 2])),
    ([16, 2, 1], Some([8, 1, 1])),
];

/// What one backend's launches of `driver_words.sm_90.cubin` give for `shape`.
struct Seen {
    /// Block 0's constant bank 0 through its parameters, read through the parameter block's address.
    bank: Vec<u32>,
    /// That address, as the kernel took it.
    param_address: u64,
    /// The output buffers' addresses (the kernel's second and third parameters).
    out: [u64; 2],
    /// Every block's cluster special registers.
    registers: Vec<u32>,
}

/// The bytes of parameters `bank_words` takes: a 32-byte struct, two pointers, two words.
const BANK_WORDS_PARAMS: usize = 56;

fn driver_words_of(g: &Gpu, shape: ([u32; 3], Option<[u32; 3]>)) -> Seen {
    let (grid, cluster) = shape;
    let mut q = g.queue().unwrap();
    let m = g.load_module(DRIVER_WORDS).unwrap();
    let blocks = (grid[0] * grid[1] * grid[2]) as usize;
    let cfg = {
        let c = LaunchConfig::linear(1, 32).with_grid(grid);
        match cluster {
            Some(c3) => c.with_cluster(c3),
            None => c,
        }
    };
    let count = (0x210 + BANK_WORDS_PARAMS) / 4;
    let out = g.alloc((blocks * count * 4) as u64).unwrap();
    let addr = g.alloc(8).unwrap();
    let tag: Vec<u8> = (1..=4u64).flat_map(|v| v.to_le_bytes()).collect();
    let bank = m.kernel("bank_words").unwrap();
    // SAFETY: `out` holds `count` words per block, `addr` one address; the tag is the kernel's 32-byte struct.
    unsafe {
        q.launch(
            &bank,
            &cfg,
            &[
                Arg::Bytes(&tag),
                out.arg(),
                addr.arg(),
                Arg::U32(0),
                Arg::U32(count as u32),
            ],
        )
    }
    .unwrap()
    .wait(T)
    .unwrap();
    let mut bytes = vec![0u8; count * 4];
    q.download(g, &out, 0, &mut bytes).unwrap();
    let bank_words = words(&bytes);
    let mut a = [0u8; 8];
    q.download(g, &addr, 0, &mut a).unwrap();
    let regs = m.kernel("cluster_registers").unwrap();
    // SAFETY: `out` holds 12 words per block.
    unsafe { q.launch(&regs, &cfg, &[out.arg()]) }
        .unwrap()
        .wait(T)
        .unwrap();
    let mut bytes = vec![0u8; blocks * 12 * 4];
    q.download(g, &out, 0, &mut bytes).unwrap();
    Seen {
        bank: bank_words,
        param_address: u64::from_le_bytes(a),
        out: [out.device_ptr(), addr.device_ptr()],
        registers: words(&bytes),
    }
}

/// Every driver word sm_90 code was seen to read (PyTorch 2.11's whole sm_90 SASS, cuDNN, NCCL, cuBLAS, nvcc 13,
/// Triton 3.6) holds on APEX what libcuda writes there, for plain and cluster launches, and the cluster special
/// registers derived from them agree block by block. The parameter block's address is each backend's own (the banks
/// lie in different places): the kernel takes its grid constant's address from it and reads its bank through it,
/// so the bank must show that same address at 0x198, the block's end 56 bytes (the kernel's parameters) after it,
/// and this launch's own parameters at 0x210.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn driver_words_code_reads_match_libcuda() {
    let direct = gpu(Backend::Direct);
    let driver = gpu(Backend::Driver);
    // Launch shape and the initial stack; the cluster flag, shape, reciprocals, grid in clusters and size. The
    // shared and local windows (0x18-0x24) are each backend's own.
    let compared: Vec<usize> = [0x0, 0x4, 0x8, 0xc, 0x10, 0x14, 0x28]
        .into_iter()
        .chain((0x140..0x168).step_by(4))
        .chain([0x188])
        .collect();
    for shape in WORD_SHAPES {
        let apex = driver_words_of(&direct, shape);
        let cuda = driver_words_of(&driver, shape);
        for &at in &compared {
            assert_eq!(
                apex.bank[at / 4],
                cuda.bank[at / 4],
                "c[0x0][{at:#x}] for {shape:?}"
            );
        }
        for (who, seen) in [("APEX", &apex), ("libcuda", &cuda)] {
            let w = &seen.bank;
            let w64 = |at: usize| u64::from(w[at / 4]) | (u64::from(w[at / 4 + 1]) << 32);
            assert_eq!(w64(0x198), seen.param_address, "{who} {shape:?}");
            assert_eq!(
                w64(0x1a0) - w64(0x198),
                BANK_WORDS_PARAMS as u64,
                "{who} {shape:?}"
            );
            let params: Vec<u64> = (0..6).map(|i| w64(0x210 + 8 * i)).collect();
            assert_eq!(
                params,
                [1, 2, 3, 4, seen.out[0], seen.out[1]],
                "{who} {shape:?}"
            );
        }
        assert_eq!(
            apex.registers, cuda.registers,
            "cluster registers for {shape:?}"
        );
    }
}

/// A grid constant read through its address (the parameter block's, from `c[0x0][0x198]`) gives the value passed,
/// on both backends.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn grid_constants_read_through_their_address() {
    let words = [3u64, 5, 7, 11];
    let tag: Vec<u8> = words.iter().flat_map(|v| v.to_le_bytes()).collect();
    let n = 9;
    let expected: Vec<u64> = (0..64)
        .map(|t| {
            (0..n).fold(0u64, |s, i| {
                s.wrapping_mul(31).wrapping_add(words[(i + t) % 4])
            })
        })
        .collect();
    for b in [Backend::Direct, Backend::Driver] {
        let g = gpu(b);
        let mut q = g.queue().unwrap();
        let m = g.load_module(DRIVER_WORDS).unwrap();
        let k = m.kernel("grid_constant_sum").unwrap();
        let out = g.alloc(64 * 8).unwrap();
        // SAFETY: `out` holds one u64 per thread of the one block; the tag is the kernel's 32-byte struct.
        unsafe {
            q.launch(
                &k,
                &LaunchConfig::linear(1, 64),
                &[Arg::Bytes(&tag), out.arg(), Arg::I32(n as i32)],
            )
        }
        .unwrap()
        .wait(T)
        .unwrap();
        let mut bytes = vec![0u8; 64 * 8];
        q.download(&g, &out, 0, &mut bytes).unwrap();
        let got: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, expected, "{b:?}");
    }
}
