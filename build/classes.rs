//! Generates Rust tables from the vendored NVIDIA class headers into `$OUT_DIR/classes.rs`, which
//! `src/hw/mod.rs` includes.
//!
//! Bit ranges in the headers (`31:29`, `MW(583:580)`) are not C expressions, so bindgen drops them;
//! this parser reads the `#define`s itself so that no method offset or field position is typed by hand
//! anywhere in the crate. Forms understood:
//!
//! - `#define NAME (0x0000005C)` / `#define NAME 0x00000001`: a method offset or a value;
//! - `#define NAME 31:29`: a field of a 32-bit method data word;
//! - `#define NAME MW(583:580)`: a QMD field, as absolute bit positions in the QMD;
//! - function-like `#define NAME(i) (0x0320+(i)*4)` and `#define NAME(i) MW((416+(i)*4):(416+(i)*4))`,
//!   evaluated by a small affine expression evaluator (`+ - *`, parentheses, literals, the parameters).
//!
//! Anything else that carries the class prefix is counted as skipped; the build fails if a define the
//! crate relies on (see `REQUIRED_*`) is missing, so a header refresh cannot silently drop one.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

const SDK_CLASS: &str = "open-gpu-headers/open-gpu-kernel-modules/src/common/sdk/nvidia/inc/class";
const DOC_COMPUTE: &str = "open-gpu-headers/open-gpu-doc/classes/compute";
const DOC_COPY: &str = "open-gpu-headers/open-gpu-doc/classes/dma-copy";

/// Highest method byte offset + 4: METHOD_ADDRESS is a 12-bit dword address.
const METHOD_SPACE_END: u64 = 0x4000;
/// Upper bound on how many instances of an indexed QMD field go into `FIELDS`.
const MAX_QMD_INDEX: u64 = 64;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A pushbuffer class: emits `CLASS`, constants, fields and a `METHODS` table.
    Methods,
    /// The usermode (doorbell) class: register offsets, no methods table.
    Usermode,
    /// A QMD layout: emits fields, `SIZE_BYTES` and `FIELDS`.
    Qmd { size_bytes: u64 },
}

#[derive(Clone, Copy)]
struct Spec {
    group: &'static str,
    module: &'static str,
    dir: &'static str,
    file: &'static str,
    prefix: &'static str,
    kind: Kind,
    /// Class number for the `CLASS` constant (methods and usermode classes).
    class: u32,
    required: &'static [&'static str],
}

const REQUIRED_HOST: &[&str] = &[
    "SET_OBJECT",
    "SEM_ADDR_LO",
    "SEM_ADDR_HI",
    "SEM_PAYLOAD_LO",
    "SEM_PAYLOAD_HI",
    "SEM_EXECUTE",
    "SEM_EXECUTE_OPERATION",
    "SEM_EXECUTE_OPERATION_ACQUIRE",
    "SEM_EXECUTE_OPERATION_RELEASE",
    "SEM_EXECUTE_RELEASE_WFI",
    "SEM_EXECUTE_PAYLOAD_SIZE",
    "SEM_EXECUTE_RELEASE_TIMESTAMP",
    "GP_ENTRY0_GET",
    "GP_ENTRY1_GET_HI",
    "GP_ENTRY1_LENGTH",
];
/// The DMA method-header formats the pushbuffer encoder and decoder use (from clc56f.h).
const REQUIRED_C56F: &[&str] = &[
    "SET_OBJECT_NVCLASS",
    "NON_STALL_INTERRUPT",
    "WFI",
    "MEM_OP_A",
    "MEM_OP_D",
    "DMA_METHOD_ADDRESS",
    "DMA_METHOD_SUBCHANNEL",
    "DMA_METHOD_COUNT",
    "DMA_IMMD_DATA",
    "DMA_SEC_OP",
    "DMA_SEC_OP_GRP0_USE_TERT",
    "DMA_SEC_OP_INC_METHOD",
    "DMA_SEC_OP_GRP2_USE_TERT",
    "DMA_SEC_OP_NON_INC_METHOD",
    "DMA_SEC_OP_IMMD_DATA_METHOD",
    "DMA_SEC_OP_ONE_INC",
    "DMA_SEC_OP_END_PB_SEGMENT",
    "DMA_TERT_OP",
    "DMA_TERT_OP_GRP0_INC_METHOD",
    "DMA_TERT_OP_GRP0_SET_SUB_DEV_MASK",
    "DMA_TERT_OP_GRP0_STORE_SUB_DEV_MASK",
    "DMA_TERT_OP_GRP0_USE_SUB_DEV_MASK",
    "DMA_NOP",
];
const REQUIRED_USERMODE: &[&str] = &["NOTIFY_CHANNEL_PENDING"];
const REQUIRED_COMPUTE: &[&str] = &["SET_OBJECT", "SET_OBJECT_CLASS_ID", "LOAD_INLINE_DATA"];
const REQUIRED_HOPPER_COMPUTE: &[&str] = &[
    "SET_OBJECT",
    "SET_OBJECT_CLASS_ID",
    "SEND_PCAS_A",
    "SEND_PCAS_A_QMD_ADDRESS_SHIFTED8",
    "SEND_SIGNALING_PCAS2_B",
    "SEND_SIGNALING_PCAS2_B_PCAS_ACTION",
    "SET_QMD_VERSION",
    "SET_SHADER_SHARED_MEMORY_WINDOW_A",
    "SET_SHADER_SHARED_MEMORY_WINDOW_B",
    "SET_SHADER_LOCAL_MEMORY_A",
    "SET_SHADER_LOCAL_MEMORY_B",
    "SET_SHADER_LOCAL_MEMORY_WINDOW_A",
    "SET_SHADER_LOCAL_MEMORY_WINDOW_B",
    "SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_A",
    "SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_B",
    "SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_C",
    "SET_REPORT_SEMAPHORE_A",
    "SET_REPORT_SEMAPHORE_B",
    "SET_REPORT_SEMAPHORE_C",
    "SET_REPORT_SEMAPHORE_D",
    "OFFSET_OUT_UPPER",
    "OFFSET_OUT",
    "LINE_LENGTH_IN",
    "LINE_COUNT",
    "LAUNCH_DMA",
    "LOAD_INLINE_DATA",
];
const REQUIRED_COPY: &[&str] = &[
    "LAUNCH_DMA",
    "LAUNCH_DMA_DATA_TRANSFER_TYPE",
    "OFFSET_IN_UPPER",
    "OFFSET_IN_LOWER",
    "OFFSET_OUT_UPPER",
    "OFFSET_OUT_LOWER",
    "LINE_LENGTH_IN",
    "LINE_COUNT",
    "SET_SEMAPHORE_A",
    "SET_SEMAPHORE_B",
    "SET_SEMAPHORE_PAYLOAD",
];
const REQUIRED_QMD: &[&str] = &[
    "QMD_MAJOR_VERSION",
    "CTA_THREAD_DIMENSION0",
    "CTA_THREAD_DIMENSION1",
    "CTA_THREAD_DIMENSION2",
    "BARRIER_COUNT",
    "CONSTANT_BUFFER_VALID",
    "CONSTANT_BUFFER_SIZE_SHIFTED4",
];
/// V03 names the grid CTA_RASTER_* and the minor version QMD_VERSION.
const REQUIRED_QMD_V03: &[&str] = &[
    "QMD_VERSION",
    "CTA_RASTER_WIDTH",
    "CTA_RASTER_HEIGHT",
    "CTA_RASTER_DEPTH",
    "REGISTER_COUNT_V",
    "SHARED_MEMORY_SIZE",
    "PROGRAM_ADDRESS_LOWER",
    "PROGRAM_ADDRESS_UPPER",
    "CONSTANT_BUFFER_ADDR_LOWER",
    "CONSTANT_BUFFER_ADDR_UPPER",
    "RELEASE0_ADDRESS_LOWER",
    "RELEASE0_ENABLE",
];
const REQUIRED_QMD_V04: &[&str] = &[
    "QMD_MINOR_VERSION",
    "QMD_TYPE",
    "QMD_TYPE_GRID_CTA",
    "QMD_GROUP_ID",
    "GRID_WIDTH",
    "GRID_HEIGHT",
    "GRID_DEPTH",
    "REGISTER_COUNT",
    "SHARED_MEMORY_SIZE",
    "PROGRAM_ADDRESS_LOWER",
    "PROGRAM_ADDRESS_UPPER",
    "CONSTANT_BUFFER_ADDR_LOWER_SHIFTED6",
    "CONSTANT_BUFFER_ADDR_UPPER_SHIFTED6",
    "RELEASE_ENABLE",
    "RELEASE_SEMAPHORE0_ADDR_LOWER",
    "RELEASE_SEMAPHORE0_ADDR_UPPER",
    "RELEASE_SEMAPHORE0_PAYLOAD_LOWER",
    "DEPENDENT_QMD_ENABLE",
    "DEPENDENT_QMD0_POINTER",
];
const REQUIRED_QMD_V05: &[&str] = &[
    "QMD_MINOR_VERSION",
    "QMD_TYPE",
    "GRID_WIDTH",
    "GRID_HEIGHT",
    "GRID_DEPTH",
    "REGISTER_COUNT",
    "PROGRAM_ADDRESS_LOWER_SHIFTED4",
    "CONSTANT_BUFFER_ADDR_LOWER_SHIFTED6",
    "RELEASE_ENABLE",
];

fn specs() -> Vec<Spec> {
    let m = |group, module, dir, file, prefix, class, required| Spec {
        group,
        module,
        dir,
        file,
        prefix,
        kind: Kind::Methods,
        class,
        required,
    };
    let q = |module, file, prefix, size_bytes, required| Spec {
        group: "qmd",
        module,
        dir: DOC_COMPUTE,
        file,
        prefix,
        kind: Kind::Qmd { size_bytes },
        class: 0,
        required,
    };
    vec![
        m(
            "host",
            "c56f",
            SDK_CLASS,
            "clc56f.h",
            "NVC56F_",
            0xc56f,
            REQUIRED_HOST,
        ),
        m(
            "host",
            "c86f",
            SDK_CLASS,
            "clc86f.h",
            "NVC86F_",
            0xc86f,
            REQUIRED_HOST,
        ),
        m(
            "host",
            "c96f",
            SDK_CLASS,
            "clc96f.h",
            "NVC96F_",
            0xc96f,
            &["SET_OBJECT", "SEM_EXECUTE"],
        ),
        m(
            "host",
            "ca6f",
            SDK_CLASS,
            "clca6f.h",
            "NVCA6F_",
            0xca6f,
            &["SET_OBJECT", "SEM_EXECUTE"],
        ),
        Spec {
            group: "host",
            module: "c361",
            dir: SDK_CLASS,
            file: "clc361.h",
            prefix: "NVC361_",
            kind: Kind::Usermode,
            class: 0xc361,
            required: REQUIRED_USERMODE,
        },
        m(
            "compute",
            "c6c0",
            DOC_COMPUTE,
            "clc6c0.h",
            "NVC6C0_",
            0xc6c0,
            REQUIRED_COMPUTE,
        ),
        m(
            "compute",
            "c7c0",
            DOC_COMPUTE,
            "clc7c0.h",
            "NVC7C0_",
            0xc7c0,
            REQUIRED_COMPUTE,
        ),
        m(
            "compute",
            "c9c0",
            DOC_COMPUTE,
            "clc9c0.h",
            "NVC9C0_",
            0xc9c0,
            REQUIRED_COMPUTE,
        ),
        m(
            "compute",
            "cbc0",
            DOC_COMPUTE,
            "clcbc0.h",
            "NVCBC0_",
            0xcbc0,
            REQUIRED_HOPPER_COMPUTE,
        ),
        m(
            "compute",
            "cdc0",
            DOC_COMPUTE,
            "clcdc0.h",
            "NVCDC0_",
            0xcdc0,
            REQUIRED_COMPUTE,
        ),
        m(
            "compute",
            "cec0",
            DOC_COMPUTE,
            "clcec0.h",
            "NVCEC0_",
            0xcec0,
            REQUIRED_COMPUTE,
        ),
        // V03 is defined by every Ampere..Hopper QMD header; Ada's copy is used and checked against
        // the others in `check_same_layout`.
        q(
            "v03",
            "clc9c0qmd.h",
            "NVC9C0_QMDV03_00_",
            256,
            REQUIRED_QMD_V03,
        ),
        q(
            "v04",
            "clcbc0qmd.h",
            "NVCBC0_QMDV04_00_",
            384,
            REQUIRED_QMD_V04,
        ),
        q(
            "v05",
            "clcdc0qmd.h",
            "NVCDC0_QMDV05_00_",
            384,
            REQUIRED_QMD_V05,
        ),
        m(
            "copy",
            "c6b5",
            DOC_COPY,
            "clc6b5.h",
            "NVC6B5_",
            0xc6b5,
            REQUIRED_COPY,
        ),
        m(
            "copy",
            "c7b5",
            DOC_COPY,
            "clc7b5.h",
            "NVC7B5_",
            0xc7b5,
            REQUIRED_COPY,
        ),
        m(
            "copy",
            "c8b5",
            DOC_COPY,
            "clc8b5.h",
            "NVC8B5_",
            0xc8b5,
            REQUIRED_COPY,
        ),
        m(
            "copy",
            "c9b5",
            DOC_COPY,
            "clc9b5.h",
            "NVC9B5_",
            0xc9b5,
            REQUIRED_COPY,
        ),
        m(
            "copy",
            "cab5",
            DOC_COPY,
            "clcab5.h",
            "NVCAB5_",
            0xcab5,
            REQUIRED_COPY,
        ),
    ]
}

/// Other copies of QMD V03 that must agree with the one emitted (same name → same bits).
const V03_COPIES: &[(&str, &str)] = &[
    ("clc6c0qmd.h", "NVC6C0_QMDV03_00_"),
    ("clc7c0qmd.h", "NVC7C0_QMDV03_00_"),
    ("clcbc0qmd.h", "NVCBC0_QMDV03_00_"),
];

pub fn generate() {
    let root = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));

    let mut out =
        String::from("// @generated by build/classes.rs from open-gpu-headers/; do not edit.\n\n");
    let mut groups: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    let mut class_tables = Vec::new();
    let mut skipped: Vec<String> = Vec::new();

    for spec in specs() {
        let header = parse_file(&root, spec.dir, spec.file);
        let parsed = classify(&header, &spec);
        skipped.extend(parsed.skipped.iter().cloned());
        let extra: &[&str] = match (spec.kind, spec.module) {
            (Kind::Qmd { .. }, _) => REQUIRED_QMD,
            (_, "c56f") => REQUIRED_C56F,
            _ => &[],
        };
        let missing: Vec<&str> = spec
            .required
            .iter()
            .chain(extra)
            .copied()
            .filter(|r| !parsed.names.contains_key(*r))
            .collect();
        assert!(
            missing.is_empty(),
            "{}: required defines missing (header changed?): {missing:?}",
            spec.file
        );
        if spec.kind == Kind::Methods {
            class_tables.push((spec.class, format!("{}::{}", spec.group, spec.module)));
        }
        groups
            .entry(spec.group)
            .or_default()
            .push(emit_module(&spec, &parsed));
        if spec.module == "v03" {
            for &(file, prefix) in V03_COPIES {
                let other = parse_file(&root, DOC_COMPUTE, file);
                let copy = Spec {
                    file,
                    prefix,
                    required: &[],
                    ..spec
                };
                check_same_layout(&parsed, &classify(&other, &copy), file);
            }
        }
    }

    for (group, modules) in &groups {
        let _ = writeln!(
            out,
            "#[doc = \"Generated from the {group} class headers.\"]\npub mod {group} {{"
        );
        for m in modules {
            out.push_str(m);
        }
        out.push_str("}\n\n");
    }

    // Class id -> methods table, for decoders that learn a subchannel's class from SET_OBJECT.
    out.push_str(
        "/// The generated method table of a pushbuffer class (host, compute or copy), by class number.\n\
         pub fn methods_for_class(class: u32) -> Option<&'static [MethodDesc]> {\n    match class {\n",
    );
    for (class, path) in &class_tables {
        let _ = writeln!(out, "        {class:#06x} => Some({path}::METHODS),");
    }
    out.push_str("        _ => None,\n    }\n}\n");
    let _ = writeln!(
        out,
        "\n/// Prefixed header defines the generator could not express (not values, fields or offsets).\npub const SKIPPED_DEFINES: &[&str] = &{skipped:?};\n"
    );

    let dest = out_dir.join("classes.rs");
    std::fs::write(&dest, out).unwrap_or_else(|e| panic!("writing {}: {e}", dest.display()));
}

/// Fails the build if a QMD V03 field the host writes sits at different bits in another header's
/// V03. `HW_ONLY_*` fields are the GPU's scratch state (Ampere A's HW_ONLY_DEPENDENCE_COUNTER is
/// narrower than Ada's), so they may differ.
fn check_same_layout(a: &Parsed, b: &Parsed, file: &str) {
    let differing: Vec<&str> = b
        .defines
        .iter()
        .filter(|d| matches!(d.value, Value::Mw(..)) && !d.name.starts_with("HW_ONLY_"))
        .filter(|d| {
            a.names
                .get(d.name.as_str())
                .is_some_and(|&i| a.defines[i].value != d.value)
        })
        .map(|d| d.name.as_str())
        .collect();
    assert!(
        differing.is_empty(),
        "QMD V03 fields differ in {file}: {differing:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Lexing and parsing of #defines
// ---------------------------------------------------------------------------------------------

struct RawDefine {
    name: String,
    params: Vec<String>,
    body: String,
}

fn parse_file(root: &Path, dir: &str, file: &str) -> Vec<RawDefine> {
    let path = root.join(dir).join(file);
    println!("cargo:rerun-if-changed={}", path.display());
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let text = strip_comments(&text.replace("\\\r\n", " ").replace("\\\n", " "));
    text.lines().filter_map(parse_define).collect()
}

/// Removes `/* */` and `//` comments, keeping line breaks so one define stays one line.
fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, chars.peek()) {
            ('/', Some('*')) => {
                chars.next();
                let mut prev = ' ';
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                    }
                    if prev == '*' && c == '/' {
                        break;
                    }
                    prev = c;
                }
                out.push(' ');
            }
            ('/', Some('/')) => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            _ => out.push(c),
        }
    }
    out
}

fn parse_define(line: &str) -> Option<RawDefine> {
    let rest = line
        .trim_start()
        .strip_prefix('#')?
        .trim_start()
        .strip_prefix("define")?;
    if !rest.starts_with(char::is_whitespace) {
        return None;
    }
    let rest = rest.trim_start();
    let name_len = rest
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(rest.len());
    let name = rest[..name_len].to_string();
    let mut rest = &rest[name_len..];
    let mut params = Vec::new();
    // Function-like only when '(' follows the name directly.
    if let Some(p) = rest.strip_prefix('(') {
        let close = p.find(')')?;
        params = p[..close]
            .split(',')
            .map(|s| s.trim().to_string())
            .collect();
        rest = &p[close + 1..];
    }
    Some(RawDefine {
        name,
        params,
        body: rest.trim().to_string(),
    })
}

/// An affine expression `c0 + sum(coef[k] * param[k])`: every indexed define in these headers is one.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Affine {
    c0: i64,
    coef: Vec<i64>,
}

impl Affine {
    fn constant(&self) -> Option<i64> {
        self.coef.iter().all(|&c| c == 0).then_some(self.c0)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Value {
    Const(Affine),
    /// `hi:lo` within a method data word.
    Bits(Affine, Affine),
    /// `MW(hi:lo)`: absolute bit positions in a QMD.
    Mw(Affine, Affine),
}

struct Expr<'a> {
    toks: Vec<&'a str>,
    pos: usize,
    params: &'a [String],
}

fn tokenize(s: &str) -> Option<Vec<&str>> {
    let mut toks = Vec::new();
    let mut i = 0;
    let b = s.as_bytes();
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() {
            i += 1;
        } else if b"+-*()".contains(&c) {
            toks.push(&s[i..i + 1]);
            i += 1;
        } else if c.is_ascii_alphanumeric() || c == b'_' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            toks.push(&s[start..i]);
        } else {
            return None;
        }
    }
    Some(toks)
}

impl<'a> Expr<'a> {
    fn peek(&self) -> Option<&'a str> {
        self.toks.get(self.pos).copied()
    }
    fn next(&mut self) -> Option<&'a str> {
        let t = self.toks.get(self.pos).copied();
        self.pos += 1;
        t
    }
    fn zero(&self) -> Affine {
        Affine {
            c0: 0,
            coef: vec![0; self.params.len()],
        }
    }
    fn sum(&mut self) -> Option<Affine> {
        let mut acc = self.product()?;
        while let Some(op @ ("+" | "-")) = self.peek() {
            let sign = if op == "+" { 1 } else { -1 };
            self.pos += 1;
            let rhs = self.product()?;
            acc.c0 = acc.c0.checked_add(sign * rhs.c0)?;
            for (a, r) in acc.coef.iter_mut().zip(&rhs.coef) {
                *a = a.checked_add(sign * r)?;
            }
        }
        Some(acc)
    }
    fn product(&mut self) -> Option<Affine> {
        let mut acc = self.atom()?;
        while self.peek() == Some("*") {
            self.pos += 1;
            let rhs = self.atom()?;
            // Affine only: one side of each product must be a constant.
            let (k, mut v) = match (acc.constant(), rhs.constant()) {
                (Some(k), _) => (k, rhs),
                (_, Some(k)) => (k, acc),
                _ => return None,
            };
            v.c0 = v.c0.checked_mul(k)?;
            for c in &mut v.coef {
                *c = c.checked_mul(k)?;
            }
            acc = v;
        }
        Some(acc)
    }
    fn atom(&mut self) -> Option<Affine> {
        let t = self.next()?;
        match t {
            "(" => {
                let v = self.sum()?;
                (self.next()? == ")").then_some(v)
            }
            "-" => {
                let mut v = self.atom()?;
                v.c0 = -v.c0;
                v.coef.iter_mut().for_each(|c| *c = -*c);
                Some(v)
            }
            _ => {
                if let Some(k) = self.params.iter().position(|p| p == t) {
                    let mut v = self.zero();
                    v.coef[k] = 1;
                    return Some(v);
                }
                let mut v = self.zero();
                v.c0 = parse_int(t)?;
                Some(v)
            }
        }
    }
}

fn parse_int(t: &str) -> Option<i64> {
    let t = t.trim_end_matches(['u', 'U', 'l', 'L']);
    let v = if let Some(h) = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        i64::from_str_radix(h, 16).ok()?
    } else {
        t.parse::<i64>().ok()?
    };
    Some(v)
}

fn eval(s: &str, params: &[String]) -> Option<Affine> {
    let mut e = Expr {
        toks: tokenize(s)?,
        pos: 0,
        params,
    };
    let v = e.sum()?;
    (e.pos == e.toks.len()).then_some(v)
}

/// Splits `a:b` at the one top-level colon.
fn split_colon(s: &str) -> Option<(&str, &str)> {
    let mut depth = 0i32;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ':' if depth == 0 => return Some((&s[..i], &s[i + 1..])),
            _ => {}
        }
    }
    None
}

fn parse_value(body: &str, params: &[String]) -> Option<Value> {
    if let Some(inner) = body.strip_prefix("MW(").and_then(|s| s.strip_suffix(')')) {
        let (hi, lo) = split_colon(inner)?;
        return Some(Value::Mw(eval(hi, params)?, eval(lo, params)?));
    }
    if let Some((hi, lo)) = split_colon(body) {
        return Some(Value::Bits(eval(hi, params)?, eval(lo, params)?));
    }
    Some(Value::Const(eval(body, params)?))
}

// ---------------------------------------------------------------------------------------------
// Classification: constants, fields, methods
// ---------------------------------------------------------------------------------------------

struct Define {
    /// Name with the class prefix stripped.
    name: String,
    /// Full header name, for docs.
    full: String,
    params: Vec<String>,
    value: Value,
}

struct MethodEntry {
    name: String,
    offset: u64,
    stride: u64,
    indexed: bool,
    count: u64,
    fields: Vec<FieldEntry>,
}

struct FieldEntry {
    name: String,
    hi: i64,
    lo: i64,
    values: Vec<(String, i64)>,
}

struct Parsed {
    class_name: Option<String>,
    defines: Vec<Define>,
    names: BTreeMap<String, usize>,
    methods: Vec<MethodEntry>,
    skipped: Vec<String>,
}

/// Host-class defines that are header formats or sizes, not methods, although they look like offsets.
fn never_a_method(name: &str) -> bool {
    name.starts_with("DMA_")
        || name.starts_with("GP_ENTRY")
        || name.starts_with("NUMBER_OF_")
        || name.contains("__SIZE")
}

fn classify(raw: &[RawDefine], spec: &Spec) -> Parsed {
    let mut p = Parsed {
        class_name: None,
        defines: Vec::new(),
        names: BTreeMap::new(),
        methods: Vec::new(),
        skipped: Vec::new(),
    };
    for d in raw {
        let Some(short) = d.name.strip_prefix(spec.prefix) else {
            // The class id define, e.g. `HOPPER_COMPUTE_A 0xCBC0`.
            if spec.class != 0
                && d.params.is_empty()
                && let Some(Value::Const(a)) = parse_value(&d.body, &[])
                && a.constant() == Some(i64::from(spec.class))
            {
                p.class_name = Some(d.name.clone());
            }
            continue;
        };
        let valid_ident = short
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
        let value = parse_value(&d.body, &d.params);
        let Some(value) = value.filter(|v| valid_ident && representable(v, spec.kind)) else {
            p.skipped.push(d.name.clone());
            continue;
        };
        if let Some(&prev) = p.names.get(short) {
            // C allows identical redefinitions (clc56f.h defines DMA_IMMD_DATA twice).
            if p.defines[prev].value != value || p.defines[prev].params != d.params {
                p.skipped.push(d.name.clone());
            }
            continue;
        }
        p.names.insert(short.to_string(), p.defines.len());
        p.defines.push(Define {
            name: short.to_string(),
            full: d.name.clone(),
            params: d.params.clone(),
            value,
        });
    }
    if spec.kind == Kind::Methods {
        build_methods(&mut p);
    }
    p
}

fn representable(v: &Value, kind: Kind) -> bool {
    let u32_ok = |x: i64| (0..=i64::from(u32::MAX)).contains(&x);
    match v {
        Value::Const(a) => u32_ok(a.c0) && a.coef.iter().all(|&c| u32_ok(c)),
        Value::Bits(hi, lo) => {
            let (Some(hi), Some(lo)) = (hi.constant(), lo.constant()) else {
                return false;
            };
            (0..32).contains(&hi) && (0..=hi).contains(&lo)
        }
        Value::Mw(hi, lo) => {
            let Kind::Qmd { size_bytes } = kind else {
                return false;
            };
            let (h0, l0) = (hi.c0, lo.c0);
            hi.coef == lo.coef
                && l0 >= 0
                && h0 >= l0
                && h0 - l0 < 64
                && u64::try_from(h0).is_ok_and(|h| h < size_bytes * 8)
                && hi.coef.iter().all(|&c| c >= 0)
        }
    }
}

fn build_methods(p: &mut Parsed) {
    let mut current: Option<usize> = None;
    for d in &p.defines {
        match &d.value {
            Value::Bits(hi, lo) => {
                let m = current.filter(|&m| {
                    d.name
                        .strip_prefix(&p.methods[m].name)
                        .is_some_and(|r| r.starts_with('_'))
                });
                match m {
                    Some(m) => {
                        let name = d.name[p.methods[m].name.len() + 1..].to_string();
                        let (hi, lo) = (hi.c0, lo.c0);
                        p.methods[m].fields.push(FieldEntry {
                            name,
                            hi,
                            lo,
                            values: Vec::new(),
                        });
                    }
                    // A field of no method (e.g. GP_ENTRY*): later values must not attach to the old method.
                    None => current = None,
                }
            }
            Value::Const(a) => {
                // A value of a field of the current method?
                if let Some(m) = current
                    && d.params.is_empty()
                {
                    let method = &mut p.methods[m];
                    let rest = d
                        .name
                        .strip_prefix(&method.name)
                        .and_then(|r| r.strip_prefix('_'));
                    if let Some(rest) = rest {
                        let field = method
                            .fields
                            .iter_mut()
                            .filter(|f| {
                                rest.strip_prefix(&f.name)
                                    .is_some_and(|r| r.starts_with('_'))
                            })
                            .max_by_key(|f| f.name.len());
                        if let Some(f) = field {
                            let vname = rest[f.name.len() + 1..].to_string();
                            f.values.push((vname, a.c0));
                            continue;
                        }
                    }
                }
                // Otherwise a method, if it looks like one.
                let (offset, stride) = match a.coef.as_slice() {
                    [] => (a.c0, 0),
                    [s] => (a.c0, *s),
                    _ => continue,
                };
                let offset = u64::try_from(offset).unwrap_or(u64::MAX);
                let stride = u64::try_from(stride).unwrap_or(0);
                if never_a_method(&d.name)
                    || !offset.is_multiple_of(4)
                    || offset >= METHOD_SPACE_END
                    || (d.params.len() == 1 && (stride == 0 || !stride.is_multiple_of(4)))
                {
                    continue;
                }
                current = Some(p.methods.len());
                p.methods.push(MethodEntry {
                    name: d.name.clone(),
                    offset,
                    stride: if d.params.is_empty() { 4 } else { stride },
                    indexed: !d.params.is_empty(),
                    count: 1,
                    fields: Vec::new(),
                });
            }
            Value::Mw(..) => current = None,
        }
    }
    // Array length: up to the next method that is not interleaved with this array.
    let starts: Vec<(u64, u64, bool)> = p
        .methods
        .iter()
        .map(|m| (m.offset, m.stride, m.indexed))
        .collect();
    for m in p.methods.iter_mut().filter(|m| m.indexed) {
        let interleaved = |&(o, s, idx): &(u64, u64, bool)| {
            idx && s == m.stride && o >= m.offset && o < m.offset + m.stride
        };
        let end = starts
            .iter()
            .filter(|s| s.0 > m.offset && !interleaved(s))
            .map(|s| s.0)
            .min()
            .unwrap_or(METHOD_SPACE_END);
        m.count = (end - m.offset).div_ceil(m.stride).max(1);
    }
    p.methods.sort_by_key(|m| m.offset);
}

// ---------------------------------------------------------------------------------------------
// Emission
// ---------------------------------------------------------------------------------------------

/// Rust for `c0 + sum(coef * param)`, in wrapping arithmetic so that no index can make the
/// generated `const fn` panic. Offsets print in hex, bit positions in decimal (as in the headers).
fn affine_expr(a: &Affine, params: &[String], hex: bool) -> String {
    let mut e = if hex {
        format!("{:#x}u32", a.c0)
    } else {
        format!("{}u32", a.c0)
    };
    for (c, p) in a.coef.iter().zip(params) {
        match c {
            0 => {}
            1 => e = format!("{e}.wrapping_add({p})"),
            c => e = format!("{e}.wrapping_add({p}.wrapping_mul({c}))"),
        }
    }
    e
}

fn field_expr(hi: &Affine, lo: &Affine, params: &[String]) -> String {
    if params.is_empty() {
        format!("Field::new({}, {})", hi.c0, lo.c0)
    } else {
        format!(
            "Field::new({}, {})",
            affine_expr(hi, params, false),
            affine_expr(lo, params, false)
        )
    }
}

fn lower_params(params: &[String]) -> Vec<String> {
    params.iter().map(|p| p.to_ascii_lowercase()).collect()
}

fn emit_module(spec: &Spec, p: &Parsed) -> String {
    let mut o = String::new();
    let what = match spec.kind {
        Kind::Methods => "methods",
        Kind::Usermode => "usermode registers",
        Kind::Qmd { .. } => "QMD layout",
    };
    let _ = writeln!(
        o,
        "#[doc = \"`{}*` {what} from `{}/{}`{}.\"]",
        spec.prefix,
        spec.dir.trim_start_matches("open-gpu-headers/"),
        spec.file,
        p.class_name
            .as_deref()
            .map(|c| format!(" ({c})"))
            .unwrap_or_default()
    );
    let _ = writeln!(
        o,
        "#[allow(non_snake_case, non_upper_case_globals, dead_code, clippy::unreadable_literal)]\npub mod {} {{",
        spec.module
    );
    if p.defines
        .iter()
        .any(|d| !matches!(d.value, Value::Const(_)))
    {
        o.push_str("    use crate::hw::Field;\n\n");
    }
    if spec.class != 0 {
        let _ = writeln!(
            o,
            "    /// Class number.\n    pub const CLASS: u32 = {:#06x};",
            spec.class
        );
        if let Some(name) = &p.class_name {
            let _ = writeln!(
                o,
                "    /// Class number, by its header name.\n    pub const {name}: u32 = {:#06x};",
                spec.class
            );
        }
    }
    if let Kind::Qmd { size_bytes } = spec.kind {
        let max_bit = p
            .defines
            .iter()
            .filter_map(|d| match &d.value {
                Value::Mw(hi, _) if d.params.is_empty() => Some(hi.c0),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        let derived = u64::try_from(max_bit + 1)
            .unwrap_or(0)
            .div_ceil(8)
            .div_ceil(32)
            * 32;
        assert_eq!(
            derived, size_bytes,
            "{}: QMD size from highest field bit",
            spec.file
        );
        let _ = writeln!(
            o,
            "    /// QMD size in bytes (highest field bit + 1, in 32-byte units).\n    pub const SIZE_BYTES: usize = {size_bytes};"
        );
    }
    for d in &p.defines {
        let params = lower_params(&d.params);
        let sig = params
            .iter()
            .map(|p| format!("{p}: u32"))
            .collect::<Vec<_>>()
            .join(", ");
        let _ = writeln!(o, "    /// `{}`", d.full);
        match (&d.value, d.params.is_empty()) {
            (Value::Const(a), true) => {
                let _ = writeln!(o, "    pub const {}: u32 = {:#x};", d.name, a.c0);
            }
            (Value::Const(a), false) => {
                let _ = writeln!(
                    o,
                    "    pub const fn {}({sig}) -> u32 {{ {} }}",
                    d.name,
                    affine_expr(a, &params, true)
                );
            }
            (Value::Bits(hi, lo) | Value::Mw(hi, lo), true) => {
                let _ = writeln!(
                    o,
                    "    pub const {}: Field = {};",
                    d.name,
                    field_expr(hi, lo, &params)
                );
            }
            (Value::Bits(hi, lo) | Value::Mw(hi, lo), false) => {
                let _ = writeln!(
                    o,
                    "    pub const fn {}({sig}) -> Field {{ {} }}",
                    d.name,
                    field_expr(hi, lo, &params)
                );
            }
        }
    }
    match spec.kind {
        Kind::Methods => emit_methods(&mut o, p),
        Kind::Qmd { size_bytes } => emit_qmd_fields(&mut o, p, size_bytes),
        Kind::Usermode => {}
    }
    o.push_str("}\n");
    o
}

fn emit_methods(o: &mut String, p: &Parsed) {
    o.push_str(
        "\n    /// Every method of the class with its fields and named values, sorted by offset.\n",
    );
    o.push_str("    pub const METHODS: &[crate::hw::MethodDesc] = &[\n");
    for m in &p.methods {
        let _ = write!(
            o,
            "        crate::hw::MethodDesc {{ name: {:?}, offset: {:#x}, count: {}, stride: {}, fields: &[",
            m.name, m.offset, m.count, m.stride
        );
        for f in &m.fields {
            let _ = write!(
                o,
                "crate::hw::FieldDesc {{ name: {:?}, field: Field::new({}, {}), values: &[",
                f.name, f.hi, f.lo
            );
            for (n, v) in &f.values {
                let _ = write!(o, "({n:?}, {v:#x}), ");
            }
            o.push_str("] }, ");
        }
        o.push_str("] },\n");
    }
    o.push_str("    ];\n");
}

/// Expands indexed QMD fields for `FIELDS`: instance `i` is kept while it stays inside the QMD and
/// does not run into a plain field or the first instance of an unrelated indexed family. That gives
/// 3 releases, 2 dependent QMDs and 8 constant buffers in V04, matching the header's own numbered
/// fields (RELEASE_SEMAPHORE0..2, DEPENDENT_QMD0/1_POINTER).
fn emit_qmd_fields(o: &mut String, p: &Parsed, size_bytes: u64) {
    let bits = size_bytes * 8;
    let mut fixed = vec![false; bits as usize];
    let mut fields: Vec<(String, i64, i64)> = Vec::new();
    for d in &p.defines {
        if let (Value::Mw(hi, lo), true) = (&d.value, d.params.is_empty()) {
            for b in lo.c0..=hi.c0 {
                fixed[b as usize] = true;
            }
            fields.push((d.name.clone(), hi.c0, lo.c0));
        }
    }
    // An instance with exactly the bits of a plain field is an alias (V05 has both
    // DEPENDENT_QMD0_ENABLE and DEPENDENT_QMD_ENABLE(0)): not a collision, and not listed twice.
    let plain: std::collections::BTreeSet<(i64, i64)> = fields.iter().map(|f| (f.1, f.2)).collect();
    // One-parameter families; a group is the families sharing a stride whose first instances lie
    // within one stride of each other (e.g. all RELEASE_*(i)).
    let families: Vec<(&Define, i64, i64, i64)> = p
        .defines
        .iter()
        .filter_map(|d| match (&d.value, d.params.len()) {
            (Value::Mw(hi, lo), 1) => Some((d, hi.c0, lo.c0, lo.coef[0])),
            _ => None,
        })
        .collect();
    let group_of = |lo: i64, stride: i64| -> i64 {
        families
            .iter()
            .filter(|f| f.3 == stride && f.2 <= lo && lo - f.2 < stride.max(1))
            .map(|f| f.2)
            .min()
            .unwrap_or(lo)
    };
    let mut counts: BTreeMap<(i64, i64), u64> = BTreeMap::new();
    for &(_, hi0, lo0, stride) in &families {
        let group = group_of(lo0, stride);
        let foreign = |b: i64| {
            fixed[b as usize]
                || families
                    .iter()
                    .any(|&(_, h, l, s)| (l..=h).contains(&b) && group_of(l, s) != group)
        };
        let mut n = 1u64;
        while n < MAX_QMD_INDEX {
            let (lo, hi) = (lo0 + stride * n as i64, hi0 + stride * n as i64);
            if stride <= 0
                || hi >= bits as i64
                || (!plain.contains(&(hi, lo)) && (lo..=hi).any(foreign))
            {
                break;
            }
            n += 1;
        }
        let c = counts.entry((stride, group)).or_insert(n);
        *c = (*c).min(n);
    }
    for &(d, hi0, lo0, stride) in &families {
        let n = counts[&(stride, group_of(lo0, stride))];
        for i in 0..n as i64 {
            let (hi, lo) = (hi0 + stride * i, lo0 + stride * i);
            if !plain.contains(&(hi, lo)) {
                fields.push((format!("{}({i})", d.name), hi, lo));
            }
        }
    }
    fields.sort_by_key(|f| f.2);
    o.push_str("\n    /// Every field, indexed ones expanded (`NAME(i)`), sorted by lowest bit.\n");
    o.push_str("    pub const FIELDS: &[(&str, Field)] = &[\n");
    for (n, hi, lo) in &fields {
        let _ = writeln!(o, "        ({n:?}, Field::new({hi}, {lo})),");
    }
    o.push_str("    ];\n");
}
