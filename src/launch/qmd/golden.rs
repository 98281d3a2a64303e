//! The golden test of the QMD builders and editors: a deterministic generator of [`QmdParams`] (every layout
//! version, every SM version of the generation table and one it lacks, grids, blocks, clusters with both policies,
//! sync domains, shared sizes around the carveouts, local sizes, constant banks, releases, program prefetch ranges,
//! and values that do not fit their fields), each built in every layout and then passed through every editor.
//! Every output word array and every `Result` is folded into one 64-bit digest per case; `golden.txt` beside this
//! file holds the digests the builders gave when the test was written (before the builders became one type per
//! layout), so any change of behaviour shows up as the first case whose digest moved.
//!
//! `APEX_QMD_GOLDEN=write cargo test -p apex --lib golden` rewrites `golden.txt` from the current code; only do that
//! for a change of behaviour that is meant.

use super::*;
use crate::hw::generation::GENERATIONS;

/// Parameter sets generated; each is built in all three layouts.
const CASES: usize = 1000;

/// The fixture with one digest per case: where `APEX_QMD_GOLDEN=write` writes the digests (the comparison reads the copy compiled in).
const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src/launch/qmd/golden.txt");

/// splitmix64: a small deterministic generator that does not depend on any crate's version.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// 0 to n - 1.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// True one time in `n`.
    fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }

    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize]
    }
}

/// FNV-1a 64 over everything a case produces.
struct Digest(u64);

impl Digest {
    fn bytes(&mut self, b: &[u8]) {
        for &x in b {
            self.0 ^= u64::from(x);
            self.0 = self.0.wrapping_mul(0x100_0000_01b3);
        }
    }

    fn words(&mut self, w: &[u32; QMD_WORDS]) {
        for x in w {
            self.bytes(&x.to_le_bytes());
        }
    }

    fn debug(&mut self, v: &impl std::fmt::Debug) {
        self.bytes(format!("{v:?}").as_bytes());
    }
}

/// A GPU address of at most `bits` bits (at most 40 three times in four, V03's width), aligned to `align`.
fn va(r: &mut Rng, bits: u32, align: u64) -> u64 {
    let bits = if r.one_in(4) { bits } else { bits.min(40) };
    (r.next() & ((1u64 << bits) - 1)) & !(align - 1)
}

fn const_buffer(r: &mut Rng) -> ConstBuffer {
    let align = if r.one_in(40) { 4 } else { 64 };
    let bits = if r.one_in(50) { 63 } else { 49 };
    let size = if r.one_in(10) {
        r.below(0x1_0000) as u32
    } else {
        (r.below(4096) as u32 + 1) * 16
    };
    ConstBuffer {
        va: va(r, bits, align),
        size,
    }
}

fn params(r: &mut Rng) -> QmdParams {
    let mut sms: Vec<u32> = GENERATIONS.iter().map(|g| g.sm_version).collect();
    if r.one_in(12) {
        sms = vec![75, 91, 0];
    }
    let sm_version = r.pick(&sms);
    let dims = [
        1u32,
        1,
        2,
        3,
        7,
        32,
        64,
        1000,
        65535,
        65536,
        1 << 20,
        0x7fff_ffff,
    ];
    let mut grid = [0u32; 3];
    for (i, g) in grid.iter_mut().enumerate() {
        *g = if r.one_in(60) {
            0
        } else if i > 0 && !r.one_in(8) {
            // Height and depth are 16-bit fields: mostly small.
            r.pick(&dims[..9])
        } else {
            r.pick(&dims)
        };
    }
    let cluster = if r.one_in(4) {
        let mut c = [1u32; 3];
        for (i, c) in c.iter_mut().enumerate() {
            *c = r.pick(&[1, 1, 2, 4, 8, 16]);
            if r.one_in(50) {
                *c = 0;
            }
            if !r.one_in(8) {
                // Mostly a grid that is a multiple of the cluster.
                grid[i] = (*c).max(1).saturating_mul(r.below(64) as u32 + 1);
            }
        }
        Some(c)
    } else {
        None
    };
    let mut block = [1u32; 3];
    for b in &mut block {
        *b = if r.one_in(40) {
            r.next() as u32
        } else {
            r.pick(&[1, 2, 32, 64, 128, 256, 1024])
        };
    }
    let carve = shared_carveouts_kib(sm_version);
    let shared_bytes = match r.below(5) {
        0 => 0,
        1 if !carve.is_empty() => {
            let k = r.pick(carve) * 1024;
            k.wrapping_add(r.pick(&[0u32, 1, u32::MAX]))
        }
        2 => r.below(256 * 1024) as u32,
        3 if r.one_in(10) => r.next() as u32,
        _ => r.pick(&[1024, 48 * 1024, 100 * 1024, 228 * 1024, 232_448]),
    };
    let local_bytes_per_thread = match r.below(6) {
        0 => 0,
        1 => r.next() as u32,
        _ => r.pick(&[16, 1024, 2048, 0x10000, 0x1_0000 + 8]),
    };
    let mut const_buffers = [None; 8];
    for cb in &mut const_buffers {
        if r.one_in(2) {
            *cb = Some(const_buffer(r));
        }
    }
    let release = (!r.one_in(3)).then(|| (va(r, 49, 16), r.next()));
    let program_va = if r.one_in(30) {
        r.next()
    } else {
        va(r, 49, 128)
    };
    let program_bytes = match r.below(4) {
        0 => 0,
        1 => r.below(512) + 1,
        _ => r.below(300_000),
    };
    QmdParams {
        sm_version,
        program_va,
        program_bytes,
        registers: if r.one_in(30) {
            r.below(1024) as u32
        } else {
            r.below(255) as u32 + 1
        },
        barriers: if r.one_in(30) {
            r.below(64) as u32
        } else {
            r.below(16) as u32
        },
        grid,
        block,
        shared_bytes,
        local_bytes_per_thread,
        const_buffers,
        release,
        cluster,
        sync_domain: match r.below(10) {
            0 => 4,
            1..=5 => 0,
            _ => r.below(4) as u8,
        },
        cluster_load_balancing: r.one_in(2),
    }
}

fn graph_form(r: &mut Rng) -> GraphNodeForm {
    let mut form = GraphNodeForm::default();
    for d in &mut form.dependents {
        if r.one_in(2) {
            let action = if r.one_in(2) {
                DependentAction::Schedule
            } else {
                DependentAction::Decrement
            };
            let bits = if r.one_in(20) { 63 } else { 49 };
            *d = Some((va(r, bits, 256), action));
        }
    }
    form.counter = r.pick(&[0, 0, 1, 2, 3, 0xffff]);
    form.armed = r.one_in(2);
    form.done = (!r.one_in(2)).then(|| va(r, 49, 4));
    for p in &mut form.prefetch {
        if r.one_in(2) {
            *p = Some(const_buffer(r));
        }
    }
    form
}

/// Builds `p` in `version`, applies every editor to a copy of the result, and digests all of it.
fn case(version: QmdVersion, p: &QmdParams, r: &mut Rng) -> u64 {
    let mut d = Digest(0xcbf2_9ce4_8422_2325);
    d.debug(&version);
    // The outputs of a build that fails are digested too: what it leaves in `out` is behaviour.
    let mut base = [0xa5a5_a5a5u32; QMD_WORDS];
    d.debug(&build(version, p, &mut base));
    d.words(&base);
    d.debug(&release_payload_word(version));
    d.debug(&shared_carveouts_kib(p.sm_version));
    d.debug(&sm_configs(p.sm_version, p.shared_bytes));
    d.debug(&program_prefetch_range(p.program_va, p.program_bytes));

    let latch = if r.one_in(10) {
        r.next() as u32
    } else {
        r.below(64) as u32
    };
    let qmd_va = if r.one_in(20) {
        r.next()
    } else {
        va(r, 49, 256)
    };
    let cb0_bits = if r.one_in(20) { 63 } else { 49 };
    let cb0 = va(r, cb0_bits, 64);
    let payload = (!r.one_in(3)).then(|| r.next());
    let next_bank = const_buffer(r);
    let form = graph_form(r);

    type Edit<'a> = Box<dyn Fn(&mut [u32; QMD_WORDS]) -> Result<bool, QmdError> + 'a>;
    let edits: Vec<Edit<'_>> = vec![
        Box::new(|w| patch_launch(version, w, cb0, payload)),
        Box::new(|w| patch_launch(version, w, cb0, None)),
        Box::new(|w| keep_constant_cache(version, w)),
        Box::new(|w| set_latch_arrive(version, w, latch)),
        Box::new(|w| set_latch_wait(version, w, latch)),
        Box::new(|w| set_gated_producer(version, w, qmd_va, latch)),
        Box::new(|w| set_gate(version, w, qmd_va)),
        Box::new(|w| set_chain_link(version, w, None)),
        Box::new(|w| set_chain_link(version, w, Some((qmd_va, ChainAction::Schedule)))),
        Box::new(|w| {
            set_chain_link(
                version,
                w,
                Some((qmd_va, ChainAction::InvalidateCopySchedule)),
            )
        }),
        Box::new(|w| prefetch_bank0(version, w)),
        // Bank 5 follows bank 0 once it is its prefetch.
        Box::new(|w| {
            let a = prefetch_bank0(version, w)?;
            let b = patch_launch(version, w, cb0, payload)?;
            Ok(a && b)
        }),
        Box::new(|w| prefetch_next_bank(version, w, next_bank)),
        Box::new(|w| set_graph_node(version, w, &form)),
        Box::new(|w| set_graph_node(version, w, &GraphNodeForm::default())),
        Box::new(|w| prefetch_own_bank0(version, w)),
        Box::new(|w| set_null_grid(version, w)),
        // Editors applied in the orders the queues use.
        Box::new(|w| {
            let a = keep_constant_cache(version, w)?;
            let b = set_chain_link(version, w, Some((qmd_va, ChainAction::Schedule)))?;
            let c = prefetch_next_bank(version, w, next_bank)?;
            let e = set_latch_wait(version, w, latch)?;
            let f = prefetch_own_bank0(version, w)?;
            Ok(a && b && c && e && f)
        }),
        Box::new(|w| {
            let a = set_null_grid(version, w)?;
            let b = set_graph_node(version, w, &form)?;
            Ok(a && b)
        }),
    ];
    for edit in &edits {
        let mut w = base;
        d.debug(&edit(&mut w));
        d.words(&w);
        // The same editor on a QMD of zeros.
        let mut z = [0u32; QMD_WORDS];
        d.debug(&edit(&mut z));
        d.words(&z);
    }
    d.0
}

/// Every case's digest, in order.
fn digests() -> Vec<u64> {
    let mut r = Rng(0x5eed_0a9e_c0de_0029);
    let mut out = Vec::new();
    for _ in 0..CASES {
        let p = params(&mut r);
        for version in [QmdVersion::V03, QmdVersion::V04, QmdVersion::V05] {
            out.push(case(version, &p, &mut r));
        }
    }
    out
}

#[test]
fn builders_and_editors_match_the_golden_digests() {
    let got = digests();
    if std::env::var("APEX_QMD_GOLDEN").as_deref() == Ok("write") {
        let text: String = got.iter().map(|d| format!("{d:016x}\n")).collect();
        std::fs::write(FIXTURE, text).unwrap();
        return;
    }
    // Compiled in: the test binary also runs where the checkout is not (a GPU machine).
    let want: Vec<u64> = include_str!("golden.txt")
        .lines()
        .map(|l| u64::from_str_radix(l, 16).unwrap())
        .collect();
    assert_eq!(got.len(), want.len(), "cases");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            g,
            w,
            "case {i} (parameter set {}, {:?}) changed",
            i / 3,
            [QmdVersion::V03, QmdVersion::V04, QmdVersion::V05][i % 3]
        );
    }
}

/// The generator reaches what the digests are meant to pin: successful builds in every layout, with clusters of
/// both policies, every sync domain and constant bank, releases, prefetches, and both kinds of failure.
#[test]
fn golden_cases_cover_the_parameter_space() {
    let mut r = Rng(0x5eed_0a9e_c0de_0029);
    let mut ok = [0usize; 3];
    let mut err = 0;
    let mut lb = [0usize; 2];
    let mut domains = [0usize; 4];
    let mut banks = [0usize; 8];
    let mut releases = 0;
    let mut prefetches = 0;
    for _ in 0..CASES {
        let p = params(&mut r);
        for (i, version) in [QmdVersion::V03, QmdVersion::V04, QmdVersion::V05]
            .into_iter()
            .enumerate()
        {
            let mut w = [0u32; QMD_WORDS];
            if build(version, &p, &mut w).is_ok() {
                ok[i] += 1;
                if version == QmdVersion::V04 {
                    if p.cluster.is_some() {
                        lb[usize::from(p.cluster_load_balancing)] += 1;
                    }
                    domains[usize::from(p.sync_domain)] += 1;
                    for (b, cb) in banks.iter_mut().zip(p.const_buffers) {
                        *b += usize::from(cb.is_some());
                    }
                    releases += usize::from(p.release.is_some());
                    prefetches += usize::from(p.program_bytes > 0);
                }
            } else {
                err += 1;
            }
            // Draws the editors' arguments as `digests` does, so these are its parameter sets.
            case(version, &p, &mut r);
        }
    }
    assert!(ok.iter().all(|&n| n >= 100), "{ok:?}");
    assert!(err >= 100, "{err}");
    assert!(lb.iter().all(|&n| n >= 5), "{lb:?}");
    assert!(domains.iter().all(|&n| n >= 5), "{domains:?}");
    assert!(banks.iter().all(|&n| n >= 20), "{banks:?}");
    assert!(
        releases >= 20 && prefetches >= 20,
        "{releases} {prefetches}"
    );
    eprintln!("built {ok:?}, failed {err}, policies {lb:?}, domains {domains:?}, banks {banks:?}");
}
