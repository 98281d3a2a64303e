//! Device `printf` output formatted as C's `printf` formats it: format strings split as the device runtime walks
//! them, each conversion formatted by the C library.

use std::ffi::{CString, c_char, c_int};

/// One argument of a device `printf`, as the record holds it.
#[derive(Clone, Debug, PartialEq)]
pub enum PrintfArg {
    /// 8 bytes as the caller packed them (zero-extended from 4 for `int`-sized arguments).
    Word(u64),
    /// A `%s` string's bytes; `None` for a null pointer.
    Str(Option<Vec<u8>>),
}

/// What a conversion takes from the record: the device runtime's view of C's format syntax.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Consumes {
    Word,
    Str,
}

/// One piece of a format string.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Piece<'a> {
    Literal(&'a [u8]),
    Percent,
    Spec(Spec<'a>),
}

/// A conversion specification, split into its parts.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Spec<'a> {
    flags: &'a [u8],
    /// `Some(None)` for `*`.
    width: Option<Option<&'a [u8]>>,
    precision: Option<Option<&'a [u8]>>,
    /// Whether a length modifier makes an integer 64-bit (`l`, `ll`, `z`, `j`, `t`, `q`, `L`).
    wide: bool,
    length: &'a [u8],
    conversion: u8,
    /// The whole text, for conversions C does not know (printed as written).
    text: &'a [u8],
}

/// Splits a format string as the device runtime walks it (the two must agree on what each conversion consumes).
fn pieces(fmt: &[u8]) -> Vec<Piece<'_>> {
    let mut out = Vec::new();
    let mut i = 0;
    let mut lit = 0;
    while i < fmt.len() {
        if fmt[i] != b'%' {
            i += 1;
            continue;
        }
        if lit < i {
            out.push(Piece::Literal(&fmt[lit..i]));
        }
        let start = i;
        i += 1;
        if fmt.get(i) == Some(&b'%') {
            out.push(Piece::Percent);
            i += 1;
            lit = i;
            continue;
        }
        let f0 = i;
        while matches!(fmt.get(i), Some(b'-' | b'+' | b' ' | b'#' | b'0' | b'\'')) {
            i += 1;
        }
        let flags = &fmt[f0..i];
        let number = |i: &mut usize| -> Option<Option<&[u8]>> {
            if fmt.get(*i) == Some(&b'*') {
                *i += 1;
                return Some(None);
            }
            let s = *i;
            while fmt.get(*i).is_some_and(u8::is_ascii_digit) {
                *i += 1;
            }
            (s < *i).then(|| Some(&fmt[s..*i]))
        };
        let width = number(&mut i);
        let precision = if fmt.get(i) == Some(&b'.') {
            i += 1;
            Some(number(&mut i).unwrap_or(Some(&b"0"[..])))
        } else {
            None
        };
        let l0 = i;
        let mut wide = false;
        while let Some(&c) = fmt.get(i) {
            match c {
                b'l' | b'z' | b'j' | b't' | b'q' | b'L' => wide = true,
                b'h' => {}
                _ => break,
            }
            i += 1;
        }
        let length = &fmt[l0..i];
        let Some(&conversion) = fmt.get(i) else {
            // A trailing, unfinished specification: the runtime stops there too.
            out.push(Piece::Literal(&fmt[start..]));
            lit = fmt.len();
            break;
        };
        i += 1;
        out.push(Piece::Spec(Spec {
            flags,
            width,
            precision,
            wide,
            length,
            conversion,
            text: &fmt[start..i],
        }));
        lit = i;
    }
    if lit < fmt.len() {
        out.push(Piece::Literal(&fmt[lit..]));
    }
    out
}

fn is_integer(c: u8) -> bool {
    matches!(c, b'd' | b'i' | b'u' | b'o' | b'x' | b'X' | b'c')
}

fn is_float(c: u8) -> bool {
    matches!(c, b'f' | b'F' | b'e' | b'E' | b'g' | b'G' | b'a' | b'A')
}

/// What each argument-consuming conversion of `fmt` takes, in order (`*` widths and precisions included).
pub(super) fn conversions(fmt: &[u8]) -> Vec<Consumes> {
    let mut out = Vec::new();
    for p in pieces(fmt) {
        let Piece::Spec(s) = p else { continue };
        let known = is_integer(s.conversion)
            || is_float(s.conversion)
            || matches!(s.conversion, b'p' | b'n' | b's');
        if s.width == Some(None) {
            out.push(Consumes::Word);
        }
        if s.precision == Some(None) {
            out.push(Consumes::Word);
        }
        if known {
            out.push(if s.conversion == b's' {
                Consumes::Str
            } else {
                Consumes::Word
            });
        }
    }
    out
}

unsafe extern "C" {
    /// The C library's formatter: device output is formatted exactly as C's `printf` formats it.
    fn snprintf(s: *mut c_char, n: usize, format: *const c_char, ...) -> c_int;
}

/// Value passed to `snprintf` for one conversion.
enum CArg<'a> {
    Int(c_int),
    Long(i64),
    Double(f64),
    Ptr(u64),
    Str(&'a CString),
}

/// Formats one conversion with the C library. `spec` is a complete `%...` specification without `*`.
fn c_format(spec: &[u8], arg: CArg<'_>, out: &mut Vec<u8>) {
    let Ok(spec) = CString::new(spec) else {
        return;
    };
    let mut buf = vec![0u8; 128];
    for _ in 0..2 {
        let p = buf.as_mut_ptr().cast::<c_char>();
        let n = buf.len();
        // SAFETY: `buf` is writable for `n` bytes; `spec` is a NUL-terminated format holding exactly one
        // conversion, built above to take exactly the type passed here (int, long long, double, pointer or a
        // NUL-terminated string that outlives the call).
        let written = unsafe {
            match arg {
                CArg::Int(v) => snprintf(p, n, spec.as_ptr(), v),
                CArg::Long(v) => snprintf(p, n, spec.as_ptr(), v),
                CArg::Double(v) => snprintf(p, n, spec.as_ptr(), v),
                CArg::Ptr(v) => {
                    snprintf(p, n, spec.as_ptr(), v as usize as *const std::ffi::c_void)
                }
                CArg::Str(s) => snprintf(p, n, spec.as_ptr(), s.as_ptr()),
            }
        };
        let Ok(len) = usize::try_from(written) else {
            return;
        };
        if len < n {
            out.extend_from_slice(&buf[..len]);
            return;
        }
        buf.resize(len + 1, 0);
    }
}

/// Largest width or precision a conversion is formatted with.
pub(super) const MAX_FIELD: i32 = 4096;

/// Formats a device `printf` record as C's `printf` would have (widths and precisions above 4096 are cut to it).
pub fn format_printf(format: &[u8], args: &[PrintfArg]) -> Vec<u8> {
    let mut out = Vec::with_capacity(format.len() + 16 * args.len());
    let mut args = args.iter();
    fn next_word<'a>(args: &mut impl Iterator<Item = &'a PrintfArg>) -> Option<u64> {
        match args.next() {
            Some(PrintfArg::Word(w)) => Some(*w),
            _ => None,
        }
    }
    for piece in pieces(format) {
        let s = match piece {
            Piece::Literal(l) => {
                out.extend_from_slice(l);
                continue;
            }
            Piece::Percent => {
                out.push(b'%');
                continue;
            }
            Piece::Spec(s) => s,
        };
        // Widths and precisions are bounded (a device could ask for a gigabyte of padding); `*` takes an int.
        let star = |v: Option<u64>| {
            (v.unwrap_or(0) as u32 as i32)
                .clamp(-MAX_FIELD, MAX_FIELD)
                .to_string()
                .into_bytes()
        };
        let digits = |d: &[u8]| {
            let v = std::str::from_utf8(d)
                .ok()
                .and_then(|t| t.parse::<i32>().ok())
                .unwrap_or(MAX_FIELD);
            v.min(MAX_FIELD).to_string().into_bytes()
        };
        let width = match s.width {
            Some(None) => Some(star(next_word(&mut args))),
            Some(Some(w)) => Some(digits(w)),
            None => None,
        };
        let precision = match s.precision {
            Some(None) => Some(star(next_word(&mut args))),
            Some(Some(p)) => Some(digits(p)),
            None => None,
        };
        let c = s.conversion;
        if !(is_integer(c) || is_float(c) || matches!(c, b'p' | b'n' | b's')) {
            out.extend_from_slice(s.text);
            continue;
        }
        let mut spec = vec![b'%'];
        spec.extend_from_slice(s.flags);
        if let Some(w) = &width {
            spec.extend_from_slice(w);
        }
        if let Some(p) = &precision {
            spec.push(b'.');
            spec.extend_from_slice(p);
        }
        match c {
            b'n' => {
                next_word(&mut args); // consumed, never written through
                continue;
            }
            b's' => {
                let text = match args_next_str(&mut args) {
                    Some(Some(bytes)) => bytes,
                    _ => b"(null)".to_vec(),
                };
                let Ok(text) = CString::new(
                    text.into_iter()
                        .take_while(|&b| b != 0)
                        .collect::<Vec<u8>>(),
                ) else {
                    continue;
                };
                spec.push(b's');
                c_format(&spec, CArg::Str(&text), &mut out);
            }
            b'p' => {
                spec.push(b'p');
                c_format(
                    &spec,
                    CArg::Ptr(next_word(&mut args).unwrap_or(0)),
                    &mut out,
                );
            }
            c if is_float(c) => {
                spec.push(c);
                c_format(
                    &spec,
                    CArg::Double(f64::from_bits(next_word(&mut args).unwrap_or(0))),
                    &mut out,
                );
            }
            c => {
                let v = next_word(&mut args).unwrap_or(0);
                if s.wide && c != b'c' {
                    spec.extend_from_slice(b"ll");
                    spec.push(c);
                    c_format(&spec, CArg::Long(v as i64), &mut out);
                } else {
                    // `h` and `hh` stay: C narrows the int as the device's printf would.
                    spec.extend_from_slice(if s.wide { b"" } else { s.length });
                    spec.push(c);
                    c_format(&spec, CArg::Int(v as u32 as c_int), &mut out);
                }
            }
        }
    }
    out
}

/// Takes the next argument as a string (`None` when it is not one).
fn args_next_str<'a>(args: &mut impl Iterator<Item = &'a PrintfArg>) -> Option<Option<Vec<u8>>> {
    match args.next() {
        Some(PrintfArg::Str(s)) => Some(s.clone()),
        _ => None,
    }
}
