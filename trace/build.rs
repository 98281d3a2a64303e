//! Name tables for the tracer, scanned from the committed RM/UVM bindings (`src/rm/sys/nvrm.rs`):
//! RM control commands (`NV..._CTRL_CMD_...`), RM escapes (`NV_ESC_...`) and UVM ioctls (`UVM_X`
//! constants that have a `UVM_X_PARAMS` structure, which tells them from the other `UVM_` values).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::PathBuf;

/// `pub const NAME: u32 = VALUE;` → (NAME, VALUE).
fn consts(src: &str) -> impl Iterator<Item = (&str, u32)> {
    src.lines().filter_map(|l| {
        let rest = l.trim().strip_prefix("pub const ")?;
        let (name, rest) = rest.split_once(": u32 = ")?;
        let value = rest.strip_suffix(';')?.parse().ok()?;
        Some((name, value))
    })
}

/// First name per value, sorted by value, as a Rust slice literal.
fn table(entries: impl Iterator<Item = (String, u32)>) -> String {
    let mut by_value = BTreeMap::new();
    for (name, value) in entries {
        by_value.entry(value).or_insert(name);
    }
    let mut s = String::from("&[\n");
    for (v, n) in by_value {
        writeln!(s, "    ({v:#x}, \"{n}\"),").unwrap();
    }
    s.push(']');
    s
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let nvrm = manifest.join("../src/rm/sys/nvrm.rs");
    println!("cargo::rerun-if-changed={}", nvrm.display());
    let src = std::fs::read_to_string(&nvrm).expect("read ../src/rm/sys/nvrm.rs");
    let structs: BTreeSet<&str> = src
        .lines()
        .filter_map(|l| {
            l.trim()
                .strip_prefix("pub struct ")?
                .split([' ', '{'])
                .next()
        })
        .collect();
    let ctrl = consts(&src)
        .filter(|(n, _)| n.starts_with("NV") && n.contains("_CTRL_CMD_"))
        .map(|(n, v)| (n.to_string(), v));
    let esc = consts(&src)
        .filter(|(n, _)| n.starts_with("NV_ESC_"))
        .map(|(n, v)| (n.trim_start_matches("NV_ESC_").to_string(), v));
    let uvm = consts(&src)
        .filter(|(n, _)| n.starts_with("UVM_") && structs.contains(format!("{n}_PARAMS").as_str()))
        .map(|(n, v)| (n.to_string(), v));
    let out = format!(
        "/// RM control commands, by command number.\npub static CTRL_CMDS: &[(u32, &str)] = {};\n\
         /// RM escapes (`NV_ESC_` stripped), by escape number.\npub static ESCAPES: &[(u32, &str)] = {};\n\
         /// UVM ioctls, by command number.\npub static UVM_IOCTLS: &[(u32, &str)] = {};\n",
        table(ctrl),
        table(esc),
        table(uvm)
    );
    let dest = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("names.rs");
    std::fs::write(dest, out).unwrap();
}
