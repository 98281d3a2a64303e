//! `apex run` without a GPU: the built `apex` binary runs shell commands under a harmless preload (the system's
//! libc, which every program loads anyway) and, where a report is checked, the command writes the statistics the
//! preload would.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The system's libc, as a preload that changes nothing; `None` (the test says it is skipped) where none of
/// the usual paths exists.
fn libc() -> Option<&'static str> {
    let found = [
        "/lib/x86_64-linux-gnu/libc.so.6",
        "/lib64/libc.so.6",
        "/usr/lib/libc.so.6",
    ]
    .into_iter()
    .find(|p| Path::new(p).is_file());
    if found.is_none() {
        eprintln!("skipped: no libc.so.6 at the usual paths to use as a harmless preload");
    }
    found
}

/// A directory of this test's own, empty, under cargo's target directory.
fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("apex-run-{name}"));
    // It may not exist yet.
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("create the scratch directory");
    d
}

/// `apex` with the environment a developer's shell might add removed, so only what a test sets counts.
fn apex(tmp: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_apex"));
    c.env_remove("APEX_PRELOAD_STATS")
        .env_remove("APEX_PRELOAD_LIB")
        .env_remove("APEX_PRELOAD")
        .env_remove("APEX_PRELOAD_LOG")
        .env_remove("LD_PRELOAD")
        .env("TMPDIR", tmp);
    c
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A summary as the preload writes it, with a field this version of `apex` does not know.
const STATS: &str = r#"{"launches": 200, "apex": 150, "fallback": 50,
 "reasons": {"capturing": {"launches": 10, "example": "the stream is capturing a graph"},
             "device_runtime": {"launches": 40, "example": "the kernel calls vprintf"}},
 "hops_to_cuda": 3, "hops_to_apex": 4, "cpu_syncs": 0, "hops_between_queues": 1,
 "queues": 2, "modules_seen": 5, "modules_loaded": 3, "attach": "direct", "sync_on_cpu": 12}"#;

/// A shell command writing `$0` (the JSON, passed as the script's name so no quoting is needed) where the
/// preload would write its statistics.
const WRITE_STATS: &str = r#"printf '%s' "$0" > "$APEX_PRELOAD_STATS""#;

#[test]
fn the_programs_exit_status_is_passed_through() {
    let Some(libc) = libc() else { return };
    let tmp = scratch("status");
    let o = apex(&tmp)
        .args(["run", "--lib", libc, "--", "sh", "-c", "exit 3"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    let o = apex(&tmp)
        .args(["run", "--lib", libc, "--", "sh", "-c", "kill -KILL $$"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(128 + 9), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("apex run: sh was killed by signal 9"), "{e}");
    assert!(
        e.contains("killed before the preload could write them"),
        "{e}"
    );
}

#[test]
fn the_report_words_the_statistics_and_shows_unknown_fields() {
    let Some(libc) = libc() else { return };
    let tmp = scratch("report");
    let o = apex(&tmp)
        .args(["run", "--lib", libc, "--", "sh", "-c", WRITE_STATS, STATS])
        .output()
        .unwrap();
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{e}");
    assert!(o.stdout.is_empty(), "no --json, nothing on stdout");
    for line in [
        "apex run: 200 kernel launches: 150 through APEX (75.0%), 50 fell back to libcuda\n",
        "apex run:   device_runtime: 40 launches, e.g. the kernel calls vprintf\n",
        "apex run:   capturing: 10 launches, e.g. the stream is capturing a graph\n",
        "apex run: attach to the CUDA context: direct\n",
        "apex run: sync_on_cpu: 12\n",
    ] {
        assert!(e.contains(line), "missing {line:?} in:\n{e}");
    }
    let big = e.find("device_runtime: 40").unwrap();
    let small = e.find("capturing: 10").unwrap();
    assert!(big < small, "largest reason first:\n{e}");
    // The temporary statistics file (in $TMPDIR) is gone after the report.
    let left: Vec<_> = std::fs::read_dir(&tmp).unwrap().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn json_prints_the_statistics_on_stdout() {
    let Some(libc) = libc() else { return };
    let tmp = scratch("json");
    let o = apex(&tmp)
        .args([
            "run",
            "--json",
            "--lib",
            libc,
            "--",
            "sh",
            "-c",
            WRITE_STATS,
            STATS,
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let printed: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON on stdout");
    let written: serde_json::Value = serde_json::from_str(STATS).unwrap();
    assert_eq!(printed, written);
}

#[test]
fn a_missing_library_says_how_to_build_it() {
    let tmp = scratch("missing");
    let o = apex(&tmp)
        .args([
            "run",
            "--lib",
            "/nonexistent/libapex_preload.so",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(e.contains("/nonexistent/libapex_preload.so"), "{e}");
    assert!(e.contains("cargo build --release -p apex-preload"), "{e}");
    let o = apex(&tmp).args(["run", "--lib", "/x.so"]).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "no program is a usage error");
}

#[test]
fn no_statistics_is_a_sentence_not_an_error_and_a_stale_file_is_removed() {
    let Some(libc) = libc() else { return };
    let tmp = scratch("none");
    let kept = tmp.join("kept.json");
    std::fs::write(&kept, STATS).unwrap();
    let o = apex(&tmp)
        .args(["run", "--lib", libc, "--stats"])
        .arg(&kept)
        .args(["--", "true"])
        .output()
        .unwrap();
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{e}");
    assert!(
        e.contains("apex run: the program made no CUDA launch the preload saw (or the preload was not loaded)"),
        "{e}"
    );
    assert!(
        !e.contains("kernel launches"),
        "the stale file was reported:\n{e}"
    );
    assert!(!kept.exists(), "the stale statistics file was left");
    // Without --stats, the same sentence from the temporary file the preload did not write.
    let o = apex(&tmp)
        .args(["run", "--lib", libc, "--", "true"])
        .output()
        .unwrap();
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{e}");
    assert!(e.contains("made no CUDA launch the preload saw"), "{e}");
}

#[test]
fn the_stats_file_of_the_user_is_kept() {
    let Some(libc) = libc() else { return };
    let tmp = scratch("kept");
    let theirs = tmp.join("theirs.json");
    let o = apex(&tmp)
        .env("APEX_PRELOAD_STATS", &theirs)
        .args(["run", "--lib", libc, "--", "sh", "-c", WRITE_STATS, STATS])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(&theirs).unwrap(), STATS);
    let ours = tmp.join("ours.json");
    let o = apex(&tmp)
        .env("APEX_PRELOAD_STATS", &theirs)
        .args(["run", "--lib", libc, "--stats"])
        .arg(&ours)
        .args(["--", "sh", "-c", WRITE_STATS, STATS])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(
        std::fs::read_to_string(&ours).unwrap(),
        STATS,
        "--stats wins"
    );
}

#[test]
fn the_environment_reaches_the_program() {
    let Some(libc) = libc() else { return };
    let tmp = scratch("env");
    let out = tmp.join("env.txt");
    let dump = r#"printf '%s\n' "$LD_PRELOAD" "$APEX_PRELOAD" "$APEX_PRELOAD_LOG" > "$0""#;
    let o = apex(&tmp)
        .env("LD_PRELOAD", libc)
        .args([
            "run", "--off", "--log", "debug", "--lib", libc, "--", "sh", "-c", dump,
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let canonical = std::fs::canonicalize(libc).unwrap();
    assert_eq!(
        std::fs::read_to_string(&out).unwrap(),
        format!("{}:{libc}\noff\ndebug\n", canonical.display()),
        "the library goes first, before what the user preloads"
    );
}

/// A program that starts processes (torchrun, multiprocessing): each writes its own summary (`%p` in
/// `APEX_PRELOAD_STATS`), and each one that launched is reported; a launcher without launches is left out.
#[test]
fn every_process_of_a_job_is_reported() {
    let Some(libc) = libc() else { return };
    let tmp = scratch("processes");
    let script = r#"for p in 11 12; do printf '%s' "$0" > "$(echo "$APEX_PRELOAD_STATS" | sed "s/%p/$p/")"; done
printf '{"launches": 0, "apex": 0, "fallback": 0}' > "$(echo "$APEX_PRELOAD_STATS" | sed "s/%p/13/")""#;
    let o = apex(&tmp)
        .args(["run", "--lib", libc, "--", "sh", "-c", script, STATS])
        .output()
        .unwrap();
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{e}");
    assert!(
        e.contains("apex run: 2 processes made CUDA launches\n"),
        "{e}"
    );
    for line in [
        "apex run: process 11:\n",
        "apex run: process 12:\n",
        "apex run:   200 kernel launches: 150 through APEX (75.0%), 50 fell back to libcuda\n",
    ] {
        assert!(e.contains(line), "missing {line:?} in:\n{e}");
    }
    assert!(!e.contains("process 13"), "the launcher was reported:\n{e}");
    let left: Vec<_> = std::fs::read_dir(&tmp).unwrap().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    // --json: one summary per process that launched, as an array.
    let o = apex(&tmp)
        .args([
            "run", "--json", "--lib", libc, "--", "sh", "-c", script, STATS,
        ])
        .output()
        .unwrap();
    let printed: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON on stdout");
    assert_eq!(printed.as_array().map(Vec::len), Some(2), "{printed}");
}
