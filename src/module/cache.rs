//! A persistent, content-addressed cache of decompressed fatbin payloads, so that a module's zstd or LZ4 code is
//! decompressed once per machine rather than once per process (PyTorch's modules decompress at about 1 ms per MB,
//! ~100 ms a process), as CUDA's compute cache keeps JIT output.
//!
//! Where: `$APEX_CACHE_DIR/modules` (`APEX_CACHE_DIR` empty: no cache), else `$XDG_CACHE_HOME/apex/modules`, else
//! `$HOME/.cache/apex/modules`; none of them: no cache. `APEX_CACHE_DISABLE=1` turns it (and the JIT cache) off;
//! `APEX_CACHE_MAXSIZE` caps it in bytes (0: off; default 2 GiB). The environment is read once per process, unless
//! [`set_module_cache`] fixed the cache first.
//!
//! An entry is named by an XXH3-128 hash of the stored (compressed) bytes, the algorithm, the size the entry states
//! and [`FORMAT_VERSION`]; it holds a header (magic, version, that hash, length, XXH3-64 of the content) and the
//! decompressed bytes. The header and the file's length are checked on every read, the content hash at an entry's
//! first read after each boot: later reads in the same boot find a mark that check left (`<entry>.ok`, naming the
//! boot, the file, its birth time and the hash), so a warm load maps the entry without reading all of it. Entries on
//! network filesystems, entries whose map failed, and every hit where the boot id or the file's birth time cannot be
//! read are hashed at every read. Anything wrong (a missing, short, corrupt or unreadable file, a full
//! disk) is logged at debug level and the payload is decompressed as if there were no cache: the cache can make a
//! load faster, never fail it or change its bytes. Entries are written to a temporary file and renamed into place,
//! so concurrent processes and readers never see half of one; past the cap, the least recently used go first. On a
//! local filesystem a hit is mapped ([`Payload`]), not read: nothing rewrites an entry in place, and eviction
//! unlinks, which leaves a mapping intact (an entry evicted while a process maps it keeps its disk space until that
//! process unmaps it, so the directory can hold more than the cap meanwhile). On a network or FUSE filesystem hits
//! are read, so that a failing read is a miss rather than a fault.

use std::ffi::OsString;
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use tracing::{debug, warn};

use super::payload::Payload;

mod checked;

/// Names the directory of APEX's caches (empty: none); module payloads go under `modules/` in it.
pub const DIR_ENV: &str = "APEX_CACHE_DIR";
/// Set to `1` (anything but `0` or empty), turns APEX's on-disk caches off.
pub const DISABLE_ENV: &str = "APEX_CACHE_DISABLE";
/// The module cache's cap in bytes; `0` turns it off.
pub const MAXSIZE_ENV: &str = "APEX_CACHE_MAXSIZE";
/// The cap when [`MAXSIZE_ENV`] does not set one: 2 GiB.
pub const DEFAULT_MAX_BYTES: u64 = 2 << 30;
/// Payloads that decompress to fewer bytes are not cached: they decode in less time than a file takes to open.
pub const MIN_BYTES: usize = 256 << 10;
/// Part of every key and header: a new format (or a decoder whose output could differ) misses the old entries.
pub const FORMAT_VERSION: u32 = 1;

const MAGIC: &[u8; 8] = b"APEXMODC";
/// Magic, version, reserved, key, length, content hash.
const HEADER: usize = 8 + 4 + 4 + 16 + 8 + 8;
const SUFFIX: &str = ".payload";
/// No entry is read past this, whatever its header says: fatbin payloads stop there (`fatbin::MAX_PAYLOAD`).
const MAX_ENTRY: u64 = 256 << 20;
/// Temporary files older than this are left by a process that died mid-write; eviction removes them.
const STALE_TMP: Duration = Duration::from_secs(3600);

/// The cache of decompressed module payloads, on disk or off. Thread-safe; every process sharing the directory
/// shares the entries.
///
/// ```
/// use apex::ModuleCache;
///
/// # fn main() -> std::io::Result<()> {
/// let dir = tempfile::tempdir()?;
/// let cache = ModuleCache::at(dir.path(), 64 << 20);
/// let stored = b"a compressed payload";
/// let code = vec![0x5a_u8; 1 << 20]; // what it decompresses to
/// let decompress = || Ok::<_, std::io::Error>(code.clone());
/// let first = cache.get_or_insert_with(stored, "zstd", Some(code.len()), decompress)?;
/// // Any later call, in this process or another, reads the file instead of decompressing.
/// let never = || -> std::io::Result<Vec<u8>> { unreachable!("a hit") };
/// let again = cache.get_or_insert_with(stored, "zstd", Some(code.len()), never)?;
/// assert_eq!((&first, &again), (&code, &code));
/// let stats = cache.stats();
/// assert_eq!((stats.misses, stats.writes, stats.hits), (1, 1, 1));
/// # Ok(())
/// # }
/// ```
///
/// The process-wide cache, which module loads use, comes from the environment ([`ModuleCache::from_env`]) unless
/// [`set_module_cache`] sets another first.
#[derive(Debug)]
pub struct ModuleCache {
    dir: Option<PathBuf>,
    max_bytes: u64,
    hits: AtomicU64,
    misses: AtomicU64,
    writes: AtomicU64,
    bytes_read: AtomicU64,
}

/// What a [`ModuleCache`] has done since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModuleCacheStats {
    /// Payloads read from the cache.
    pub hits: u64,
    /// Payloads looked up and not found (or found unsound), then decompressed.
    pub misses: u64,
    /// Entries written.
    pub writes: u64,
    /// Bytes of payload read from the cache.
    pub bytes_read: u64,
}

/// [`set_module_cache`] came after the process-wide cache was fixed (set, or used by a module load).
#[derive(thiserror::Error, Debug, Clone, Copy, PartialEq, Eq)]
#[error(
    "the process-wide module cache is already fixed (set before, or used by a module load): call set_module_cache first"
)]
pub struct ModuleCacheAlreadySet;

static PROCESS_CACHE: OnceLock<ModuleCache> = OnceLock::new();

/// The process-wide module cache that module loads use: the one [`set_module_cache`] set, else
/// [`ModuleCache::from_env`] (read on first use).
pub fn module_cache() -> &'static ModuleCache {
    PROCESS_CACHE.get_or_init(ModuleCache::from_env)
}

/// Makes `cache` the process-wide module cache, in place of the environment's. Must come before the first module
/// load that decompresses (or [`module_cache`] call), else [`ModuleCacheAlreadySet`].
pub fn set_module_cache(cache: ModuleCache) -> Result<(), ModuleCacheAlreadySet> {
    PROCESS_CACHE.set(cache).map_err(|_| ModuleCacheAlreadySet)
}

/// The directory of APEX's on-disk caches given environment variables read through `var`: none if
/// `APEX_CACHE_DISABLE` is set (not `0`); `APEX_CACHE_DIR` (empty: none); else `$XDG_CACHE_HOME/apex`; else
/// `$HOME/.cache/apex`; else none.
pub fn cache_root(var: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    if var(DISABLE_ENV).is_some_and(|v| !v.is_empty() && v != "0") {
        return None;
    }
    let set = |name: &str| var(name).filter(|v| !v.is_empty());
    if let Some(dir) = var(DIR_ENV) {
        return (!dir.is_empty()).then(|| PathBuf::from(dir));
    }
    if let Some(xdg) = set("XDG_CACHE_HOME") {
        return Some(PathBuf::from(xdg).join("apex"));
    }
    set("HOME").map(|home| PathBuf::from(home).join(".cache").join("apex"))
}

/// An entry's identity: what decompresses to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key {
    hash: u128,
    /// The size the payload states it decompresses to, if it does.
    stated: Option<usize>,
}

impl Key {
    fn new(stored: &[u8], algorithm: &str, stated: Option<usize>) -> Key {
        let mut h = twox_hash::XxHash3_128::new();
        h.write(&FORMAT_VERSION.to_le_bytes());
        // Lengths first, so no two different field splits hash the same bytes.
        h.write(&(algorithm.len() as u64).to_le_bytes());
        h.write(algorithm.as_bytes());
        h.write(&stated.map_or(u64::MAX, |s| s as u64).to_le_bytes());
        h.write(&(stored.len() as u64).to_le_bytes());
        h.write(stored);
        Key {
            hash: h.finish_128(),
            stated,
        }
    }

    fn file_name(&self) -> String {
        format!("{:032x}{SUFFIX}", self.hash)
    }
}

/// Why a lookup found nothing usable.
enum Miss {
    /// No entry.
    Absent,
    /// An entry that could not be read; left in place.
    Io(io::Error),
    /// An entry that does not check out; removed.
    Corrupt(&'static str),
}

impl ModuleCache {
    /// A cache in `dir` (created, with its parents, mode 0700, on the first write) holding at most `max_bytes`
    /// (0: no cache).
    pub fn at(dir: impl Into<PathBuf>, max_bytes: u64) -> ModuleCache {
        let dir = (max_bytes > 0).then(|| dir.into());
        ModuleCache::new(dir, max_bytes)
    }

    /// No cache: every payload is decompressed, nothing touches the disk.
    pub fn disabled() -> ModuleCache {
        ModuleCache::new(None, 0)
    }

    /// The cache the environment describes (see the module's documentation): `modules/` under [`cache_root`],
    /// capped at `APEX_CACHE_MAXSIZE` bytes (default [`DEFAULT_MAX_BYTES`]).
    pub fn from_env() -> ModuleCache {
        let (dir, max_bytes) = configure(|name| std::env::var_os(name));
        debug!(dir = ?dir, max_bytes, "module cache");
        ModuleCache::new(dir, max_bytes)
    }

    fn new(dir: Option<PathBuf>, max_bytes: u64) -> ModuleCache {
        ModuleCache {
            dir,
            max_bytes,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            bytes_read: AtomicU64::new(0),
        }
    }

    /// The directory, if caching.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The cap on the directory's size in bytes.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Hits, misses, writes and bytes read so far.
    pub fn stats(&self) -> ModuleCacheStats {
        ModuleCacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
            bytes_read: self.bytes_read.load(Ordering::Relaxed),
        }
    }

    /// The decompressed form of `stored` (compressed with `algorithm`, stating it decompresses to `stated` bytes):
    /// from the cache when it holds a sound entry, else `decompress()`'s result, stored when it succeeds. Payloads
    /// stating fewer than [`MIN_BYTES`] bytes (or, stating none, smaller than a quarter of that compressed) go
    /// straight to `decompress`. A hit has exactly the bytes `decompress` gave for the same input; errors are
    /// `decompress`'s alone.
    pub fn get_or_insert_with<E>(
        &self,
        stored: &[u8],
        algorithm: &str,
        stated: Option<usize>,
        decompress: impl FnOnce() -> Result<Vec<u8>, E>,
    ) -> Result<Vec<u8>, E> {
        self.get_or_insert_payload(stored, algorithm, stated, decompress)
            .map(Payload::into_vec)
    }

    /// As [`ModuleCache::get_or_insert_with`], a hit on a local filesystem mapped read-only instead of copied into
    /// memory of the process's own ([`Payload`]; its content is checked as a read's is, hashed at the entry's first hit
    /// in each boot).
    pub fn get_or_insert_payload<E>(
        &self,
        stored: &[u8],
        algorithm: &str,
        stated: Option<usize>,
        decompress: impl FnOnce() -> Result<Vec<u8>, E>,
    ) -> Result<Payload, E> {
        let worth = match stated {
            Some(size) => size >= MIN_BYTES,
            None => stored.len() >= MIN_BYTES / 4,
        };
        let Some(dir) = self.dir.as_deref().filter(|_| worth) else {
            return decompress().map(Payload::from);
        };
        let started = Instant::now();
        let key = Key::new(stored, algorithm, stated);
        let path = dir.join(key.file_name());
        match read_entry(&path, &key, checked::boot_id) {
            Ok((bytes, check)) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                self.bytes_read
                    .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                debug!(
                    algorithm,
                    bytes = bytes.len(),
                    micros = started.elapsed().as_micros() as u64,
                    checked = ?check,
                    "module cache hit"
                );
                return Ok(bytes);
            }
            Err(Miss::Absent) => {}
            Err(Miss::Io(e)) => {
                debug!(path = %path.display(), error = %e, "module cache entry unreadable")
            }
            Err(Miss::Corrupt(what)) => {
                debug!(path = %path.display(), what, "corrupt module cache entry removed");
                let _ = fs::remove_file(&path);
                checked::unmark(&path);
            }
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let bytes = decompress()?;
        debug!(
            algorithm,
            bytes = bytes.len(),
            micros = started.elapsed().as_micros() as u64,
            "module cache miss"
        );
        if bytes.len() >= MIN_BYTES {
            self.store(dir, &path, &key, &bytes);
        }
        Ok(bytes.into())
    }

    /// Writes `bytes` as the entry `path`, then evicts past the cap; failures are logged and dropped.
    fn store(&self, dir: &Path, path: &Path, key: &Key, bytes: &[u8]) {
        // An entry that alone fills the cap would only push everything else out; one past what a read accepts
        // would be written and removed again at every load.
        let entry_bytes = (HEADER + bytes.len()) as u64;
        if entry_bytes > self.max_bytes / 10 * 9 || bytes.len() as u64 > MAX_ENTRY {
            debug!(
                bytes = bytes.len(),
                max_bytes = self.max_bytes,
                "payload larger than the module cache: not stored"
            );
            return;
        }
        match write_entry(dir, path, key, bytes) {
            Ok(()) => {
                self.writes.fetch_add(1, Ordering::Relaxed);
                self.evict(dir, path);
            }
            Err(e) => debug!(path = %path.display(), error = %e, "module cache entry not written"),
        }
    }

    /// When the entries in `dir` hold more than the cap, removes the least recently used (by mtime, which hits
    /// refresh) until they hold at most 90% of it, `keep` (the entry just written) last of all. Also removes
    /// temporary files a crashed writer left.
    fn evict(&self, dir: &Path, keep: &Path) {
        let Ok(listing) = fs::read_dir(dir) else {
            return;
        };
        let now = SystemTime::now();
        let mut entries = Vec::new();
        let mut marks = Vec::new();
        let mut total = 0u64;
        for e in listing.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            let Ok(meta) = e.metadata() else { continue };
            if !meta.is_file() {
                continue;
            }
            let modified = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
            if name.ends_with(".tmp") {
                if now.duration_since(modified).unwrap_or_default() > STALE_TMP {
                    let _ = fs::remove_file(e.path());
                }
                continue;
            }
            if name.ends_with(SUFFIX) {
                total += meta.len();
                entries.push((modified, meta.len(), e.path()));
            } else if name.ends_with(checked::MARK_SUFFIX) {
                marks.push(e.path());
            }
        }
        // Marks whose entry is gone (evicted by another process, or by an APEX that wrote none).
        if !marks.is_empty() {
            let live: std::collections::HashSet<&Path> =
                entries.iter().map(|(_, _, path)| path.as_path()).collect();
            for mark in marks {
                if !live.contains(mark.with_extension("").as_path()) {
                    let _ = fs::remove_file(&mark);
                }
            }
        }
        if total <= self.max_bytes {
            return;
        }
        let target = self.max_bytes / 10 * 9;
        entries.sort_by_key(|(modified, _, path)| (path == keep, *modified));
        let mut removed = 0;
        for (_, len, path) in entries {
            if total <= target {
                break;
            }
            // Another process may have removed it already: either way it no longer counts.
            let _ = fs::remove_file(&path);
            checked::unmark(&path);
            total = total.saturating_sub(len);
            removed += 1;
        }
        debug!(dir = %dir.display(), removed, total, max_bytes = self.max_bytes, "module cache evicted");
    }
}

/// The cache directory and cap from environment variables read through `var`.
fn configure(var: impl Fn(&str) -> Option<OsString>) -> (Option<PathBuf>, u64) {
    let max_bytes = match var(MAXSIZE_ENV) {
        Some(v) if !v.is_empty() => match v.to_str().and_then(|s| s.trim().parse::<u64>().ok()) {
            Some(n) => n,
            None => {
                warn!(value = ?v, "{MAXSIZE_ENV} is not a number of bytes; using {DEFAULT_MAX_BYTES}");
                DEFAULT_MAX_BYTES
            }
        },
        _ => DEFAULT_MAX_BYTES,
    };
    let dir = cache_root(var)
        .filter(|_| max_bytes > 0)
        .map(|root| root.join("modules"));
    (dir, max_bytes)
}

/// How a hit's content was found sound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Check {
    /// Hashed in full.
    Full,
    /// Hashed in full earlier in this boot ([`checked`]'s mark).
    Marked,
}

/// The content of the entry at `path` for `key`, if it checks out: magic, version, key, length (the stated one, and
/// the file's), content hash. Mapped where the filesystem is local ([`super::payload::mappable`]), else read.
/// Entries are never rewritten in place (see [`write_entry`]), so a mapping keeps the bytes checked here. A mapped
/// entry marked as hashed in full in the boot `boot()` names is not hashed again; one hashed here is marked when it
/// is mapped and its filesystem gives birth times (`boot()` `None`: no marks). `boot` is asked only for an entry on a
/// local filesystem.
fn read_entry(
    path: &Path,
    key: &Key,
    boot: impl FnOnce() -> Option<checked::BootId>,
) -> Result<(Payload, Check), Miss> {
    let mut f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(Miss::Absent),
        Err(e) => return Err(Miss::Io(e)),
    };
    let file_len = f.metadata().map_err(Miss::Io)?.len();
    let mut header = [0u8; HEADER];
    match f.read_exact(&mut header) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            return Err(Miss::Corrupt("truncated header"));
        }
        Err(e) => return Err(Miss::Io(e)),
    }
    let field = |at: usize, n: usize| &header[at..at + n];
    let u64_at = |at: usize| u64::from_le_bytes(field(at, 8).try_into().unwrap_or_default());
    if field(0, 8) != MAGIC {
        return Err(Miss::Corrupt("wrong magic"));
    }
    if field(8, 4) != FORMAT_VERSION.to_le_bytes() {
        return Err(Miss::Corrupt("other format version"));
    }
    if field(16, 16) != key.hash.to_le_bytes() {
        return Err(Miss::Corrupt("another payload's entry"));
    }
    let len = u64_at(32);
    if key.stated.is_some_and(|s| s as u64 != len) || len > MAX_ENTRY {
        return Err(Miss::Corrupt("wrong length"));
    }
    if file_len != HEADER as u64 + len {
        return Err(Miss::Corrupt("file length does not match the header"));
    }
    // `len <= MAX_ENTRY` fits a usize.
    let len = len as usize;
    let local = super::payload::mappable(&f);
    // Marks only for entries on local filesystems (the mapped ones): on a network filesystem another host can replace
    // an entry behind this host's back.
    let marking = if local {
        boot().and_then(|boot| Some((boot, checked::Identity::of(&f, u64_at(40))?)))
    } else {
        None
    };
    let marked = marking
        .as_ref()
        .is_some_and(|(boot, id)| checked::is_marked(path, *boot, id));
    let mapped = if local {
        // SAFETY: `file_len` is this open file's size (fstat above). Entries are written aside and renamed into place
        // (`write_entry`), never written in place, and eviction unlinks them, which leaves a mapping intact on the
        // local filesystem `mappable` found: the mapped bytes do not change for as long as the payload lives. A
        // marked entry's pages are mapped as the loader reads them; one to be hashed has them all mapped at once.
        unsafe { Payload::map_file(&f, file_len, HEADER, len, !marked) }
            .inspect_err(|e| debug!(path = %path.display(), error = %e, "module cache entry read, not mapped"))
            .ok()
    } else {
        None
    };
    let (marked, marking) = if mapped.is_some() {
        (marked, marking)
    } else {
        // Read, not mapped: hashed, and no mark taken or made.
        (false, None)
    };
    // Not mappable (a network filesystem, or the map refused): read as a file, so an error is a miss, never a fault.
    let bytes = match mapped {
        Some(bytes) => bytes,
        None => {
            let mut bytes = Vec::with_capacity(len);
            (&mut f)
                .take(len as u64)
                .read_to_end(&mut bytes)
                .map_err(Miss::Io)?;
            if bytes.len() != len {
                return Err(Miss::Corrupt("truncated content"));
            }
            Payload::from(bytes)
        }
    };
    let check = if marked {
        Check::Marked
    } else {
        if twox_hash::XxHash3_64::oneshot(&bytes) != u64_at(40) {
            return Err(Miss::Corrupt("content hash mismatch"));
        }
        if let (Some((boot, id)), Some(dir)) = (&marking, path.parent())
            && let Err(e) = checked::mark(dir, path, *boot, id)
        {
            debug!(path = %path.display(), error = %e, "module cache entry checked, not marked");
        }
        Check::Full
    };
    // Least recently used, not least recently written, goes first: one cheap syscall per hit.
    let _ = f.set_modified(SystemTime::now());
    Ok((bytes, check))
}

/// Writes the entry for `key` to a temporary file in `dir` and renames it to `path`, so no reader sees part of it.
/// No fsync: an entry torn by a crash fails its content hash and is rewritten.
fn write_entry(dir: &Path, path: &Path, key: &Key, bytes: &[u8]) -> io::Result<()> {
    DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    let mut header = Vec::with_capacity(HEADER);
    header.extend_from_slice(MAGIC);
    header.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    header.extend_from_slice(&[0; 4]);
    header.extend_from_slice(&key.hash.to_le_bytes());
    header.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    header.extend_from_slice(&twox_hash::XxHash3_64::oneshot(bytes).to_le_bytes());
    write_aside(dir, &format!("{:032x}", key.hash), path, &[&header, bytes])
}

/// Writes `parts` to a new temporary file in `dir` (`.<stem>.<pid>.<n>.<nanos>.tmp`, mode 0600, created exclusively,
/// which eviction removes once stale) and renames it to `path`, so that no reader ever sees part of the file; the
/// temporary file is removed if anything fails. Entries and marks are both written so.
fn write_aside(dir: &Path, stem: &str, path: &Path, parts: &[&[u8]]) -> io::Result<()> {
    static UNIQUE: AtomicU64 = AtomicU64::new(0);
    // The clock's nanoseconds too: processes of other PID namespaces may share the directory (an exclusive create
    // would fail on a name another one took, never write into its file).
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let tmp = dir.join(format!(
        ".{stem}.{}.{}.{nanos}.tmp",
        std::process::id(),
        UNIQUE.fetch_add(1, Ordering::Relaxed)
    ));
    let written = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        for part in parts {
            f.write_all(part)?;
        }
        fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests;
