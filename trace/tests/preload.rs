//! The built cdylib preloaded into programs that do not use CUDA: they run unharmed, with
//! identical output, and nothing is traced.

use std::path::PathBuf;
use std::process::{Command, Output};

/// `libapex_trace.so` next to this test binary (target/<profile>/deps) or one level up.
pub fn cdylib() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().expect("test binary has a directory");
    [
        dir.join("libapex_trace.so"),
        dir.join("../libapex_trace.so"),
    ]
    .into_iter()
    .find(|p| p.exists())
    .unwrap_or_else(|| panic!("libapex_trace.so not found next to {}", exe.display()))
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().expect("program runs")
}

#[test]
fn true_and_echo_run_unharmed() {
    let lib = cdylib();
    let trace = std::env::temp_dir().join(format!("apex-trace-ci-{}.jsonl", std::process::id()));
    for (prog, args) in [("/bin/true", vec![]), ("/bin/echo", vec!["hello", "world"])] {
        if !std::path::Path::new(prog).exists() {
            continue;
        }
        let plain = run(Command::new(prog).args(&args));
        let traced = run(Command::new(prog)
            .args(&args)
            .env("LD_PRELOAD", &lib)
            .env("APEX_TRACE_FILE", &trace));
        assert!(traced.status.success(), "{prog}: {traced:?}");
        assert_eq!(plain.stdout, traced.stdout, "{prog}");
        assert_eq!(plain.stderr, traced.stderr, "{prog}");
        // No NVIDIA node touched: the tracer never started, no file, no summary.
        assert!(!trace.exists(), "{prog} produced a trace file");
    }
}

/// In the child: a fake ioctl on /dev/null, an mmap and an munmap, through the hooked symbols.
#[test]
fn child_fake_ioctl() {
    if std::env::var_os("APEX_TRACE_CHILD").is_none() {
        return;
    }
    let f = std::fs::File::open("/dev/null").unwrap();
    use std::os::fd::AsRawFd;
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), libc::FIONREAD, &mut n) };
    let e = std::io::Error::last_os_error().raw_os_error();
    // SAFETY: an anonymous private mapping, unmapped right after.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    // SAFETY: unmaps the mapping made above.
    let u = unsafe { libc::munmap(p, 4096) };
    println!("CHILD ioctl={r} n={n} errno={e:?} munmap={u}");
}

#[test]
fn fake_ioctl_program_is_unaffected() {
    let lib = cdylib();
    let exe = std::env::current_exe().unwrap();
    let child = |preload: bool| {
        let mut c = Command::new(&exe);
        c.args([
            "--exact",
            "child_fake_ioctl",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("APEX_TRACE_CHILD", "1");
        if preload {
            c.env("LD_PRELOAD", &lib);
        }
        let out = run(&mut c);
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.find("CHILD ").map(|i| l[i..].to_string()))
            .collect::<Vec<_>>()
    };
    let plain = child(false);
    assert_eq!(plain.len(), 1, "{plain:?}");
    assert_eq!(plain, child(true));
}
