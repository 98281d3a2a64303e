//! The module cache: what a large zstd-compressed fatbin payload costs to get, decompressed (every process without
//! the cache) against read back from the cache (every process after the first). Runs on the CPU alone.
//!
//! The payload is synthetic (the repository holds no large compressed fatbin): 8 MiB of cubin-like 16-byte
//! instruction words (a small set of opcodes with varying register and immediate fields), compressed with zstd
//! level 19; it prints its compression ratio (PyTorch's cubins compress 5-11 times). Group `module_cache/8MiB`:
//! - `zstd_decompress`: `fatbin::payload_with` through a disabled cache;
//! - `cache_hit`: the same call through a cache holding the entry (open, map, the mark its first full check left
//!   in this boot, the copy into a `Vec` this call returns, mtime refresh);
//! - `cache_miss_and_store`: the first process's cost, a lookup that misses, the decompression, and the entry
//!   written (no fsync) and renamed into place.

use std::hint::black_box;
use std::time::Duration;

use apex::ModuleCache;
use apex::module::fatbin::{self, Compression, FatbinEntry, FatbinEntryKind, Origin};
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};

const BYTES: usize = 8 << 20;

/// Cubin-like code: 16-byte words from 16 opcodes and 8 registers, an immediate in one word of 16, fields from a
/// small LCG.
fn code() -> Vec<u8> {
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        state >> 33
    };
    let mut out = Vec::with_capacity(BYTES);
    while out.len() < BYTES {
        let r = next();
        let opcode = 0x7000 + (r & 15) as u16 * 0x10;
        let reg = |shift: u32| ((r >> shift) & 7) as u8;
        let imm = if r & 0xf00 == 0 {
            (next() & 0xffff) as u32
        } else {
            0
        };
        out.extend_from_slice(&opcode.to_le_bytes());
        out.extend_from_slice(&[reg(6), reg(11), reg(16), 0xff]);
        out.extend_from_slice(&imm.to_le_bytes());
        out.extend_from_slice(&[0x00, 0x0f, 0x00, 0x00, 0xe2, 0x0f]);
    }
    out.truncate(BYTES);
    out
}

fn benches(c: &mut Criterion) {
    let code = code();
    let stored = zstd::bulk::compress(&code, 19).expect("zstd");
    eprintln!(
        "module_cache: {} bytes of code, {} compressed (ratio {:.1})",
        code.len(),
        stored.len(),
        code.len() as f64 / stored.len() as f64
    );
    let entry = FatbinEntry {
        kind: FatbinEntryKind::Cubin,
        sm: 90,
        arch_specific: false,
        origin: Origin::Fatbin,
        container: 0,
        compressed: true,
        compression: Some(Compression::Zstd),
        flags: fatbin::flags::ADDRESS_64 | fatbin::flags::LINUX | fatbin::flags::COMPRESSED_ZSTD,
        payload_offset: 0,
        payload_size: stored.len(),
        uncompressed_size: code.len() as u64,
    };
    let dir = tempfile::tempdir().expect("temporary directory");
    let off = ModuleCache::disabled();
    let on = ModuleCache::at(dir.path().join("hit"), 1 << 30);
    assert_eq!(fatbin::payload_with(&stored, &entry, &on).unwrap(), code);
    assert_eq!(fatbin::payload_with(&stored, &entry, &on).unwrap(), code);
    assert_eq!(on.stats().hits, 1, "the second call hits");

    let mut g = c.benchmark_group("module_cache/8MiB");
    g.throughput(Throughput::Bytes(code.len() as u64));
    g.bench_function("zstd_decompress", |b| {
        b.iter(|| fatbin::payload_with(black_box(&stored), &entry, &off).unwrap())
    });
    g.bench_function("cache_hit", |b| {
        b.iter(|| fatbin::payload_with(black_box(&stored), &entry, &on).unwrap())
    });
    let miss_dir = dir.path().join("miss");
    let fresh = ModuleCache::at(&miss_dir, 1 << 30);
    g.bench_function("cache_miss_and_store", |b| {
        b.iter_batched(
            || {
                let _ = std::fs::remove_dir_all(&miss_dir);
            },
            |()| fatbin::payload_with(black_box(&stored), &entry, &fresh).unwrap(),
            BatchSize::PerIteration,
        )
    });
    g.finish();
    assert!(fresh.stats().writes > 0 && fresh.stats().hits == 0);
}

criterion_group! {
    name = module_cache;
    config = Criterion::default().sample_size(30).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(3));
    targets = benches
}
criterion_main!(module_cache);
