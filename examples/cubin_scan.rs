//! Reads every cubin in the host binaries, fatbins or cubins named on the command line (a shared library such as
//! PyTorch's `libtorch_cuda.so` or `libcublasLt.so`) and says what APEX's loader makes of their kernels: how many
//! parse, how many the direct path would refuse and why (a parameter table that does not describe the parameter
//! block), and which can trap (in their own code, or only in functions they call), and which cubins do not parse. No GPU is
//! needed: it is a conformance sweep over what real toolchains shipped.
//!
//! `cargo run --release --example cubin_scan -- /path/to/libtorch_cuda.so [more files]`; `APEX_SCAN_SM` picks the
//! architecture (default 90).

use std::collections::BTreeMap;

use apex::module::cubin::Cubin;
use apex::module::fatbin::{self, FatbinEntryKind};

/// What one file's cubins hold.
#[derive(Default)]
struct Tally {
    cubins: usize,
    unparsed: Vec<String>,
    kernels: usize,
    /// Kernels by what was found in them (why the direct path refuses them, where they can trap), with a first
    /// example.
    noted: BTreeMap<&'static str, (usize, String)>,
    /// Kernels whose parameters pass 4 KiB (read from `EIATTR_KPARAM_INFO_V2` where nvcc wrote it).
    big_params: usize,
}

impl Tally {
    fn note(&mut self, what: &'static str, example: String) {
        let e = self.noted.entry(what).or_insert((0, example));
        e.0 += 1;
    }

    fn cubin(&mut self, bytes: &[u8], origin: &str) {
        self.cubins += 1;
        let cubin = match Cubin::parse(bytes) {
            Ok(c) => c,
            Err(e) => {
                self.unparsed.push(format!("{origin}: {e}"));
                return;
            }
        };
        for (i, k) in cubin.kernels().iter().enumerate() {
            self.kernels += 1;
            if k.param_cbank_size > 4096 {
                self.big_params += 1;
            }
            if let Some(why) = k.parameter_table_problem() {
                self.note("refused: its parameter table", format!("{}: {why}", k.name));
            }
            if let Some(at) = cubin.own_trap(i) {
                self.note(
                    "can trap, in its own code",
                    format!("{} (at {at:#x})", k.name),
                );
            } else if let Some((section, at)) = cubin.reachable_trap(i) {
                self.note(
                    "can trap, only in functions it calls",
                    format!("{} ({section} at {at:#x})", k.name),
                );
            }
        }
    }
}

/// Whether `bytes` is an ELF for NVIDIA GPUs (`e_machine` EM_CUDA, 190): a cubin, not a host binary.
fn is_cuda_elf(bytes: &[u8]) -> bool {
    bytes.starts_with(b"\x7fELF") && bytes.get(18..20) == Some(&190u16.to_le_bytes()[..])
}

fn main() {
    let sm: u32 = std::env::var("APEX_SCAN_SM")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(90);
    let paths: Vec<String> = std::env::args().skip(1).collect();
    if paths.is_empty() {
        eprintln!("usage: cubin_scan FILE... (host binaries, fatbins or cubins)");
        std::process::exit(2);
    }
    for path in paths {
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) => {
                println!("{path}: cannot read: {e}");
                continue;
            }
        };
        let mut t = Tally::default();
        if is_cuda_elf(&bytes) {
            t.cubin(&bytes, &path);
        } else {
            match fatbin::entries(&bytes) {
                Ok(entries) => {
                    for e in entries
                        .iter()
                        .filter(|e| e.kind == FatbinEntryKind::Cubin && e.sm == sm)
                    {
                        match fatbin::payload(&bytes, e) {
                            Ok(cubin) => t.cubin(&cubin, &format!("container {}", e.container)),
                            Err(err) => {
                                t.unparsed.push(format!("container {}: {err}", e.container))
                            }
                        }
                    }
                }
                Err(e) => {
                    println!("{path}: no fatbin: {e}");
                    continue;
                }
            }
        }
        println!(
            "{path}: {} cubins (sm_{sm} from fatbins), {} kernels ({} with parameters past 4 KiB), {} cubins not parsed",
            t.cubins,
            t.kernels,
            t.big_params,
            t.unparsed.len()
        );
        for (what, (n, example)) in &t.noted {
            println!("  {what}: {n} kernels (e.g. {example})");
        }
        for u in t.unparsed.iter().take(3) {
            println!("  not parsed: {u}");
        }
    }
}
