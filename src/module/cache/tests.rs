use std::sync::Barrier;

use super::*;

/// `n` bytes that differ with `seed`.
fn content(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
}

/// One lookup of `stored` stating `bytes.len()`, decompressing to `bytes`; says whether it decompressed.
fn get(cache: &ModuleCache, stored: &[u8], bytes: &[u8]) -> (Vec<u8>, bool) {
    let mut ran = false;
    let out = cache
        .get_or_insert_with(stored, "zstd", Some(bytes.len()), || {
            ran = true;
            Ok::<_, ()>(bytes.to_vec())
        })
        .unwrap();
    (out, ran)
}

/// The files in `dir`, sorted.
fn files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Whether entries in `dir` can be marked: this machine has a boot id and the filesystem gives birth times (ext4,
/// xfs, btrfs, recent tmpfs). Where not, every hit is hashed, and the tests of marks check that instead.
/// CI sets `APEX_REQUIRE_CACHE_MARKS=1`: there, a machine without them fails the tests instead of skipping them.
fn marks_here(dir: &Path) -> bool {
    let probe = tempfile::tempfile_in(dir).unwrap();
    let here = checked::boot_id().is_some() && checked::Identity::of(&probe, 0).is_some();
    assert!(
        here || std::env::var_os("APEX_REQUIRE_CACHE_MARKS")
            .is_none_or(|v| v.is_empty() || v == "0"),
        "APEX_REQUIRE_CACHE_MARKS is set, but this machine has no boot id or {} no birth times",
        dir.display()
    );
    here
}

/// The names an entry leaves in its directory after a hit: the entry, and its mark where marks are made.
fn entry_and_mark(dir: &Path, name: &str) -> Vec<String> {
    let mut names = vec![name.to_owned()];
    if marks_here(dir) {
        names.push(format!("{name}{}", checked::MARK_SUFFIX));
    }
    names
}

/// Whether a test of marks has nothing to test in `dir` (see [`marks_here`]); says so.
fn skip_without_marks(dir: &Path) -> bool {
    let skip = !marks_here(dir);
    if skip {
        eprintln!(
            "no boot id or no birth times in {}: marks are not made, so not tested",
            dir.display()
        );
    }
    skip
}

fn entry_path(cache: &ModuleCache, stored: &[u8], len: usize) -> PathBuf {
    let key = Key::new(stored, "zstd", Some(len));
    cache.dir().unwrap().join(key.file_name())
}

#[test]
fn hit_returns_the_same_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = ModuleCache::at(tmp.path().join("a/b"), 64 << 20);
    let bytes = content(MIN_BYTES + 5, 1);
    assert_eq!(get(&cache, b"stored", &bytes), (bytes.clone(), true));
    assert_eq!(
        cache.stats(),
        ModuleCacheStats {
            misses: 1,
            writes: 1,
            ..Default::default()
        }
    );
    assert_eq!(get(&cache, b"stored", &bytes), (bytes.clone(), false));
    let stats = cache.stats();
    assert_eq!((stats.hits, stats.bytes_read), (1, bytes.len() as u64));
    // Another cache on the same directory (another process) hits too.
    let other = ModuleCache::at(tmp.path().join("a/b"), 64 << 20);
    assert_eq!(get(&other, b"stored", &bytes), (bytes.clone(), false));
    // The entry, and the mark its first hit left (the content hashed in full in this boot).
    let name = Key::new(b"stored", "zstd", Some(bytes.len())).file_name();
    assert_eq!(
        files(cache.dir().unwrap()),
        entry_and_mark(cache.dir().unwrap(), &name)
    );
    let mode = |p: &Path| {
        use std::os::unix::fs::PermissionsExt;
        fs::metadata(p).unwrap().permissions().mode() & 0o777
    };
    assert_eq!(mode(cache.dir().unwrap()), 0o700);
    assert_eq!(mode(&entry_path(&cache, b"stored", bytes.len())), 0o600);
}

#[test]
fn other_inputs_miss() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = ModuleCache::at(tmp.path(), 64 << 20);
    let bytes = content(MIN_BYTES, 2);
    get(&cache, b"stored", &bytes);
    assert!(get(&cache, b"stored!", &bytes).1, "other stored bytes");
    let mut ran = false;
    let out = cache
        .get_or_insert_with(b"stored", "lz4", Some(bytes.len()), || {
            ran = true;
            Ok::<_, ()>(bytes.clone())
        })
        .unwrap();
    assert!(ran && out == bytes, "another algorithm");
    // Another stated size: the entry's length would not match it anyway, but it is another key.
    let longer = content(MIN_BYTES + 1, 2);
    assert!(get(&cache, b"stored", &longer).1, "another stated size");
    assert_eq!(cache.stats().misses, 4);
    assert_eq!(cache.stats().hits, 0);
}

#[test]
fn keys_separate_fields() {
    let k = |stored: &[u8], alg: &str, stated| Key::new(stored, alg, stated).hash;
    let base = k(b"abc", "zstd", Some(1));
    assert_eq!(base, k(b"abc", "zstd", Some(1)));
    for other in [
        k(b"abd", "zstd", Some(1)),
        k(b"abc", "lz4", Some(1)),
        k(b"abc", "zstd", Some(2)),
        k(b"abc", "zstd", None),
        k(b"bc", "zstda", Some(1)),
    ] {
        assert_ne!(base, other);
    }
}

#[test]
fn corrupt_entries_are_replaced() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = ModuleCache::at(tmp.path(), 64 << 20);
    let bytes = content(MIN_BYTES + 100, 3);
    get(&cache, b"stored", &bytes);
    let path = entry_path(&cache, b"stored", bytes.len());
    let good = fs::read(&path).unwrap();
    let flipped = |at: usize| {
        let mut b = good.clone();
        b[at] ^= 1;
        b
    };
    let corruptions = [
        flipped(good.len() - 1),         // content
        flipped(HEADER),                 // content, first byte
        flipped(0),                      // magic
        flipped(8),                      // version
        flipped(16),                     // key
        flipped(32),                     // length
        flipped(40),                     // content hash
        good[..good.len() - 1].to_vec(), // truncated content
        good[..HEADER - 1].to_vec(),     // truncated header
        Vec::new(),                      // empty
        [&good[..], b"x"].concat(),      // trailing bytes
    ];
    for (i, bad) in corruptions.into_iter().enumerate() {
        fs::write(&path, &bad).unwrap();
        let (out, ran) = get(&cache, b"stored", &bytes);
        assert!(ran, "corruption {i} read as a hit");
        assert_eq!(out, bytes, "corruption {i}");
        assert_eq!(
            fs::read(&path).unwrap(),
            good,
            "corruption {i}: entry rewritten"
        );
    }
    assert_eq!(cache.stats().hits, 0);
    // A directory where the entry should be: an IO error, not a failed load.
    fs::remove_file(&path).unwrap();
    fs::create_dir(&path).unwrap();
    assert_eq!(get(&cache, b"stored", &bytes), (bytes.clone(), true));
}

#[test]
fn decompress_errors_pass_through_and_store_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = ModuleCache::at(tmp.path(), 64 << 20);
    let r = cache.get_or_insert_with(b"bad", "zstd", Some(MIN_BYTES), || Err("broken frame"));
    assert_eq!(r, Err("broken frame"));
    assert!(files(tmp.path()).is_empty());
    assert_eq!(cache.stats().writes, 0);
}

#[test]
fn disabled_never_touches_disk() {
    let tmp = tempfile::tempdir().unwrap();
    let bytes = content(MIN_BYTES, 4);
    for cache in [
        ModuleCache::disabled(),
        ModuleCache::at(tmp.path().join("never"), 0),
    ] {
        assert_eq!(cache.dir(), None);
        assert!(get(&cache, b"stored", &bytes).1);
        assert!(get(&cache, b"stored", &bytes).1);
        assert_eq!(cache.stats(), ModuleCacheStats::default());
    }
    assert!(files(tmp.path()).is_empty());
}

#[test]
fn small_payloads_bypass() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = ModuleCache::at(tmp.path().join("c"), 64 << 20);
    let small = content(MIN_BYTES - 1, 5);
    assert!(get(&cache, b"stored", &small).1);
    assert!(get(&cache, b"stored", &small).1);
    // Stating no size, small compressed: bypassed; larger compressed but decoding small: looked up, not stored.
    let none = |stored: &[u8], out: &[u8]| {
        cache
            .get_or_insert_with(stored, "lz4", None, || Ok::<_, ()>(out.to_vec()))
            .unwrap()
    };
    none(b"small", &content(MIN_BYTES, 5));
    let stored = content(MIN_BYTES / 4, 6);
    none(&stored, &small);
    assert_eq!(cache.stats().misses, 1);
    assert_eq!(cache.stats().writes, 0);
    assert!(!tmp.path().join("c").exists(), "nothing written");
    // Stating no size, decoding large: stored and hit.
    let big = content(MIN_BYTES, 7);
    assert_eq!(none(&stored, &big), big);
    assert_eq!(none(&stored, b"not this"), big);
    assert_eq!(cache.stats().hits, 1);
}

#[test]
fn eviction_keeps_under_the_cap_oldest_first() {
    let tmp = tempfile::tempdir().unwrap();
    let entry = MIN_BYTES + 1000;
    // Room for 10 entries.
    let cap = ((HEADER + entry) * 10 + 100) as u64;
    let cache = ModuleCache::at(tmp.path(), cap);
    let dir = cache.dir().unwrap().to_owned();
    let stored = |i: usize| format!("payload {i}").into_bytes();
    let base = SystemTime::now() - Duration::from_secs(10_000);
    for i in 0..10 {
        get(&cache, &stored(i), &content(entry, i as u8));
        // Entry i last used at base + i s; entry 3 used most recently of all.
        let age = if i == 3 { 100 } else { i as u64 };
        File::options()
            .write(true)
            .open(entry_path(&cache, &stored(i), entry))
            .unwrap()
            .set_modified(base + Duration::from_secs(age))
            .unwrap();
    }
    // A stale temporary file from a crashed writer, and a file that is not an entry.
    let stale = dir.join(".dead.1.1.tmp");
    File::create(&stale).unwrap().set_modified(base).unwrap();
    fs::write(dir.join("README"), b"not an entry").unwrap();
    assert_eq!(files(&dir).len(), 12);
    // The eleventh entry passes the cap: down to 90%, oldest first (0, 1), entry 3 and the new one kept.
    get(&cache, &stored(10), &content(entry, 10));
    let total: u64 = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert!(total <= cap / 10 * 9 + 20, "{total} > 90% of {cap}");
    let left: Vec<bool> = (0..=10)
        .map(|i| entry_path(&cache, &stored(i), entry).exists())
        .collect();
    assert_eq!(
        left,
        [
            false, false, true, true, true, true, true, true, true, true, true
        ]
    );
    assert!(!stale.exists());
    assert!(dir.join("README").exists());
    // A payload larger than 90% of the cap is not stored at all.
    let small_cap = ModuleCache::at(tmp.path().join("small"), MIN_BYTES as u64);
    assert!(get(&small_cap, b"x", &content(MIN_BYTES, 1)).1);
    assert!(get(&small_cap, b"x", &content(MIN_BYTES, 1)).1);
    assert_eq!(small_cap.stats().writes, 0);
}

#[test]
fn a_hit_refreshes_the_entry_s_time() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = ModuleCache::at(tmp.path(), 64 << 20);
    let bytes = content(MIN_BYTES, 8);
    get(&cache, b"s", &bytes);
    let path = entry_path(&cache, b"s", bytes.len());
    let old = SystemTime::now() - Duration::from_secs(1000);
    File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(old)
        .unwrap();
    assert!(!get(&cache, b"s", &bytes).1);
    assert!(fs::metadata(&path).unwrap().modified().unwrap() > old + Duration::from_secs(500));
}

#[test]
fn concurrent_writers_leave_one_complete_entry() {
    let tmp = tempfile::tempdir().unwrap();
    let bytes = content(4 << 20, 9);
    let threads = 8;
    let barrier = Barrier::new(threads);
    // One cache per thread, as separate processes would have: every thread misses and writes.
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let cache = ModuleCache::at(tmp.path(), 64 << 20);
                barrier.wait();
                let (out, _) = get(&cache, b"same", &bytes);
                assert_eq!(out, bytes);
            });
        }
    });
    // One entry, and at most its mark (threads that found the entry written marked it): nothing half written.
    let name = Key::new(b"same", "zstd", Some(bytes.len())).file_name();
    let names = files(tmp.path());
    assert!(
        names == [name.clone()] || names == entry_and_mark(tmp.path(), &name),
        "{names:?}"
    );
    let cache = ModuleCache::at(tmp.path(), 64 << 20);
    assert_eq!(get(&cache, b"same", &bytes), (bytes.clone(), false));
    // And one shared cache hammered by readers and writers.
    let shared = ModuleCache::at(tmp.path().join("shared"), 64 << 20);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                for _ in 0..4 {
                    assert_eq!(get(&shared, b"same", &bytes).0, bytes);
                }
            });
        }
    });
    let stats = shared.stats();
    assert_eq!(stats.hits + stats.misses, 4 * threads as u64);
    let names = files(shared.dir().unwrap());
    assert_eq!(names, entry_and_mark(shared.dir().unwrap(), &name));
}

#[test]
fn configuration_from_the_environment() {
    let env = |vars: &'static [(&'static str, &'static str)]| {
        move |name: &str| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| OsString::from(v))
        }
    };
    let home = &[("HOME", "/h")];
    assert_eq!(
        configure(env(home)),
        (Some("/h/.cache/apex/modules".into()), DEFAULT_MAX_BYTES)
    );
    assert_eq!(
        configure(env(&[("HOME", "/h"), ("XDG_CACHE_HOME", "/x")])).0,
        Some("/x/apex/modules".into())
    );
    assert_eq!(
        configure(env(&[
            ("HOME", "/h"),
            (DIR_ENV, "/c"),
            (MAXSIZE_ENV, "1000")
        ])),
        (Some("/c/modules".into()), 1000)
    );
    assert_eq!(configure(env(&[("HOME", "/h"), (DIR_ENV, "")])).0, None);
    assert_eq!(configure(env(&[])).0, None, "no HOME, no XDG: off");
    assert_eq!(
        configure(env(&[("HOME", "/h"), (DISABLE_ENV, "1")])).0,
        None
    );
    assert!(
        configure(env(&[("HOME", "/h"), (DISABLE_ENV, "0")]))
            .0
            .is_some()
    );
    assert_eq!(
        configure(env(&[("HOME", "/h"), (MAXSIZE_ENV, "0")])).0,
        None
    );
    assert_eq!(
        configure(env(&[("HOME", "/h"), (MAXSIZE_ENV, "lots")])),
        (Some("/h/.cache/apex/modules".into()), DEFAULT_MAX_BYTES),
        "unreadable cap: the default"
    );
}

#[test]
fn a_hit_is_mapped_and_keeps_its_bytes_when_the_entry_is_removed() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = ModuleCache::at(tmp.path(), 64 << 20);
    let bytes = content(MIN_BYTES * 3 + 17, 9);
    let lookup = |cache: &ModuleCache| {
        cache
            .get_or_insert_payload(b"mapped", "zstd", Some(bytes.len()), || {
                Ok::<_, ()>(bytes.clone())
            })
            .unwrap()
    };
    let first = lookup(&cache);
    assert!(
        !first.is_mapped(),
        "a miss hands back what was decompressed"
    );
    let hit = lookup(&cache);
    assert!(hit.is_mapped());
    assert_eq!(&hit[..], &bytes[..]);
    // Eviction unlinks: a mapping made before stays whole.
    fs::remove_file(entry_path(&cache, b"mapped", bytes.len())).unwrap();
    assert_eq!(&hit[..], &bytes[..]);
    assert_eq!(hit.into_vec(), bytes);
    assert_eq!(cache.stats().hits, 1);
}

// ---- marks: a hit hashed in full once per boot ----

const BOOT_A: checked::BootId = checked::BootId([0xa; 16]);
const BOOT_B: checked::BootId = checked::BootId([0xb; 16]);

/// The check a read of the entry for (`stored`, `bytes`) made, in boot `boot`.
fn read_check(
    cache: &ModuleCache,
    stored: &[u8],
    bytes: &[u8],
    boot: Option<checked::BootId>,
) -> Check {
    let key = Key::new(stored, "zstd", Some(bytes.len()));
    match read_entry(&entry_path(cache, stored, bytes.len()), &key, || boot) {
        Ok((got, check)) => {
            assert!(
                got.is_mapped(),
                "the temporary directory is on a local filesystem"
            );
            assert!(&got[..] == bytes, "a hit's bytes");
            check
        }
        Err(Miss::Absent) => panic!("no entry"),
        Err(Miss::Io(e)) => panic!("{e}"),
        Err(Miss::Corrupt(what)) => panic!("corrupt: {what}"),
    }
}

#[test]
fn a_hit_is_hashed_in_full_once_per_boot() {
    let tmp = tempfile::tempdir().unwrap();
    if skip_without_marks(tmp.path()) {
        return;
    }
    let cache = ModuleCache::at(tmp.path(), 64 << 20);
    let bytes = content(MIN_BYTES + 77, 4);
    get(&cache, b"m", &bytes);
    let entry = entry_path(&cache, b"m", bytes.len());
    let mark = checked::mark_path(&entry);
    assert!(
        !mark.exists(),
        "a write leaves no mark: only a full check does"
    );
    assert_eq!(read_check(&cache, b"m", &bytes, Some(BOOT_A)), Check::Full);
    assert!(mark.exists());
    assert_eq!(
        read_check(&cache, b"m", &bytes, Some(BOOT_A)),
        Check::Marked
    );
    assert_eq!(
        read_check(&cache, b"m", &bytes, Some(BOOT_A)),
        Check::Marked
    );
    // Another boot hashes in full again, and its mark replaces the old one.
    assert_eq!(read_check(&cache, b"m", &bytes, Some(BOOT_B)), Check::Full);
    assert_eq!(
        read_check(&cache, b"m", &bytes, Some(BOOT_B)),
        Check::Marked
    );
    assert_eq!(read_check(&cache, b"m", &bytes, Some(BOOT_A)), Check::Full);
    // No boot id: every read hashes.
    assert_eq!(read_check(&cache, b"m", &bytes, None), Check::Full);
    assert_eq!(read_check(&cache, b"m", &bytes, None), Check::Full);
}

#[test]
fn a_mark_never_stands_for_other_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    if skip_without_marks(tmp.path()) {
        return;
    }
    let cache = ModuleCache::at(tmp.path(), 64 << 20);
    let bytes = content(MIN_BYTES + 9, 6);
    get(&cache, b"n", &bytes);
    let entry = entry_path(&cache, b"n", bytes.len());
    let mark = checked::mark_path(&entry);
    assert_eq!(read_check(&cache, b"n", &bytes, Some(BOOT_A)), Check::Full);
    let good_mark = fs::read(&mark).unwrap();
    // A mark torn, flipped, lengthened or emptied is no mark.
    let mut flipped = good_mark.clone();
    flipped[30] ^= 1;
    for bad in [
        good_mark[..good_mark.len() - 1].to_vec(),
        flipped,
        [&good_mark[..], b"x"].concat(),
        Vec::new(),
    ] {
        fs::write(&mark, &bad).unwrap();
        assert_eq!(read_check(&cache, b"n", &bytes, Some(BOOT_A)), Check::Full);
        assert_eq!(
            fs::read(&mark).unwrap(),
            good_mark,
            "the full check marked it again"
        );
    }
    // The entry removed and another file with torn content put in its place, as a restore of the directory (tar,
    // rsync) would: the freed inode number is usually the new file's (ext4 hands it out again at once), but not its
    // birth time, so the mark of the old file does not vouch for it and the torn content is caught.
    let mut torn = fs::read(&entry).unwrap();
    let last = torn.len() - 1;
    torn[last] ^= 0x80;
    fs::remove_file(&entry).unwrap();
    let aside = tmp.path().join("aside");
    fs::write(&aside, &torn).unwrap();
    fs::rename(&aside, &entry).unwrap();
    fs::write(&mark, &good_mark).unwrap();
    let key = Key::new(b"n", "zstd", Some(bytes.len()));
    assert!(matches!(
        read_entry(&entry, &key, || Some(BOOT_A)),
        Err(Miss::Corrupt("content hash mismatch"))
    ));
    // Through the cache: the torn entry and its mark are removed, the payload decompressed and stored again.
    assert_eq!(get(&cache, b"n", &bytes), (bytes.clone(), true));
    assert!(!mark.exists());
    assert_eq!(get(&cache, b"n", &bytes), (bytes.clone(), false));
}

#[test]
fn eviction_takes_marks_with_their_entries() {
    let tmp = tempfile::tempdir().unwrap();
    if skip_without_marks(tmp.path()) {
        return;
    }
    let entry = MIN_BYTES + 1000;
    // Room for 3 entries.
    let cap = ((HEADER + entry) * 3 + 100) as u64;
    let cache = ModuleCache::at(tmp.path(), cap);
    let dir = cache.dir().unwrap().to_owned();
    let stored = |i: usize| format!("payload {i}").into_bytes();
    let base = SystemTime::now() - Duration::from_secs(10_000);
    for i in 0..3 {
        let bytes = content(entry, i as u8);
        get(&cache, &stored(i), &bytes);
        assert_eq!(
            read_check(&cache, &stored(i), &bytes, Some(BOOT_A)),
            Check::Full
        );
        File::options()
            .write(true)
            .open(entry_path(&cache, &stored(i), entry))
            .unwrap()
            .set_modified(base + Duration::from_secs(i as u64))
            .unwrap();
    }
    // A mark whose entry is gone (evicted by a process that left it).
    let orphan = dir.join(format!("{:032x}{SUFFIX}{}", 7u128, checked::MARK_SUFFIX));
    fs::write(&orphan, b"old").unwrap();
    // The fourth entry passes the cap: the oldest go (down to 90%), each with its mark; the orphan mark goes too.
    get(&cache, &stored(3), &content(entry, 3));
    assert!(!entry_path(&cache, &stored(0), entry).exists());
    assert!(!orphan.exists());
    let kept: Vec<(bool, bool)> = (0..3)
        .map(|i| {
            let path = entry_path(&cache, &stored(i), entry);
            (path.exists(), checked::mark_path(&path).exists())
        })
        .collect();
    assert!(
        kept.iter().all(|(e, m)| e == m),
        "a mark without its entry, or the reverse: {kept:?}"
    );
    assert!(kept[2].0, "the newest of the three is kept");
}

#[test]
fn boot_ids_parse_from_the_kernel_s_text() {
    let id = checked::BootId::parse("0123abcd-4567-89ef-0123-456789abcdef\n").unwrap();
    assert_eq!(id.0[..4], [0x01, 0x23, 0xab, 0xcd]);
    assert_eq!(id.0[15], 0xef);
    assert_eq!(
        checked::BootId::parse("0123ABCD456789EF0123456789ABCDEF"),
        Some(id)
    );
    for bad in [
        "",
        "0123",
        "0123abcd-4567-89ef-0123-456789abcdeg",
        "0123abcd-4567-89ef-0123-456789abcdef00",
    ] {
        assert_eq!(checked::BootId::parse(bad), None, "{bad}");
    }
    // This machine's, where /proc has it (Linux CI does).
    if Path::new("/proc/sys/kernel/random/boot_id").exists() {
        assert!(checked::boot_id().is_some());
    }
}

/// A marked entry is not hashed again in the same boot: a byte changed in place (which APEX never does) is served
/// until the next boot hashes the entry in full. This is the limit SECURITY.md states.
#[test]
fn a_marked_entry_is_not_hashed_again_until_the_next_boot() {
    let tmp = tempfile::tempdir().unwrap();
    if skip_without_marks(tmp.path()) {
        return;
    }
    let cache = ModuleCache::at(tmp.path(), 64 << 20);
    let bytes = content(MIN_BYTES + 300, 2);
    get(&cache, b"p", &bytes);
    assert_eq!(read_check(&cache, b"p", &bytes, Some(BOOT_A)), Check::Full);
    let entry = entry_path(&cache, b"p", bytes.len());
    let mut f = File::options().write(true).open(&entry).unwrap();
    use std::io::{Seek, SeekFrom};
    f.seek(SeekFrom::Start((HEADER + 1000) as u64)).unwrap();
    f.write_all(&[bytes[1000] ^ 0xff]).unwrap();
    drop(f);
    let key = Key::new(b"p", "zstd", Some(bytes.len()));
    let (got, check) = match read_entry(&entry, &key, || Some(BOOT_A)) {
        Ok(hit) => hit,
        Err(_) => panic!("the marked entry was hashed"),
    };
    assert_eq!((check, got[1000]), (Check::Marked, bytes[1000] ^ 0xff));
    assert!(matches!(
        read_entry(&entry, &key, || Some(BOOT_B)),
        Err(Miss::Corrupt("content hash mismatch"))
    ));
}

/// A mark that cannot be written (its name taken by a directory, as a read-only directory or a full disk would
/// refuse it) costs nothing but the hash at every hit.
#[test]
fn a_mark_that_cannot_be_written_leaves_the_hit_as_it_was() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = ModuleCache::at(tmp.path(), 64 << 20);
    let bytes = content(MIN_BYTES + 3, 12);
    get(&cache, b"q", &bytes);
    fs::create_dir(checked::mark_path(&entry_path(&cache, b"q", bytes.len()))).unwrap();
    for _ in 0..2 {
        assert_eq!(read_check(&cache, b"q", &bytes, Some(BOOT_A)), Check::Full);
    }
    assert_eq!(get(&cache, b"q", &bytes), (bytes.clone(), false));
    assert!(
        files(cache.dir().unwrap())
            .iter()
            .all(|n| !n.ends_with(".tmp")),
        "no temporary file left"
    );
}
