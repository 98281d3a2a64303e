//! QMDs (queue meta data: the compute engine's launch descriptor), one type per layout version, written through
//! the field tables generated from the class headers.
//!
//! V03 is the Ampere/Ada layout (`v03.rs`), V04 Hopper's (`v04.rs`), V05 Blackwell's (`v05.rs`). Hopper silently drops
//! a V03 QMD (see research/hopper-launch.md), so the version must follow the compute class: [`QmdVersion`] and the
//! shared-memory carveouts come from the GPU-generation table, [`crate::hw::generation`].
//!
//! Each layout is a unit type implementing the trait `QmdLayout`: its `build` writes the fields of a [`QmdParams`],
//! and it overrides the editors its layout supports (the chain, graph, gate and prefetch edits are V04's); the trait's
//! default methods answer "not supported" (`Ok(false)`, or `None`) for the rest. The public functions below
//! ([`build`], [`patch_launch`], ...) keep their `version` argument and forward through one dispatch point, the
//! `dispatch!` macro, a `match` from [`QmdVersion`] to the layout type: static dispatch, each editor inlined into
//! its forward as before.
//!
//! Adding a layout version: its field table under `hw::qmd` (generated from the class header), its
//! [`QmdVersion`] variant and the GPU-generation rows that use it in [`crate::hw::generation`], one file here with a
//! unit type implementing `QmdLayout` (its `build`, and whichever editors it supports), and its arm in
//! `dispatch!`. The match there is exhaustive, so a new [`QmdVersion`] variant without an arm does not compile.

use crate::hw::{Field, FieldError, Generation};

pub use crate::hw::generation::QmdVersion;

/// Words of the largest QMD (384 bytes).
pub const QMD_WORDS: usize = 96;

/// A constant bank bound to the launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ConstBuffer {
    /// GPU address of the bank's data.
    pub va: u64,
    /// Bytes of the bank (a multiple of 16).
    pub size: u32,
}

/// Everything a QMD says about one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QmdParams {
    /// SM version as major * 10 + minor (90).
    pub sm_version: u32,
    /// GPU address of the kernel's first instruction.
    pub program_va: u64,
    /// Bytes of the kernel's code from `program_va`: the front end prefetches them into the instruction cache
    /// before the first block starts, as libcuda asks it to (0: no prefetch).
    pub program_bytes: u64,
    /// Registers per thread.
    pub registers: u32,
    /// Named barriers the kernel uses (`bar.sync` ids).
    pub barriers: u32,
    /// Grid size in blocks, x y z.
    pub grid: [u32; 3],
    /// Block size in threads, x y z.
    pub block: [u32; 3],
    /// Shared memory per block: the kernel's static size (with the 1 KiB the compiler reserves) plus dynamic.
    pub shared_bytes: u32,
    /// Local memory (stack) per thread that the context's local-memory buffer provides.
    pub local_bytes_per_thread: u32,
    /// Constant banks 0 to 7 bound to the launch (bank 0: parameters and driver constants).
    pub const_buffers: [Option<ConstBuffer>; 8],
    /// Semaphore written when the grid completes: four words (64-bit payload, then a timestamp).
    pub release: Option<(u64, u64)>,
    /// Thread block cluster shape (sm_90+): the grid runs as clusters of this many blocks per axis, each cluster's
    /// blocks co-scheduled on one GPC. `grid` stays in blocks and must be a multiple of it.
    pub cluster: Option<[u32; 3]>,
    /// Memory synchronization domain (0 to 3; sm_90+), see `LaunchConfig::sync_domain`.
    pub sync_domain: u8,
    /// Clusters' blocks balanced by load instead of multicast to one GPC (`ClusterPolicy::LoadBalancing`).
    pub cluster_load_balancing: bool,
}

/// Memory sync domains a QMD names (a 2-bit field; Hopper and Blackwell have four).
const SYNC_DOMAINS: u8 = 4;

/// `p`'s memory sync domain, refused past the four a QMD names (V04 and V05 write it; V03 has none).
fn sync_domain(p: &QmdParams) -> Result<u8, QmdError> {
    if p.sync_domain >= SYNC_DOMAINS {
        return Err(QmdError {
            field: "SYNC_DOMAIN_ID (0 to 3)",
            value: u64::from(p.sync_domain),
        });
    }
    Ok(p.sync_domain)
}

/// The QMD's grid: in clusters for a cluster launch (libcuda's GRID_WIDTH is 4 for 8 blocks in clusters of 2), in
/// blocks otherwise.
fn qmd_grid(p: &QmdParams) -> Result<[u32; 3], QmdError> {
    let Some(c) = p.cluster else {
        return Ok(p.grid);
    };
    let mut g = p.grid;
    for (i, (g, c)) in g.iter_mut().zip(c).enumerate() {
        if c == 0 || !g.is_multiple_of(c) {
            return Err(QmdError {
                field: ["GPC_CGA_WIDTH", "GPC_CGA_HEIGHT", "GPC_CGA_DEPTH"][i],
                value: u64::from(c),
            });
        }
        *g /= c;
    }
    Ok(g)
}

/// A value did not fit its QMD field.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{field}: {value:#x} does not fit the QMD field; the launch asks for more than the GPU's hardware can encode"
)]
pub struct QmdError {
    /// The QMD field.
    pub field: &'static str,
    /// The value that does not fit.
    pub value: u64,
}

/// `set!(w, v04::FIELD, value)` (or `v04::FIELD(i)` for an indexed field): writes `value` into the field of the
/// layout module's table through [`Writer::set`], naming the field in the error, and returns early with it. The layout
/// files use it (it is defined before their `mod` lines).
macro_rules! set {
    ($w:expr, $m:ident :: $f:ident, $v:expr) => {
        $w.set(stringify!($f), $m::$f, ($v) as u64)?
    };
    ($w:expr, $m:ident :: $f:ident ($i:expr), $v:expr) => {
        $w.set(stringify!($f), $m::$f($i as u32), ($v) as u64)?
    };
}

/// Writes values into a QMD's words through the generated field tables, naming the field of a value that does
/// not fit.
struct Writer<'a> {
    /// The QMD being written.
    words: &'a mut [u32; QMD_WORDS],
}

impl Writer<'_> {
    /// Writes `value` into `field`, or names the field (`name`) and the value when it does not fit.
    fn set(&mut self, name: &'static str, field: Field, value: u64) -> Result<(), QmdError> {
        field.set(self.words, value).map_err(|e| match e {
            FieldError::TooWide { .. } | FieldError::OutOfRange { .. } => {
                QmdError { field: name, value }
            }
        })
    }

    /// The value of `field` (0 for a field outside the words).
    fn get(&self, field: Field) -> u64 {
        field.get(&self.words[..]).unwrap_or(0)
    }
}

/// What every layout's `build` writes from the same derivation of a [`QmdParams`], computed once by [`build`]
/// after its checks.
#[derive(Clone, Copy, Debug)]
struct Common {
    /// SASS_VERSION: the SM version as major << 4 | minor.
    sass: u32,
    /// The grid as the QMD counts it: in clusters for a cluster launch, in blocks otherwise ([`qmd_grid`]).
    grid: [u32; 3],
    /// MIN_SM_CONFIG_SHARED_MEM_SIZE ([`sm_configs`]).
    min_cfg: u32,
    /// TARGET_SM_CONFIG_SHARED_MEM_SIZE ([`sm_configs`]).
    target_cfg: u32,
    /// MAX_SM_CONFIG_SHARED_MEM_SIZE ([`sm_configs`]).
    max_cfg: u32,
}

/// One QMD layout version: how a launch is written in it, and which editors it supports. Implemented by a unit
/// type per version ([`v03::V03`], [`v04::V04`], [`v05::V05`]) and reached through `dispatch!`; every method is an
/// associated function (no `self`), so the dispatch is a `match` and a direct call.
trait QmdLayout {
    /// Writes the fields of `p` into `w`, whose words [`build`] has zeroed after its own checks (SM version in the
    /// generation table, constant banks 64-byte aligned, grid a multiple of the cluster); `c` is what it derived.
    fn build(p: &QmdParams, c: &Common, w: &mut Writer<'_>) -> Result<(), QmdError>;

    /// The word of the release payload's low half, if the layout has one a slot may rewrite alone
    /// ([`release_payload_word`]).
    /// By default: not supported (`None`).
    #[inline]
    fn release_payload_word() -> Option<usize> {
        None
    }

    /// Points a built QMD at another launch ([`patch_launch`]).
    /// By default: not supported, `Ok(false)` with the words untouched.
    #[inline]
    fn patch_launch(
        _words: &mut [u32; QMD_WORDS],
        _cb0_va: u64,
        _payload: Option<u64>,
    ) -> Result<bool, QmdError> {
        Ok(false)
    }

    /// Clears the constant-cache invalidation ([`keep_constant_cache`]).
    /// By default: not supported, `Ok(false)` with the words untouched.
    #[inline]
    fn keep_constant_cache(_words: &mut [u32; QMD_WORDS]) -> Result<bool, QmdError> {
        Ok(false)
    }

    /// Makes the QMD a programmatic producer arriving at `latch` ([`set_latch_arrive`]).
    /// By default: not supported, `Ok(false)` with the words untouched.
    #[inline]
    fn set_latch_arrive(_words: &mut [u32; QMD_WORDS], _latch: u32) -> Result<bool, QmdError> {
        Ok(false)
    }

    /// Makes the QMD a programmatic consumer of `latch` ([`set_latch_wait`]).
    /// By default: not supported, `Ok(false)` with the words untouched.
    #[inline]
    fn set_latch_wait(_words: &mut [u32; QMD_WORDS], _latch: u32) -> Result<bool, QmdError> {
        Ok(false)
    }

    /// Makes an eager launch a possible programmatic producer ([`set_gated_producer`]).
    /// By default: not supported, `Ok(false)` with the words untouched.
    #[inline]
    fn set_gated_producer(
        _words: &mut [u32; QMD_WORDS],
        _gate: u64,
        _latch: u32,
    ) -> Result<bool, QmdError> {
        Ok(false)
    }

    /// Makes the QMD a launch slot's gate ([`set_gate`]).
    /// By default: not supported, `Ok(false)` with the words untouched.
    #[inline]
    fn set_gate(_words: &mut [u32; QMD_WORDS], _next: u64) -> Result<bool, QmdError> {
        Ok(false)
    }

    /// Makes the QMD a link of a chain ([`set_chain_link`]).
    /// By default: not supported, `Ok(false)` with the words untouched.
    #[inline]
    fn set_chain_link(
        _words: &mut [u32; QMD_WORDS],
        _next: Option<(u64, ChainAction)>,
    ) -> Result<bool, QmdError> {
        Ok(false)
    }

    /// Binds bank 0 again as a prefetch bank ([`prefetch_bank0`]).
    /// By default: not supported, `Ok(false)` with the words untouched.
    #[inline]
    fn prefetch_bank0(_words: &mut [u32; QMD_WORDS]) -> Result<bool, QmdError> {
        Ok(false)
    }

    /// Binds the next launch's bank 0 as a prefetch bank ([`prefetch_next_bank`]).
    /// By default: not supported, `Ok(false)` with the words untouched.
    #[inline]
    fn prefetch_next_bank(
        _words: &mut [u32; QMD_WORDS],
        _next: ConstBuffer,
    ) -> Result<bool, QmdError> {
        Ok(false)
    }

    /// Makes the QMD a node of a graph resolved on the GPU ([`set_graph_node`]).
    /// By default: not supported, `Ok(false)` with the words untouched.
    #[inline]
    fn set_graph_node(
        _words: &mut [u32; QMD_WORDS],
        _form: &GraphNodeForm,
    ) -> Result<bool, QmdError> {
        Ok(false)
    }

    /// Prefetches the QMD's own bank 0 before the grid starts ([`prefetch_own_bank0`]).
    /// By default: not supported, `Ok(false)` with the words untouched.
    #[inline]
    fn prefetch_own_bank0(_words: &mut [u32; QMD_WORDS]) -> Result<bool, QmdError> {
        Ok(false)
    }

    /// Makes the QMD a null grid ([`set_null_grid`]).
    /// By default: not supported, `Ok(false)` with the words untouched.
    #[inline]
    fn set_null_grid(_words: &mut [u32; QMD_WORDS]) -> Result<bool, QmdError> {
        Ok(false)
    }
}

/// The one dispatch point from a [`QmdVersion`] to its layout type: `dispatch!(version, L => L::method(args))`
/// evaluates the call with `L` standing for [`v03::V03`], [`v04::V04`] or [`v05::V05`]. Static dispatch (a match
/// and a direct call); a new layout adds its arm here.
macro_rules! dispatch {
    ($version:expr, $l:ident => $call:expr) => {
        match $version {
            QmdVersion::V03 => {
                type $l = v03::V03;
                $call
            }
            QmdVersion::V04 => {
                type $l = v04::V04;
                $call
            }
            QmdVersion::V05 => {
                type $l = v05::V05;
                $call
            }
        }
    };
}

mod v03;
mod v04;
mod v05;

/// Shared-memory carveouts (KiB) the SM can be configured with: the generation table's row for `sm_version`, empty
/// for an SM version the table does not know ([`build`] refuses those).
pub fn shared_carveouts_kib(sm_version: u32) -> &'static [u32] {
    Generation::for_sm(sm_version).map_or(&[], |g| g.carveouts_kib)
}

/// The SM_CONFIG_SHARED_MEM_SIZE encoding of a carveout: KiB / 4 + 1 (228 KiB is 0x3a, as libcuda sends).
pub const fn sm_config(kib: u32) -> u32 {
    kib / 4 + 1
}

/// (min, target, max) shared-memory configurations for a block of `shared_bytes`: the smallest carveout that
/// holds it, a target of at least 32 KiB (libcuda's choice for small kernels), and the largest carveout.
pub fn sm_configs(sm_version: u32, shared_bytes: u32) -> (u32, u32, u32) {
    let carve = shared_carveouts_kib(sm_version);
    let max = *carve.last().unwrap_or(&0);
    let min = carve
        .iter()
        .copied()
        .find(|&k| k * 1024 >= shared_bytes)
        .unwrap_or(max);
    let target = min.max(32.min(max));
    (sm_config(min), sm_config(target), sm_config(max))
}

/// Writes the QMD for `p` in layout `version` into `out` (all other bits zero).
pub fn build(
    version: QmdVersion,
    p: &QmdParams,
    out: &mut [u32; QMD_WORDS],
) -> Result<(), QmdError> {
    out.fill(0);
    if Generation::for_sm(p.sm_version).is_none() {
        // Its carveouts (and SASS version) would be another generation's guess.
        return Err(QmdError {
            field: "SASS_VERSION (an SM version with no row in the GPU-generation table, hw::generation)",
            value: u64::from(p.sm_version),
        });
    }
    // V04 and V05 keep bank addresses in 64-byte units: a misaligned bank would silently be read from the
    // boundary below it.
    if let Some(cb) = p.const_buffers.iter().flatten().find(|cb| cb.va % 64 != 0) {
        return Err(QmdError {
            field: "CONSTANT_BUFFER_ADDR (must be 64-byte aligned)",
            value: cb.va,
        });
    }
    let (min_cfg, target_cfg, max_cfg) = sm_configs(p.sm_version, p.shared_bytes);
    let sass = ((p.sm_version / 10) << 4) | (p.sm_version % 10);
    let grid = qmd_grid(p)?;
    let c = Common {
        sass,
        grid,
        min_cfg,
        target_cfg,
        max_cfg,
    };
    dispatch!(version, L => L::build(p, &c, &mut Writer { words: out }))
}

/// The index of the QMD word holding the low half of the release payload, the high half in the word after it
/// (V04 only): what a launch that reuses a slot's QMD rewrites, and nothing else.
pub fn release_payload_word(version: QmdVersion) -> Option<usize> {
    dispatch!(version, L => L::release_payload_word())
}

/// Points the per-launch fields of a QMD built by [`build`] at another launch: constant bank 0's address
/// and the release payload (the rest of a template stays as built). V04 only; other layouts are rebuilt.
pub fn patch_launch(
    version: QmdVersion,
    words: &mut [u32; QMD_WORDS],
    cb0_va: u64,
    payload: Option<u64>,
) -> Result<bool, QmdError> {
    dispatch!(version, L => L::patch_launch(words, cb0_va, payload))
}

/// Clears the QMD's constant-cache invalidation (V04 only; `Ok(false)` for other layouts), for QMDs whose constant banks
/// stay unchanged between runs, as libcuda's graph nodes are built: each invalidation makes the grid's first
/// constant loads miss. Whoever rewrites such a bank must invalidate the constant cache before the next run.
pub fn keep_constant_cache(
    version: QmdVersion,
    words: &mut [u32; QMD_WORDS],
) -> Result<bool, QmdError> {
    dispatch!(version, L => L::keep_constant_cache(words))
}

/// Makes a chain link a programmatic producer (V04 only; `Ok(false)` otherwise): its dependent may be scheduled
/// once every block has exited or run `griddepcontrol.launch_dependents` (ENABLE_PROGRAM_PRE_EXIT), and the grid
/// arrives at latch `latch` when it completes, which the dependent's `griddepcontrol.wait` waits on. The fields
/// libcuda sets for a programmatic edge of a graph (apex-trace of `probes/pdl.cu`, H100, 580.159.04).
pub fn set_latch_arrive(
    version: QmdVersion,
    words: &mut [u32; QMD_WORDS],
    latch: u32,
) -> Result<bool, QmdError> {
    dispatch!(version, L => L::set_latch_arrive(words, latch))
}

/// Makes a QMD a programmatic consumer of latch `latch` (V04 only; `Ok(false)` otherwise): its
/// `griddepcontrol.wait` returns once the producer has arrived there, with the data and texture caches
/// invalidated, as libcuda builds the consumer of a programmatic graph edge.
pub fn set_latch_wait(
    version: QmdVersion,
    words: &mut [u32; QMD_WORDS],
    latch: u32,
) -> Result<bool, QmdError> {
    dispatch!(version, L => L::set_latch_wait(words, latch))
}

/// Makes an eager launch's QMD a possible programmatic producer (V04 only; `Ok(false)` otherwise), as libcuda
/// builds every launch on a stream (apex-trace of `probes/pdl_stream.cu`, H100, 580.159.04): once every block has
/// exited or run `griddepcontrol.launch_dependents` (ENABLE_PROGRAM_PRE_EXIT) the grid counts down `gate`, the
/// null grid built by [`set_gate`] that schedules the next launch if that one is programmatic; the grid arrives at
/// latch `latch` when it completes, for that launch's `griddepcontrol.wait`. Its own completion release is
/// unchanged, so an ordinary next launch waits for it as before.
pub fn set_gated_producer(
    version: QmdVersion,
    words: &mut [u32; QMD_WORDS],
    gate: u64,
    latch: u32,
) -> Result<bool, QmdError> {
    dispatch!(version, L => L::set_gated_producer(words, gate, latch))
}

/// Makes a QMD built by [`build`] the gate of a launch slot (V04 only; `Ok(false)` otherwise): a null grid with a
/// dependence count of two that schedules the QMD at `next` (the next slot's launch) when both the launch in its own
/// slot has pre-exited and the front end has counted it down (which it does only when that next launch is
/// programmatic), and that re-arms itself from its copy when it has run. libcuda's stream gates carry the same
/// fields (apex-trace of `probes/pdl_stream.cu`).
pub fn set_gate(
    version: QmdVersion,
    words: &mut [u32; QMD_WORDS],
    next: u64,
) -> Result<bool, QmdError> {
    dispatch!(version, L => L::set_gate(words, next))
}

/// Makes a QMD built by [`build`] (with a release) a link of a chain. With `next`, the compute work distributor
/// schedules the QMD at `next` once this grid has completed and its writes are visible GPU-wide (an L1 membar with
/// task chasing); this QMD releases nothing. Without, it is the chain's end: no dependent, its release enabled, and a sysmembar so
/// the CPU sees the grid's writes once it sees the release. The recipe is the one libcuda's graphs use on Hopper.
/// V04 only (returns false for other layouts).
pub fn set_chain_link(
    version: QmdVersion,
    words: &mut [u32; QMD_WORDS],
    next: Option<(u64, ChainAction)>,
) -> Result<bool, QmdError> {
    dispatch!(version, L => L::set_chain_link(words, next))
}

/// How a chained QMD schedules the next one (DEPENDENT_QMD0_ACTION, with prefetch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainAction {
    /// QMD_SCHEDULE: what libcuda's graphs use on Hopper (their QMDs never change between replays).
    Schedule,
    /// QMD_INVALIDATE_COPY_SCHEDULE: the next QMD is fetched afresh, for slots whose QMDs are rewritten.
    InvalidateCopySchedule,
}

/// Binds constant bank 0 a second time as bank 5 with PREFETCH_PRE, unless the kernel binds bank 5 itself (V04 only;
/// returns false otherwise): the work distributor then fetches the launch's parameters and driver words before the
/// grid starts, as libcuda's stream launches ask (their QMDs bind bank 5 at bank 0's address, research
/// hopper-launch.md §5). [`patch_launch`] moves both together.
pub fn prefetch_bank0(version: QmdVersion, words: &mut [u32; QMD_WORDS]) -> Result<bool, QmdError> {
    dispatch!(version, L => L::prefetch_bank0(words))
}

/// Binds `next` (the constant bank 0 of the QMD this one schedules when it completes) as bank 6 with PREFETCH_POST,
/// unless the kernel binds bank 6 itself (V04 only; returns false otherwise): the work distributor fetches it while
/// this grid finishes, as libcuda's graph nodes do for their dependents.
pub fn prefetch_next_bank(
    version: QmdVersion,
    words: &mut [u32; QMD_WORDS],
    next: ConstBuffer,
) -> Result<bool, QmdError> {
    dispatch!(version, L => L::prefetch_next_bank(words, next))
}

/// Makes a QMD built by [`build`] a node of a graph whose dependencies the compute work distributor resolves
/// itself, as libcuda's graphs are built on Hopper (apex-trace of `probes/graph_fan.cu`, H100, 580.159.04): every
/// node but the roots is armed once by a PCAS that copies its counter, then scheduled by its only predecessor or
/// by the last of its fan-in's decrements, and re-arms itself on completion for the next replay. A node with
/// dependents makes its writes visible GPU-wide first (an L1 membar with task chasing); a sink makes them visible
/// to the system, then adds 1 to the graph's completion word. V04 only (returns false for other layouts).
pub fn set_graph_node(
    version: QmdVersion,
    words: &mut [u32; QMD_WORDS],
    form: &GraphNodeForm,
) -> Result<bool, QmdError> {
    dispatch!(version, L => L::set_graph_node(words, form))
}

/// Has the work distributor fetch the QMD's own constant bank 0 before the grid starts (V04 only; `Ok(false)`
/// otherwise): for a node scheduled before its predecessor's completion (a programmatic consumer, started at the
/// predecessor's pre-exit), whose bank a POST prefetch by that predecessor would reach too late. libcuda's
/// programmatic graph nodes carry it.
pub fn prefetch_own_bank0(
    version: QmdVersion,
    words: &mut [u32; QMD_WORDS],
) -> Result<bool, QmdError> {
    dispatch!(version, L => L::prefetch_own_bank0(words))
}

/// Makes a QMD built by [`build`] a null grid (V04 only; returns false otherwise): no blocks, so it completes as
/// soon as it is scheduled and only performs its dependent actions. libcuda spreads a fan-out wider than the two
/// dependents a QMD has over such grids.
pub fn set_null_grid(version: QmdVersion, words: &mut [u32; QMD_WORDS]) -> Result<bool, QmdError> {
    dispatch!(version, L => L::set_null_grid(words))
}

/// What a completed grid does to one of its dependent QMDs (DEPENDENT_QMD_ACTION, with prefetch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DependentAction {
    /// QMD_SCHEDULE: schedules a dependent with no other predecessor.
    Schedule,
    /// QMD_DECREMENT_DEPENDENCE: counts one predecessor of a fan-in down; the dependent is scheduled when its
    /// counter reaches zero.
    Decrement,
}

/// How a node of a graph resolved on the GPU is built (see [`set_graph_node`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphNodeForm {
    /// Up to two dependents, scheduled or counted down when this grid has completed.
    pub dependents: [Option<(u64, DependentAction)>; 2],
    /// DEPENDENCE_COUNTER: the predecessors that count this node down (0 unless it is a fan-in).
    pub counter: u16,
    /// Scheduled by its predecessors rather than sent: the node waits, once armed by a copying PCAS, for them
    /// (REQUIRE_SCHEDULING_PCAS) and re-arms itself when it completes (SELF_COPY_ON_COMPLETION).
    pub armed: bool,
    /// A sink: when the grid has completed and its writes are visible to the CPU, add 1 to the 32-bit word here.
    pub done: Option<u64>,
    /// Constant bank 0 of each dependent that is a launch: bound as banks 5 and 6 (when the kernel leaves them
    /// free) to be prefetched once this grid has completed, as libcuda's graph nodes do.
    pub prefetch: [Option<ConstBuffer>; 2],
}

/// The instructions a QMD prefetches for a program of `bytes` bytes at `va`: a 256-byte-aligned start and a length in
/// 256-byte units, at most the field's 9 bits; `None` for no code.
pub fn program_prefetch_range(va: u64, bytes: u64) -> Option<(u64, u64)> {
    (bytes > 0).then(|| {
        let start = va & !0xff;
        (start, (va + bytes - start).div_ceil(256).min(0x1ff))
    })
}

#[cfg(test)]
mod golden;
#[cfg(test)]
mod tests;
