//! The process-wide module cache through the loader's own calls: a fatbin whose cubin entry is zstd-compressed
//! (and one LZ4-compressed), read by `fatbin::payload` and `select::select_cubin` twice, and by
//! `image::cubin_for_device` (which parses the cubin where the cache holds it); the second read is a hit with the same
//! bytes. Its own test binary: the process-wide cache is fixed once per process.

use apex::module::fatbin::{self, Compression, flags};
use apex::module::{image, select};
use apex::{ModuleCache, errors::ModuleCacheAlreadySet, module_cache, set_module_cache};

/// A fatbin of one sm_90 cubin entry holding `stored`, which decompresses to `size` bytes.
fn one_entry_fatbin(stored: &[u8], size: usize, compression: u64) -> Vec<u8> {
    let padded = stored.len().next_multiple_of(8);
    let mut entry = vec![0u8; 64];
    entry[0..2].copy_from_slice(&2u16.to_le_bytes()); // ELF
    entry[2..4].copy_from_slice(&0x0101u16.to_le_bytes());
    entry[4..8].copy_from_slice(&64u32.to_le_bytes());
    entry[8..16].copy_from_slice(&(padded as u64).to_le_bytes());
    entry[0x10..0x14].copy_from_slice(&(stored.len() as u32).to_le_bytes());
    entry[0x18..0x1c].copy_from_slice(&[0, 0, 8, 0]); // code version 8.0
    entry[0x1c..0x20].copy_from_slice(&90u32.to_le_bytes());
    let entry_flags = flags::ADDRESS_64 | flags::LINUX | compression;
    entry[0x28..0x30].copy_from_slice(&entry_flags.to_le_bytes());
    entry[0x38..0x40].copy_from_slice(&(size as u64).to_le_bytes());
    entry.extend_from_slice(stored);
    entry.resize(64 + padded, 0);
    let mut out = Vec::new();
    out.extend_from_slice(&fatbin::FATBIN_MAGIC.to_le_bytes());
    out.extend_from_slice(&1u16.to_le_bytes());
    out.extend_from_slice(&16u16.to_le_bytes());
    out.extend_from_slice(&(entry.len() as u64).to_le_bytes());
    out.extend_from_slice(&entry);
    out
}

#[test]
fn a_second_load_reads_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    set_module_cache(ModuleCache::at(dir.path().join("modules"), 64 << 20)).unwrap();
    assert_eq!(
        set_module_cache(ModuleCache::disabled()),
        Err(ModuleCacheAlreadySet)
    );
    let cache = module_cache();
    assert_eq!(cache.dir(), Some(dir.path().join("modules").as_path()));

    // Real cubin bytes, repeated past the cache's threshold (~300 KiB).
    let cubin: &[u8] = include_bytes!("../kernels/apex_test_kernels.sm_90.cubin");
    let code = cubin.repeat(8);
    // With a checksum, so that the corrupt frame below fails to decode rather than decoding to other bytes.
    let mut compressor = zstd::bulk::Compressor::new(19).unwrap();
    compressor.include_checksum(true).unwrap();
    let zstd = one_entry_fatbin(
        &compressor.compress(&code).unwrap(),
        code.len(),
        flags::COMPRESSED_ZSTD,
    );
    let entries = fatbin::entries(&zstd).unwrap();
    assert_eq!(entries[0].compression, Some(Compression::Zstd));

    assert_eq!(fatbin::payload(&zstd, &entries[0]).unwrap(), code);
    let s = cache.stats();
    assert_eq!((s.hits, s.misses, s.writes), (0, 1, 1));
    assert_eq!(fatbin::payload(&zstd, &entries[0]).unwrap(), code);
    assert_eq!(select::select_cubin(&zstd, 90).unwrap(), code);
    let s = cache.stats();
    assert_eq!((s.hits, s.misses, s.writes), (2, 1, 1));
    assert_eq!(s.bytes_read, 2 * code.len() as u64);

    // LZ4 (`--compress-mode=speed`): a key of its own.
    let lz4 = one_entry_fatbin(
        &lz4_flex::block::compress(&code),
        code.len(),
        flags::COMPRESSED_LZ4,
    );
    let entries = fatbin::entries(&lz4).unwrap();
    assert_eq!(fatbin::payload(&lz4, &entries[0]).unwrap(), code);
    assert_eq!(fatbin::payload(&lz4, &entries[0]).unwrap(), code);
    let s = cache.stats();
    assert_eq!((s.hits, s.misses, s.writes), (3, 2, 2));

    // A corrupt stored payload is another key: it misses and fails as without the cache, storing nothing.
    let mut bad = zstd.clone();
    let last = bad.len() - 20;
    bad[last] ^= 0x55;
    let entries = fatbin::entries(&bad).unwrap();
    assert!(fatbin::payload(&bad, &entries[0]).is_err());
    assert!(fatbin::payload(&bad, &entries[0]).is_err());
    let s = cache.stats();
    assert_eq!((s.hits, s.misses, s.writes), (3, 4, 2));

    // The loader's own path: the cubin is parsed where it lies, and a hit (mapped on a local filesystem) gives
    // the bytes a miss gave. Another compression level is another key: first a miss, then a hit.
    let jit = apex::module::jit::Jit::system();
    let other = one_entry_fatbin(
        &zstd::bulk::compress(&code, 3).unwrap(),
        code.len(),
        flags::COMPRESSED_ZSTD,
    );
    let missed = image::cubin_for_device(&other, 90, jit).unwrap();
    assert_eq!(&missed[..], &code[..]);
    let s = cache.stats();
    assert_eq!((s.hits, s.misses, s.writes), (3, 5, 3));
    let hit = image::cubin_for_device(&other, 90, jit).unwrap();
    assert_eq!(&hit[..], &code[..]);
    let s = cache.stats();
    assert_eq!((s.hits, s.misses, s.writes), (4, 5, 3));
}
