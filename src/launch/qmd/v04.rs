//! The V04 QMD layout (Hopper, sm_90: compute class cbc0): its builder, and every editor the launch
//! paths use (patching a template for another launch, chains, graph nodes resolved on the GPU, stream gates,
//! programmatic dependent launch, constant-bank prefetches), with the fields libcuda sets for each.

use super::{
    ChainAction, Common, ConstBuffer, DependentAction, GraphNodeForm, QMD_WORDS, QmdError,
    QmdLayout, QmdParams, Writer, program_prefetch_range, sync_domain,
};
use crate::hw::Field;
use crate::hw::qmd::v04;

/// The V04 layout (Hopper).
pub(super) struct V04;

/// The constant bank [`super::prefetch_bank0`] binds bank 0 again as.
const PREFETCH_BANK: u32 = 5;

/// The constant bank [`super::prefetch_next_bank`] binds the next launch's bank 0 as.
const NEXT_BANK: u32 = 6;

/// Runs `edit` on a V04 QMD's fields; `Ok(true)` once it has.
#[inline]
fn edit(
    words: &mut [u32; QMD_WORDS],
    edit: impl FnOnce(&mut Writer<'_>) -> Result<(), QmdError>,
) -> Result<bool, QmdError> {
    edit(&mut Writer { words })?;
    Ok(true)
}

/// V04's constant-bank fields.
impl Writer<'_> {
    /// Binds `cb` as V04 constant bank `i`, with prefetch mode `prefetch` (a CONSTANT_BUFFER_PREFETCH value).
    fn bind_bank(&mut self, i: u32, cb: ConstBuffer, prefetch: u32) -> Result<(), QmdError> {
        set!(self, v04::CONSTANT_BUFFER_VALID(i), 1);
        self.set_bank_address(i, cb.va)?;
        set!(
            self,
            v04::CONSTANT_BUFFER_SIZE_SHIFTED4(i),
            cb.size.div_ceil(16)
        );
        set!(self, v04::CONSTANT_BUFFER_PREFETCH(i), prefetch);
        Ok(())
    }

    /// Binds `cb` as bank `i` for prefetch only, unless the kernel binds bank `i` itself.
    fn bind_prefetch(&mut self, i: u32, cb: ConstBuffer, prefetch: u32) -> Result<(), QmdError> {
        if self.get(v04::CONSTANT_BUFFER_VALID(i)) == 0 {
            self.bind_bank(i, cb, prefetch)?;
        }
        Ok(())
    }

    /// Points V04 constant bank `i` at `va` (kept in 64-byte units).
    fn set_bank_address(&mut self, i: u32, va: u64) -> Result<(), QmdError> {
        set!(
            self,
            v04::CONSTANT_BUFFER_ADDR_LOWER_SHIFTED6(i),
            (va >> 6) & 0xffff_ffff
        );
        set!(self, v04::CONSTANT_BUFFER_ADDR_UPPER_SHIFTED6(i), va >> 38);
        Ok(())
    }

    /// V04 constant bank `i` as bound, if it is.
    fn bank(&self, i: u32) -> Option<ConstBuffer> {
        (self.get(v04::CONSTANT_BUFFER_VALID(i)) != 0).then(|| ConstBuffer {
            va: ((self.get(v04::CONSTANT_BUFFER_ADDR_UPPER_SHIFTED6(i)) << 32)
                | self.get(v04::CONSTANT_BUFFER_ADDR_LOWER_SHIFTED6(i)))
                << 6,
            size: (self.get(v04::CONSTANT_BUFFER_SIZE_SHIFTED4(i)) * 16) as u32,
        })
    }
}

/// Hopper's builder, and every editor.
impl QmdLayout for V04 {
    #[inline]
    fn build(p: &QmdParams, c: &Common, w: &mut Writer<'_>) -> Result<(), QmdError> {
        let Common {
            sass,
            grid,
            min_cfg,
            target_cfg,
            max_cfg,
        } = *c;
        set!(w, v04::QMD_GROUP_ID, 0x3f);
        set!(w, v04::QMD_TYPE, v04::QMD_TYPE_GRID_CTA);
        if let Some(c) = p.cluster {
            // What libcuda sets for cluster launches on Hopper (apex-trace of probes/cluster_launch.cu): a GPC
            // CGA grid, the cluster shape, multicast distribution, the grid counted in clusters.
            set!(w, v04::QMD_TYPE, v04::QMD_TYPE_GRID_GPC_CGA);
            set!(w, v04::GPC_CGA_WIDTH, c[0]);
            set!(w, v04::GPC_CGA_HEIGHT, c[1]);
            set!(w, v04::GPC_CGA_DEPTH, c[2]);
            set!(
                w,
                v04::CGA_CTA_DISTRIBUTION_MODE,
                if p.cluster_load_balancing {
                    v04::CGA_CTA_DISTRIBUTION_MODE_LOAD_BALANCING
                } else {
                    v04::CGA_CTA_DISTRIBUTION_MODE_MULTI_CAST
                }
            );
        }
        // libcuda writes the domain after its map (apex-trace of probes/launch_attrs.cu, H100, driver 580:
        // NCCL's "remote" domain is SYNC_DOMAIN_ID 1, the default domain leaves the field 0).
        set!(w, v04::SYNC_DOMAIN_ID, sync_domain(p)?);
        set!(w, v04::QMD_MAJOR_VERSION, 4);
        set!(w, v04::QMD_MINOR_VERSION, 0);
        set!(w, v04::SASS_VERSION, sass);
        set!(
            w,
            v04::API_VISIBLE_CALL_LIMIT,
            v04::API_VISIBLE_CALL_LIMIT_NO_CHECK
        );
        set!(w, v04::SAMPLER_INDEX, v04::SAMPLER_INDEX_VIA_HEADER_INDEX);
        set!(w, v04::INVALIDATE_TEXTURE_HEADER_CACHE, 1);
        set!(w, v04::INVALIDATE_TEXTURE_SAMPLER_CACHE, 1);
        set!(w, v04::INVALIDATE_TEXTURE_DATA_CACHE, 1);
        set!(w, v04::INVALIDATE_SHADER_DATA_CACHE, 1);
        set!(w, v04::INVALIDATE_SHADER_CONSTANT_CACHE, 1);
        set!(w, v04::CWD_MEMBAR_TYPE, v04::CWD_MEMBAR_TYPE_L1_SYSMEMBAR);
        set!(w, v04::SHARED_MEMORY_SIZE, p.shared_bytes);
        set!(w, v04::MIN_SM_CONFIG_SHARED_MEM_SIZE, min_cfg);
        set!(w, v04::TARGET_SM_CONFIG_SHARED_MEM_SIZE, target_cfg);
        set!(w, v04::MAX_SM_CONFIG_SHARED_MEM_SIZE, max_cfg);
        set!(
            w,
            v04::SHADER_LOCAL_MEMORY_HIGH_SIZE,
            p.local_bytes_per_thread
        );
        set!(w, v04::GRID_WIDTH, grid[0]);
        set!(w, v04::GRID_HEIGHT, grid[1]);
        set!(w, v04::GRID_DEPTH, grid[2]);
        set!(w, v04::CTA_THREAD_DIMENSION0, p.block[0]);
        set!(w, v04::CTA_THREAD_DIMENSION1, p.block[1]);
        set!(w, v04::CTA_THREAD_DIMENSION2, p.block[2]);
        set!(w, v04::REGISTER_COUNT, p.registers);
        set!(w, v04::BARRIER_COUNT, p.barriers);
        set!(w, v04::PROGRAM_ADDRESS_LOWER, p.program_va & 0xffff_ffff);
        set!(w, v04::PROGRAM_ADDRESS_UPPER, p.program_va >> 32);
        set!(w, v04::ENABLE_PROGRAM_PRE_EXIT, 1);
        if let Some((start, units)) = program_prefetch_range(p.program_va, p.program_bytes) {
            set!(
                w,
                v04::PROGRAM_PREFETCH_ADDR_LOWER_SHIFTED,
                (start >> 8) & 0xffff_ffff
            );
            set!(w, v04::PROGRAM_PREFETCH_ADDR_UPPER_SHIFTED, start >> 40);
            set!(w, v04::PROGRAM_PREFETCH_SIZE, units);
        }
        for (i, cb) in (0u32..).zip(p.const_buffers) {
            if let Some(cb) = cb {
                w.bind_bank(i, cb, v04::CONSTANT_BUFFER_PREFETCH_PREFETCH_NONE)?;
            }
        }
        if let Some((va, payload)) = p.release {
            set!(w, v04::RELEASE_ENABLE(0), 1);
            set!(
                w,
                v04::RELEASE_STRUCTURE_SIZE(0),
                v04::RELEASE_STRUCTURE_SIZE_SEMAPHORE_FOUR_WORDS
            );
            set!(w, v04::RELEASE_PAYLOAD64B(0), 1);
            set!(w, v04::RELEASE_SEMAPHORE0_ADDR_LOWER, va & 0xffff_ffff);
            set!(w, v04::RELEASE_SEMAPHORE0_ADDR_UPPER, va >> 32);
            set!(
                w,
                v04::RELEASE_SEMAPHORE0_PAYLOAD_LOWER,
                payload & 0xffff_ffff
            );
            set!(w, v04::RELEASE_SEMAPHORE0_PAYLOAD_UPPER, payload >> 32);
        }
        Ok(())
    }

    /// [`super::release_payload_word`] on a V04 QMD.
    #[inline]
    fn release_payload_word() -> Option<usize> {
        let (lo, hi) = (
            v04::RELEASE_SEMAPHORE0_PAYLOAD_LOWER,
            v04::RELEASE_SEMAPHORE0_PAYLOAD_UPPER,
        );
        let whole_word = |f: Field| f.lo.is_multiple_of(32) && f.width() == 32;
        (whole_word(lo) && whole_word(hi) && hi.lo == lo.lo + 32).then_some((lo.lo / 32) as usize)
    }

    /// [`super::patch_launch`] on a V04 QMD.
    #[inline]
    fn patch_launch(
        words: &mut [u32; QMD_WORDS],
        cb0_va: u64,
        payload: Option<u64>,
    ) -> Result<bool, QmdError> {
        edit(words, |w| {
            // Bank 5 follows bank 0 when it is bank 0's prefetch ([`prefetch_bank0`]).
            let follows = w.get(v04::CONSTANT_BUFFER_PREFETCH(PREFETCH_BANK))
                == u64::from(v04::CONSTANT_BUFFER_PREFETCH_PREFETCH_PRE)
                && w.bank(PREFETCH_BANK) == w.bank(0);
            w.set_bank_address(0, cb0_va)?;
            if follows {
                w.set_bank_address(PREFETCH_BANK, cb0_va)?;
            }
            if let Some(payload) = payload {
                set!(
                    w,
                    v04::RELEASE_SEMAPHORE0_PAYLOAD_LOWER,
                    payload & 0xffff_ffff
                );
                set!(w, v04::RELEASE_SEMAPHORE0_PAYLOAD_UPPER, payload >> 32);
            }
            Ok(())
        })
    }

    /// [`super::keep_constant_cache`] on a V04 QMD.
    #[inline]
    fn keep_constant_cache(words: &mut [u32; QMD_WORDS]) -> Result<bool, QmdError> {
        edit(words, |w| {
            set!(w, v04::INVALIDATE_SHADER_CONSTANT_CACHE, 0);
            Ok(())
        })
    }

    /// [`super::set_latch_arrive`] on a V04 QMD.
    #[inline]
    fn set_latch_arrive(words: &mut [u32; QMD_WORDS], latch: u32) -> Result<bool, QmdError> {
        edit(words, |w| {
            set!(w, v04::ENABLE_PROGRAM_PRE_EXIT, 1);
            set!(w, v04::ARRIVE_AT_LATCH_VALID, 1);
            set!(w, v04::ARRIVE_AT_LATCH_ID, latch);
            Ok(())
        })
    }

    /// [`super::set_latch_wait`] on a V04 QMD.
    #[inline]
    fn set_latch_wait(words: &mut [u32; QMD_WORDS], latch: u32) -> Result<bool, QmdError> {
        edit(words, |w| {
            set!(w, v04::WAIT_ON_LATCH_VALID, 1);
            set!(w, v04::WAIT_ON_LATCH_ID, latch);
            set!(w, v04::REQUIRE_SCHEDULING_PCAS, 1);
            set!(w, v04::LATCH_ACQUIRE_INVALIDATE_SHADER_DATA_CACHE, 1);
            set!(w, v04::LATCH_ACQUIRE_INVALIDATE_TEXTURE_DATA_CACHE, 1);
            Ok(())
        })
    }

    /// [`super::set_gated_producer`] on a V04 QMD.
    #[inline]
    fn set_gated_producer(
        words: &mut [u32; QMD_WORDS],
        gate: u64,
        latch: u32,
    ) -> Result<bool, QmdError> {
        if !Self::set_latch_arrive(words, latch)? {
            return Ok(false);
        }
        edit(words, |w| {
            set!(w, v04::DEPENDENT_QMD_ENABLE(0), 1);
            set!(
                w,
                v04::DEPENDENT_QMD_ACTION(0),
                v04::DEPENDENT_QMD_ACTION_QMD_DECREMENT_DEPENDENCE
            );
            set!(w, v04::DEPENDENT_QMD_PREFETCH(0), 1);
            set!(w, v04::DEPENDENT_QMD0_POINTER, gate >> 8);
            Ok(())
        })
    }

    /// [`super::set_gate`] on a V04 QMD.
    #[inline]
    fn set_gate(words: &mut [u32; QMD_WORDS], next: u64) -> Result<bool, QmdError> {
        if !Self::set_null_grid(words)? {
            return Ok(false);
        }
        edit(words, |w| {
            for i in 0..2 {
                set!(w, v04::RELEASE_ENABLE(i), 0);
            }
            set!(w, v04::DEPENDENT_QMD_ENABLE(0), 1);
            set!(
                w,
                v04::DEPENDENT_QMD_ACTION(0),
                v04::DEPENDENT_QMD_ACTION_QMD_SCHEDULE
            );
            set!(w, v04::DEPENDENT_QMD_PREFETCH(0), 0);
            set!(w, v04::DEPENDENT_QMD0_POINTER, next >> 8);
            set!(w, v04::DEPENDENT_QMD_ENABLE(1), 0);
            set!(w, v04::DEPENDENCE_COUNTER, 2);
            set!(w, v04::SELF_COPY_ON_COMPLETION, 1);
            set!(w, v04::REQUIRE_SCHEDULING_PCAS, 0);
            set!(w, v04::ENABLE_PROGRAM_PRE_EXIT, 0);
            set!(w, v04::ARRIVE_AT_LATCH_VALID, 0);
            set!(w, v04::WAIT_ON_LATCH_VALID, 0);
            set!(w, v04::CWD_MEMBAR_TYPE, v04::CWD_MEMBAR_TYPE_L1_NONE);
            Ok(())
        })
    }

    /// [`super::set_chain_link`] on a V04 QMD.
    #[inline]
    fn set_chain_link(
        words: &mut [u32; QMD_WORDS],
        next: Option<(u64, ChainAction)>,
    ) -> Result<bool, QmdError> {
        edit(words, |w| {
            match next {
                Some((va, action)) => {
                    let action = match action {
                        ChainAction::Schedule => v04::DEPENDENT_QMD_ACTION_QMD_SCHEDULE,
                        ChainAction::InvalidateCopySchedule => {
                            v04::DEPENDENT_QMD_ACTION_QMD_INVALIDATE_COPY_SCHEDULE
                        }
                    };
                    set!(w, v04::DEPENDENT_QMD_ENABLE(0), 1);
                    set!(w, v04::DEPENDENT_QMD_ACTION(0), action);
                    set!(w, v04::DEPENDENT_QMD_PREFETCH(0), 1);
                    set!(w, v04::DEPENDENT_QMD0_POINTER, va >> 8);
                    set!(w, v04::RELEASE_ENABLE(0), 0);
                    set!(w, v04::CWD_MEMBAR_TYPE, v04::CWD_MEMBAR_TYPE_L1_MEMBAR);
                    set!(w, v04::CWD_MEMBAR_TASK_CHASING_ENABLE, 1);
                    // Pre-exit would let the next grid be scheduled once every block has exited, before this grid's writes
                    // are known to be visible: programmatic dependent launch, for consumers that wait for their producer
                    // themselves (griddepcontrol.wait). libcuda's graph nodes leave it off, and so does an ordinary link
                    // (measured on the H100: with it, a chain of empty kernels ran at 0.57 µs per link, without 0.84 µs).
                    set!(w, v04::ENABLE_PROGRAM_PRE_EXIT, 0);
                }
                None => {
                    set!(w, v04::DEPENDENT_QMD_ENABLE(0), 0);
                    set!(w, v04::DEPENDENT_QMD_ACTION(0), 0);
                    set!(w, v04::DEPENDENT_QMD_PREFETCH(0), 0);
                    set!(w, v04::DEPENDENT_QMD0_POINTER, 0);
                    set!(w, v04::RELEASE_ENABLE(0), 1);
                    set!(w, v04::CWD_MEMBAR_TYPE, v04::CWD_MEMBAR_TYPE_L1_SYSMEMBAR);
                    set!(w, v04::CWD_MEMBAR_TASK_CHASING_ENABLE, 0);
                    // As `build` leaves it (and libcuda's stream launches): with no dependent it changes nothing.
                    set!(w, v04::ENABLE_PROGRAM_PRE_EXIT, 1);
                }
            }
            Ok(())
        })
    }

    /// [`super::prefetch_bank0`] on a V04 QMD.
    #[inline]
    fn prefetch_bank0(words: &mut [u32; QMD_WORDS]) -> Result<bool, QmdError> {
        edit(words, |w| match w.bank(0) {
            Some(cb0) => w.bind_prefetch(
                PREFETCH_BANK,
                cb0,
                v04::CONSTANT_BUFFER_PREFETCH_PREFETCH_PRE,
            ),
            None => Ok(()),
        })
    }

    /// [`super::prefetch_next_bank`] on a V04 QMD.
    #[inline]
    fn prefetch_next_bank(
        words: &mut [u32; QMD_WORDS],
        next: ConstBuffer,
    ) -> Result<bool, QmdError> {
        edit(words, |w| {
            w.bind_prefetch(NEXT_BANK, next, v04::CONSTANT_BUFFER_PREFETCH_PREFETCH_POST)
        })
    }

    /// [`super::set_graph_node`] on a V04 QMD.
    #[inline]
    fn set_graph_node(
        words: &mut [u32; QMD_WORDS],
        form: &GraphNodeForm,
    ) -> Result<bool, QmdError> {
        edit(words, |w| {
            let slots = [
                (v04::DEPENDENT_QMD0_POINTER, form.dependents[0]),
                (v04::DEPENDENT_QMD1_POINTER, form.dependents[1]),
            ];
            for (i, (pointer, dep)) in (0u32..).zip(slots) {
                let (va, action) = match dep {
                    Some((va, DependentAction::Schedule)) => {
                        (va, v04::DEPENDENT_QMD_ACTION_QMD_SCHEDULE)
                    }
                    Some((va, DependentAction::Decrement)) => {
                        (va, v04::DEPENDENT_QMD_ACTION_QMD_DECREMENT_DEPENDENCE)
                    }
                    None => (0, 0),
                };
                let on = u64::from(dep.is_some());
                set!(w, v04::DEPENDENT_QMD_ENABLE(i), on);
                set!(w, v04::DEPENDENT_QMD_ACTION(i), action);
                set!(w, v04::DEPENDENT_QMD_PREFETCH(i), on);
                w.set("DEPENDENT_QMD_POINTER", pointer, va >> 8)?;
            }
            let chases = form.dependents.iter().any(Option::is_some);
            set!(
                w,
                v04::CWD_MEMBAR_TYPE,
                if form.done.is_some() {
                    v04::CWD_MEMBAR_TYPE_L1_SYSMEMBAR
                } else if chases {
                    v04::CWD_MEMBAR_TYPE_L1_MEMBAR
                } else {
                    v04::CWD_MEMBAR_TYPE_L1_NONE
                }
            );
            set!(w, v04::CWD_MEMBAR_TASK_CHASING_ENABLE, u64::from(chases));
            // Pre-exit is programmatic launch ([`set_latch_arrive`] sets it for a producer whose consumer waits itself).
            set!(w, v04::ENABLE_PROGRAM_PRE_EXIT, 0);
            for (i, bank) in (5u32..).zip(form.prefetch) {
                if let Some(cb) = bank {
                    w.bind_prefetch(i, cb, v04::CONSTANT_BUFFER_PREFETCH_PREFETCH_POST)?;
                }
            }
            // A root's own bank is fetched before it starts (the others' were prefetched by their predecessors).
            if !form.armed {
                set!(
                    w,
                    v04::CONSTANT_BUFFER_PREFETCH(0),
                    v04::CONSTANT_BUFFER_PREFETCH_PREFETCH_PRE
                );
            }
            set!(w, v04::DEPENDENCE_COUNTER, form.counter);
            set!(w, v04::REQUIRE_SCHEDULING_PCAS, u64::from(form.armed));
            set!(w, v04::SELF_COPY_ON_COMPLETION, u64::from(form.armed));
            match form.done {
                Some(va) => {
                    set!(w, v04::RELEASE_ENABLE(0), 1);
                    set!(
                        w,
                        v04::RELEASE_STRUCTURE_SIZE(0),
                        v04::RELEASE_STRUCTURE_SIZE_SEMAPHORE_ONE_WORD
                    );
                    set!(w, v04::RELEASE_PAYLOAD64B(0), 0);
                    set!(w, v04::RELEASE_REDUCTION_ENABLE(0), 1);
                    set!(
                        w,
                        v04::RELEASE_REDUCTION_OP(0),
                        v04::RELEASE_REDUCTION_OP_RED_ADD
                    );
                    set!(
                        w,
                        v04::RELEASE_REDUCTION_FORMAT(0),
                        v04::RELEASE_REDUCTION_FORMAT_UNSIGNED
                    );
                    set!(w, v04::RELEASE_SEMAPHORE0_ADDR_LOWER, va & 0xffff_ffff);
                    set!(w, v04::RELEASE_SEMAPHORE0_ADDR_UPPER, va >> 32);
                    set!(w, v04::RELEASE_SEMAPHORE0_PAYLOAD_LOWER, 1);
                    set!(w, v04::RELEASE_SEMAPHORE0_PAYLOAD_UPPER, 0);
                }
                None => set!(w, v04::RELEASE_ENABLE(0), 0),
            }
            Ok(())
        })
    }

    /// [`super::prefetch_own_bank0`] on a V04 QMD.
    #[inline]
    fn prefetch_own_bank0(words: &mut [u32; QMD_WORDS]) -> Result<bool, QmdError> {
        edit(words, |w| {
            set!(
                w,
                v04::CONSTANT_BUFFER_PREFETCH(0),
                v04::CONSTANT_BUFFER_PREFETCH_PREFETCH_PRE
            );
            Ok(())
        })
    }

    /// [`super::set_null_grid`] on a V04 QMD.
    #[inline]
    fn set_null_grid(words: &mut [u32; QMD_WORDS]) -> Result<bool, QmdError> {
        edit(words, |w| {
            set!(w, v04::GRID_WIDTH, 0);
            set!(w, v04::GRID_HEIGHT, 0);
            set!(w, v04::GRID_DEPTH, 0);
            set!(w, v04::PROGRAM_PREFETCH_SIZE, 0);
            Ok(())
        })
    }
}
