//! The preload in programs without CUDA (no GPU needed): they run unharmed, and a program that never launches writes
//! no summary.

use std::path::PathBuf;
use std::process::Command;

/// `libapex_preload.so` of this build (target/<profile>/, one level above the test binary's deps/).
fn cdylib() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().expect("the test binary has a directory");
    [
        dir.join("libapex_preload.so"),
        dir.join("../libapex_preload.so"),
    ]
    .into_iter()
    .find(|p| p.exists())
    .unwrap_or_else(|| panic!("libapex_preload.so not found next to {}", exe.display()))
}

#[test]
fn programs_without_cuda_run_unharmed() {
    let lib = cdylib();
    let stats =
        std::env::temp_dir().join(format!("apex-preload-smoke-{}.json", std::process::id()));
    let out = Command::new("sh")
        .args(["-c", "echo preloaded; ls / > /dev/null && echo listed"])
        .env("LD_PRELOAD", &lib)
        .env("APEX_PRELOAD_STATS", &stats)
        .output()
        .expect("run sh");
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "preloaded\nlisted\n");
    assert!(
        out.stderr.is_empty(),
        "the preload printed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!stats.exists(), "no launch, no summary");
}
