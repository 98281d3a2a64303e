//! What earlier runs of the same program tell the takeover policy (`APEX_PRELOAD_HISTORY`, on by default).
//!
//! The `earned` policy ([`crate::takeover`]) cannot know, at a program's first launch, whether the program will make
//! enough launches to pay for its takeover, so it pays with launches on libcuda first: a program that would have
//! paid it back many times over still spends its first thousands of launches on libcuda. The same program run
//! again (the same executable with the same arguments) makes about as many launches as it did before. So each run
//! leaves a record at exit — how many launches it made, what its takeover cost or would have cost, what a launch
//! through APEX saved — and a run whose last runs (up to [`KEPT`]) each made enough launches to pay for the takeover
//! from the first launch on is "advised": each context is attached at its first launch (with the inline set-up, the
//! default, that launch goes through APEX; with `APEX_PRELOAD_SETUP=background` the launches go to libcuda while the
//! attach is made), and further streams of the context still pay for their queues with their own launches. A run
//! that goes differently is recorded too: one short run is enough to stop the advice for the next. The launches
//! counted are those a takeover could serve (refused ones pay for nothing). A run that ends without its exit
//! handlers (killed by a signal, `_exit`, `exec`) or a forked child leaves no record; of runs that end at the same
//! moment (a job's ranks, which share a command line and so a record) one may overwrite the other's, and the runs kept
//! are the last processes, not the last jobs.
//!
//! The record lives in the cache directory of APEX ([`apex::module::cache::cache_root`]: `$APEX_CACHE_DIR`, else
//! `$XDG_CACHE_HOME/apex`, else `~/.cache/apex`), in `runs/<key>`, where the key is a hash of the executable's path
//! and the command line (`/proc/self/cmdline`); it holds the executable's path and numbers, no arguments. A record
//! that does not read as one, or names another executable, is ignored and replaced. `APEX_PRELOAD_HISTORY=0` (or
//! `APEX_CACHE_DISABLE=1`) neither reads nor writes records.

use std::fmt::Write as _;
use std::fs;
use std::io::{Read as _, Write as _};
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

/// Runs kept in a record: advice needs each of them to have paid for the takeover.
pub(crate) const KEPT: usize = 3;

/// The first line of a record (the format's version).
const MAGIC: &str = "apex-preload run record 1";

/// The largest record read (a record is under 200 bytes).
const MAX_RECORD: u64 = 4096;

/// Records kept: a new one beyond this many removes the least recently written (a program run with ever-changing
/// arguments leaves one per command line).
const MAX_RECORDS: usize = 512;

/// A temporary file of a process that died between writing and renaming it is removed after this long.
const STALE_TMP: Duration = Duration::from_secs(3600);

/// What the last runs of a program did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Record {
    /// The executable (`/proc/self/exe`), checked against the running one's.
    pub(crate) exe: String,
    /// The launches each run made, most recent first, at most [`KEPT`].
    pub(crate) launches: Vec<u64>,
    /// What the takeover cost (or, in a run that was not taken over, would have cost), nanoseconds: attaching to
    /// the context and loading the modules its kernels came from, without what CUDA's own loading of them took (as
    /// the `earned` policy prices it; freeing APEX's objects at exit is left out of both).
    pub(crate) price_ns: u64,
    /// What a launch through APEX saved, nanoseconds (libcuda's launch, timed in a run, less the hook's).
    pub(crate) saved_ns: u64,
}

impl Record {
    /// Reads a record's text; `None` for anything else.
    pub(crate) fn parse(text: &str) -> Option<Record> {
        let mut lines = text.lines();
        if lines.next()? != MAGIC {
            return None;
        }
        let (mut exe, mut launches, mut price_ns, mut saved_ns) = (None, None, None, None);
        for line in lines {
            let (key, value) = line.split_once(' ')?;
            match key {
                "exe" => exe = Some(value.to_string()),
                "launches" => {
                    let v: Option<Vec<u64>> = value.split(' ').map(|n| n.parse().ok()).collect();
                    launches = Some(v?);
                }
                "price_ns" => price_ns = Some(value.parse().ok()?),
                "saved_ns" => saved_ns = Some(value.parse().ok()?),
                _ => {}
            }
        }
        let launches: Vec<u64> = launches?;
        if launches.is_empty() || launches.len() > KEPT {
            return None;
        }
        Some(Record {
            exe: exe?,
            launches,
            price_ns: price_ns?,
            saved_ns: saved_ns?,
        })
    }

    /// The record as text ([`Record::parse`] reads it back).
    pub(crate) fn render(&self) -> String {
        let mut s = String::with_capacity(160);
        let launches: Vec<String> = self.launches.iter().map(u64::to_string).collect();
        let _ = write!(
            s,
            "{MAGIC}\nexe {}\nlaunches {}\nprice_ns {}\nsaved_ns {}\n",
            self.exe,
            launches.join(" "),
            self.price_ns,
            self.saved_ns
        );
        s
    }

    /// Whether a run like the recorded ones pays for its takeover from the first launch on: each recorded run made
    /// at least as many launches as the price takes at the saving per launch.
    pub(crate) fn advises(&self) -> bool {
        let fewest = self.launches.iter().copied().min().unwrap_or(0);
        self.saved_ns > 0 && fewest.saturating_mul(self.saved_ns) >= self.price_ns
    }

    /// This record with `run` added: its launches first (the oldest dropped beyond [`KEPT`]), its price and saving
    /// where it measured them, else the record's.
    pub(crate) fn with(&self, run: &Run) -> Record {
        let mut launches = Vec::with_capacity(KEPT);
        launches.push(run.launches);
        launches.extend(self.launches.iter().copied().take(KEPT - 1));
        Record {
            exe: self.exe.clone(),
            launches,
            price_ns: run.price_ns.measured().unwrap_or(self.price_ns),
            saved_ns: run.saved_ns.unwrap_or(self.saved_ns),
        }
    }

    /// A first record, from one run.
    pub(crate) fn first(exe: String, run: &Run) -> Record {
        Record {
            exe,
            launches: vec![run.launches],
            price_ns: run.price_ns.value(),
            saved_ns: run.saved_ns.unwrap_or(crate::takeover::SAVED_PER_LAUNCH_NS),
        }
    }
}

/// A run's price: paid (the takeover was made and timed) or estimated (it was not).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Price {
    Paid(u64),
    Estimated(u64),
}

impl Price {
    fn measured(self) -> Option<u64> {
        match self {
            Price::Paid(ns) => Some(ns),
            Price::Estimated(_) => None,
        }
    }

    fn value(self) -> u64 {
        match self {
            Price::Paid(ns) | Price::Estimated(ns) => ns,
        }
    }
}

/// What one run did, for its record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) launches: u64,
    pub(crate) price_ns: Price,
    /// The saving per launch, where libcuda's launches were timed in this run.
    pub(crate) saved_ns: Option<u64>,
}

/// The running program's record: where it lives, what it said at start.
#[derive(Debug)]
pub(crate) struct History {
    /// `None`: records are off, or there is nowhere to keep them.
    path: Option<PathBuf>,
    exe: String,
    previous: Option<Record>,
}

impl History {
    /// The running program's history, read from its record; off (`None` paths) where `APEX_PRELOAD_HISTORY` is
    /// `0`/`off`, or there is no cache directory or no command line.
    pub(crate) fn open() -> History {
        let var = |name: &str| std::env::var_os(name);
        let on = !matches!(
            std::env::var("APEX_PRELOAD_HISTORY").as_deref(),
            Ok("0" | "off" | "false")
        );
        let exe = fs::read_link("/proc/self/exe")
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        let cmdline = fs::read("/proc/self/cmdline").unwrap_or_default();
        let dir = apex::module::cache::cache_root(var).map(|d| d.join("runs"));
        History::at(on.then_some(()).and(dir), exe, &cmdline)
    }

    /// No history: nothing read or written.
    pub(crate) fn off() -> History {
        History {
            path: None,
            exe: String::new(),
            previous: None,
        }
    }

    /// The history of the program `exe` run as `cmdline`, its records kept under `dir` (`None`: off).
    pub(crate) fn at(dir: Option<PathBuf>, exe: String, cmdline: &[u8]) -> History {
        let path = dir
            .filter(|_| !exe.is_empty() && !cmdline.is_empty())
            .map(|d| d.join(format!("{:016x}", key(&exe, cmdline))));
        let previous = path.as_deref().and_then(read).filter(|r| r.exe == exe);
        History {
            path,
            exe,
            previous,
        }
    }

    /// The record as read at the start, where there was one (tests).
    #[cfg(test)]
    pub(crate) fn previous(&self) -> Option<&Record> {
        self.previous.as_ref()
    }

    /// Whether the earlier runs advise taking the program over at its first launch.
    pub(crate) fn advised(&self) -> bool {
        self.previous.as_ref().is_some_and(Record::advises)
    }

    /// What the summary says of the history.
    pub(crate) fn describe(&self) -> String {
        match (&self.path, &self.previous) {
            (None, _) => "off".into(),
            (Some(_), None) => "no earlier run recorded".into(),
            (Some(_), Some(r)) => {
                let fewest = r.launches.iter().copied().min().unwrap_or(0);
                format!(
                    "{}: the last {} run(s) made at least {fewest} launches, which at {:.1} µs saved each pay for a \
                     takeover of {:.1} ms {}",
                    if r.advises() {
                        "advised"
                    } else {
                        "not advised"
                    },
                    r.launches.len(),
                    r.saved_ns as f64 / 1e3,
                    r.price_ns as f64 / 1e6,
                    if r.advises() {
                        "from the first launch"
                    } else {
                        "only in part"
                    },
                )
            }
        }
    }

    /// Records `run` (at exit): the record is replaced whole, through a new file of this process's renamed over it,
    /// so a reader never sees half of one and concurrent runs (a job's ranks) leave one of theirs. A first record of
    /// a program makes room beyond [`MAX_RECORDS`].
    pub(crate) fn record(&self, run: &Run) -> std::io::Result<()> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        // Another run may have written since this one started: its figures are kept too.
        let now = read(path).filter(|r| r.exe == self.exe);
        let record = match now.as_ref().or(self.previous.as_ref()) {
            Some(r) => r.with(run),
            None => {
                if let Some(dir) = path.parent() {
                    make_room(dir);
                }
                Record::first(self.exe.clone(), run)
            }
        };
        write(path, record.render().as_bytes())
    }
}

/// The key of a program: FNV-1a (64 bits) of its executable's path and its command line, stable across processes.
fn key(exe: &str, cmdline: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in exe.as_bytes().iter().chain(&[0u8]).chain(cmdline) {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// The record at `path`, if there is one that reads as one: a regular file (not followed through a link; a FIFO
/// does not block the open) of at most [`MAX_RECORD`] bytes.
fn read(path: &Path) -> Option<Record> {
    let file = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .ok()?;
    let meta = file.metadata().ok()?;
    if !meta.is_file() || meta.len() > MAX_RECORD {
        return None;
    }
    let mut text = String::new();
    file.take(MAX_RECORD).read_to_string(&mut text).ok()?;
    Record::parse(&text)
}

/// Writes `bytes` to `path` through a new file beside it (created exclusively, not through a link, mode 0600, named
/// after this process and a counter), renamed over `path`; the directory is made 0700 where it is missing.
fn write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    static UNIQUE: AtomicU64 = AtomicU64::new(0);
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // The clock's nanoseconds too: processes of other PID namespaces may share the directory.
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let tmp = dir.join(format!(
        ".{name}.{}.{}.{nanos}.tmp",
        std::process::id(),
        UNIQUE.fetch_add(1, Ordering::Relaxed)
    ));
    // Created exclusively: a name taken by another process is its file, never removed here.
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&tmp)?;
    let written = f.write_all(bytes).and_then(|()| fs::rename(&tmp, path));
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written
}

/// Removes the least recently written records beyond [`MAX_RECORDS`] less one (room for a new one), and temporary
/// files older than [`STALE_TMP`]. Best effort: what cannot be read or removed stays.
fn make_room(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let now = SystemTime::now();
    let mut records = Vec::new();
    for e in entries.flatten() {
        let Ok(meta) = e.metadata() else { continue };
        if !meta.is_file() {
            continue;
        }
        let written = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
        if e.file_name().to_string_lossy().starts_with('.') {
            if now.duration_since(written).unwrap_or_default() > STALE_TMP {
                let _ = fs::remove_file(e.path());
            }
            continue;
        }
        records.push((written, e.path()));
    }
    if records.len() < MAX_RECORDS {
        return;
    }
    records.sort();
    for (_, path) in &records[..=records.len() - MAX_RECORDS] {
        let _ = fs::remove_file(path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(launches: u64, price: Price, saved: Option<u64>) -> Run {
        Run {
            launches,
            price_ns: price,
            saved_ns: saved,
        }
    }

    #[test]
    fn a_record_reads_back_and_junk_does_not() {
        let r = Record {
            exe: "/usr/bin/python3.11".into(),
            launches: vec![6198, 6210],
            price_ns: 35_000_000,
            saved_ns: 4_600,
        };
        assert_eq!(Record::parse(&r.render()), Some(r.clone()));
        for bad in [
            "",
            "apex-preload run record 2\nexe /x\nlaunches 1\nprice_ns 1\nsaved_ns 1\n",
            "apex-preload run record 1\nexe /x\nlaunches\nprice_ns 1\nsaved_ns 1\n",
            "apex-preload run record 1\nexe /x\nlaunches 1 x\nprice_ns 1\nsaved_ns 1\n",
            "apex-preload run record 1\nexe /x\nlaunches 1 2 3 4\nprice_ns 1\nsaved_ns 1\n",
            "apex-preload run record 1\nexe /x\nlaunches 1\nsaved_ns 1\n",
            "apex-preload run record 1\nexe /x\nlaunches 1\nprice_ns -1\nsaved_ns 1\n",
            "apex-preload run record 1\nlaunches 1\nprice_ns 1\nsaved_ns 1\n",
            "apex-preload run record 1\nnonsense\n",
        ] {
            assert_eq!(Record::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn advice_needs_every_kept_run_to_pay_for_the_takeover() {
        let mut r = Record {
            exe: "/p".into(),
            launches: vec![10_000, 8_000],
            price_ns: 40_000_000,
            saved_ns: 5_000,
        };
        assert!(r.advises(), "8000 launches × 5 µs = 40 ms: paid");
        r.launches.push(7_999);
        assert!(!r.advises(), "one run short of the price: no advice");
        r.saved_ns = 0;
        r.launches = vec![u64::MAX];
        assert!(!r.advises(), "no saving measured as none: no advice");
    }

    #[test]
    fn a_run_is_added_in_front_and_its_measurements_replace_the_records() {
        let r = Record {
            exe: "/p".into(),
            launches: vec![3, 2, 1],
            price_ns: 40,
            saved_ns: 5,
        };
        let paid = r.with(&run(4, Price::Paid(30), Some(6)));
        assert_eq!(paid.launches, vec![4, 3, 2], "the oldest run goes");
        assert_eq!((paid.price_ns, paid.saved_ns), (30, 6));
        // A run not taken over estimated its price, and one taken over at its first launch timed no libcuda
        // launch: the record's figures stay.
        let estimated = r.with(&run(4, Price::Estimated(99), None));
        assert_eq!((estimated.price_ns, estimated.saved_ns), (40, 5));
        let first = Record::first("/p".into(), &run(7, Price::Estimated(99), None));
        assert_eq!(first.launches, vec![7]);
        assert_eq!(first.price_ns, 99, "a first record keeps the estimate");
        assert_eq!(first.saved_ns, crate::takeover::SAVED_PER_LAUNCH_NS);
    }

    #[test]
    fn runs_of_a_program_advise_its_next_run_and_a_short_one_stops_the_advice() {
        let dir = std::env::temp_dir().join(format!("apex-history-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let open = || {
            History::at(
                Some(dir.clone()),
                "/bin/prog".into(),
                b"prog\0--steps\x00100\x00",
            )
        };
        let h = open();
        assert!(!h.advised());
        assert_eq!(h.describe(), "no earlier run recorded");
        h.record(&run(20_000, Price::Estimated(30_000_000), Some(4_000)))
            .unwrap();
        let h = open();
        assert!(h.advised(), "{}", h.describe());
        assert!(h.describe().starts_with("advised"), "{}", h.describe());
        // Another command line is another program.
        let other = History::at(
            Some(dir.clone()),
            "/bin/prog".into(),
            b"prog\0--steps\x001\x00",
        );
        assert!(!other.advised());
        // The same command line from another executable does not take the record.
        let moved = History::at(
            Some(dir.clone()),
            "/bin/other".into(),
            b"prog\0--steps\x00100\x00",
        );
        assert!(!moved.advised());
        h.record(&run(100, Price::Paid(30_000_000), None)).unwrap();
        let h = open();
        assert!(
            !h.advised(),
            "a short run stops the advice: {}",
            h.describe()
        );
        // Off: nothing read, nothing written.
        let off = History::at(None, "/bin/prog".into(), b"prog\0");
        assert_eq!(off.describe(), "off");
        off.record(&run(1, Price::Paid(1), None)).unwrap();
        // A record that is not one is replaced.
        let path = dir.join(format!(
            "{:016x}",
            key("/bin/prog", b"prog\0--steps\x00100\x00")
        ));
        fs::write(&path, b"garbage").unwrap();
        let h = open();
        assert!(!h.advised());
        h.record(&run(9, Price::Paid(1), Some(1))).unwrap();
        assert_eq!(read(&path).unwrap().launches, vec![9]);
        let leftovers: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "no temporary file left");
        fs::remove_dir_all(&dir).unwrap();
    }

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("apex-history-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_run_keeps_what_another_run_recorded_meanwhile() {
        let dir = scratch("merge");
        let open = || History::at(Some(dir.clone()), "/bin/job".into(), b"job\0--rank\0");
        let (rank0, rank1) = (open(), open());
        rank1.record(&run(500, Price::Paid(7), Some(3))).unwrap();
        rank0.record(&run(600, Price::Paid(8), None)).unwrap();
        let path = dir.join(format!("{:016x}", key("/bin/job", b"job\0--rank\0")));
        let r = read(&path).unwrap();
        assert_eq!(
            r.launches,
            vec![600, 500],
            "both ranks' runs are in the record"
        );
        assert_eq!((r.price_ns, r.saved_ns), (8, 3));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn links_and_directories_in_a_records_place_are_neither_read_nor_written_through() {
        let dir = scratch("links");
        fs::create_dir_all(&dir).unwrap();
        let target = dir.join("elsewhere");
        let good = Record {
            exe: "/bin/p".into(),
            launches: vec![1_000_000],
            price_ns: 1,
            saved_ns: 1_000,
        };
        fs::write(&target, good.render()).unwrap();
        let path = dir.join(format!("{:016x}", key("/bin/p", b"p\0")));
        std::os::unix::fs::symlink(&target, &path).unwrap();
        let h = History::at(Some(dir.clone()), "/bin/p".into(), b"p\0");
        assert!(!h.advised(), "a record behind a link is not read");
        h.record(&run(3, Price::Paid(1), None)).unwrap();
        assert_eq!(
            fs::read_to_string(&target).unwrap(),
            good.render(),
            "the link's target is untouched"
        );
        assert!(
            !fs::symlink_metadata(&path)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert_eq!(read(&path).unwrap().launches, vec![3]);
        // A directory where the record goes: nothing read, and the write fails with an error, not a panic.
        let q = dir.join(format!("{:016x}", key("/bin/q", b"q\0")));
        fs::create_dir(&q).unwrap();
        let h = History::at(Some(dir.clone()), "/bin/q".into(), b"q\0");
        assert!(!h.advised());
        assert!(h.record(&run(3, Price::Paid(1), None)).is_err());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn records_beyond_the_bound_and_stale_temporary_files_go() {
        let dir = scratch("bound");
        fs::create_dir_all(&dir).unwrap();
        let old = SystemTime::now() - Duration::from_secs(7200);
        for i in 0..MAX_RECORDS {
            let f = dir.join(format!("{i:016x}"));
            fs::write(&f, b"x").unwrap();
            // The first written is the oldest.
            fs::File::options()
                .write(true)
                .open(&f)
                .unwrap()
                .set_modified(old + Duration::from_secs(i as u64))
                .unwrap();
        }
        let stale = dir.join(".0000000000000001.99.0.tmp");
        fs::write(&stale, b"half").unwrap();
        fs::File::options()
            .write(true)
            .open(&stale)
            .unwrap()
            .set_modified(old)
            .unwrap();
        let fresh = dir.join(".0000000000000002.98.0.tmp");
        fs::write(&fresh, b"being written").unwrap();
        let h = History::at(Some(dir.clone()), "/bin/new".into(), b"new\0");
        h.record(&run(1, Price::Paid(1), None)).unwrap();
        let names: Vec<String> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        let records = names.iter().filter(|n| !n.starts_with('.')).count();
        assert_eq!(records, MAX_RECORDS, "the oldest went to make room");
        assert!(
            !names.contains(&format!("{:016x}", 0)),
            "the oldest record went"
        );
        assert!(
            !stale.exists(),
            "a temporary file left by a dead process goes"
        );
        assert!(fresh.exists(), "one being written stays");
        fs::remove_dir_all(&dir).unwrap();
    }
}
