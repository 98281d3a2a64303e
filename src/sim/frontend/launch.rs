//! The compute work distributor: a QMD scheduled, armed or counted down (PCAS and dependent actions), the
//! checks a QMD must pass to run, the launch recorded, and its releases.

use super::{ChannelModel, mmu};
use crate::rm::sim::{AccessError, SimView};

use super::super::qmd::{self, EnvFault, QMD_WORDS_V04, ReleaseKind};
use super::super::{DroppedQmd, Launch, Records, SimErrorKind};

/// A QMD as the work distributor holds it once armed: its counter and requirement, and the QMD itself as it was
/// when copied. The model runs that copy, not what memory holds later: a QMD rewritten in memory runs as rewritten
/// only once a copying PCAS armed it again (the conservative reading; whether Hopper's self-copy re-reads memory is
/// not known).
#[derive(Debug)]
pub(super) struct Armed {
    counter: u32,
    require: bool,
    words: Vec<u32>,
}

/// Whether and how a scheduled QMD runs.
enum Run {
    /// Not yet (armed and still waiting).
    No,
    /// From memory (a QMD never armed).
    FromMemory,
    /// The armed copy.
    Armed(Vec<u32>),
    /// The copy a PCAS PREFETCH read.
    Prefetched(Vec<u32>),
}

impl ChannelModel {
    /// Performs `event` on the QMD at `qmd_va` and then everything it leads to, in order: a QMD runs once it is
    /// scheduled (not armed, or armed with no requirement and no count left, or counted down to zero), and when it
    /// completes its dependents are scheduled or counted down (DEPENDENT_QMD0, then 1) and it re-arms itself if it
    /// copies itself on completion. A model of the compute work distributor's dependency resolution as libcuda's
    /// graphs use it; the work it leads to is finite or the graph has a cycle, which the hardware would run forever.
    pub(super) fn launch(
        &mut self,
        qmd_va: u64,
        event: Event,
        view: &SimView<'_>,
        now: &dyn Fn() -> u64,
        rec: &mut Records,
    ) -> Result<(), SimErrorKind> {
        const MAX_STEPS: usize = 1 << 22;
        let mut work = std::collections::VecDeque::from([(qmd_va, event)]);
        for _ in 0..MAX_STEPS {
            let Some((va, event)) = work.pop_front() else {
                return Ok(());
            };
            let (words, prefetched) = match self.schedules(va, event, view)? {
                Run::No => continue,
                Run::FromMemory => (
                    view.read_words(va, QMD_WORDS_V04).map_err(mmu("QMD"))?,
                    false,
                ),
                Run::Armed(words) => (words, false),
                Run::Prefetched(words) => (words, true),
            };
            let d = self.launch_one(va, &words, prefetched, view, now, rec)?;
            if d.self_copy {
                // Re-armed from the copy it ran.
                let (counter, require) = qmd::arming(&words);
                self.compute.armed.insert(
                    va,
                    Armed {
                        counter,
                        require,
                        words,
                    },
                );
            }
            for &(dep, kind) in &d.dependents {
                work.push_back((
                    dep,
                    match kind {
                        qmd::DependentKind::Schedule => Event::Schedule { copy: false },
                        qmd::DependentKind::CopySchedule => Event::Schedule { copy: true },
                        qmd::DependentKind::Decrement => Event::Decrement,
                    },
                ));
            }
        }
        Err(SimErrorKind::BadQmd {
            qmd_va,
            violation: qmd::QmdViolation::State("the dependent QMDs it leads to do not end"),
        })
    }

    /// Applies `event` to the QMD at `va`'s armed state; whether (and which copy of it) runs now.
    fn schedules(
        &mut self,
        va: u64,
        event: Event,
        view: &SimView<'_>,
    ) -> Result<Run, SimErrorKind> {
        let bad = |why| SimErrorKind::BadQmd {
            qmd_va: va,
            violation: qmd::QmdViolation::State(why),
        };
        qmd::check_address(va).map_err(|v| SimErrorKind::BadQmd {
            qmd_va: va,
            violation: v,
        })?;
        let arm = |armed: &mut std::collections::HashMap<u64, Armed>, force: bool| {
            view.read_words(va, QMD_WORDS_V04)
                .map_err(mmu("QMD"))
                .map(|words| {
                    let (counter, require) = qmd::arming(&words);
                    armed.insert(
                        va,
                        Armed {
                            counter,
                            require: require || force,
                            words,
                        },
                    );
                })
        };
        // A copying schedule (an inline QMD's too) reads memory afresh: a copy read ahead is gone.
        if matches!(
            event,
            Event::HostSchedule { copy: true, .. } | Event::Schedule { copy: true }
        ) {
            self.compute.prefetched.remove(&va);
        }
        let armed = &mut self.compute.armed;
        let runs = match event {
            Event::HostSchedule {
                copy,
                force_require,
            } => {
                if copy {
                    arm(armed, force_require)?;
                }
                // A host PCAS schedules a QMD only when nothing else must: no requirement, no count.
                armed.get(&va).is_none_or(|a| a.counter == 0 && !a.require)
            }
            Event::Schedule { copy } => {
                if copy {
                    arm(armed, false)?;
                }
                armed.get(&va).is_none_or(|a| a.counter == 0)
            }
            Event::Decrement => {
                self.stats.decrements += 1;
                let Some(state) = armed.get_mut(&va) else {
                    return Err(bad("DECREMENT_DEPENDENCE on a QMD no copying PCAS armed"));
                };
                if state.counter == 0 {
                    return Err(bad("DECREMENT_DEPENDENCE below zero"));
                }
                state.counter -= 1;
                state.counter == 0
            }
        };
        if !runs {
            return Ok(Run::No);
        }
        if let Some(a) = armed.remove(&va) {
            return Ok(Run::Armed(a.words));
        }
        // Not armed: a copy a PREFETCH read runs instead of memory. Memory rewritten since is an error here: the
        // hardware would run the stale copy without a word.
        if let Some(words) = self.compute.prefetched.get(&va) {
            let now = view.read_words(va, QMD_WORDS_V04).map_err(mmu("QMD"))?;
            if now != *words {
                return Err(bad(
                    "rewritten in memory after a PCAS PREFETCH read it ahead of its launch: the copy read \
                     then would run",
                ));
            }
            self.stats.prefetched_runs += 1;
            return Ok(Run::Prefetched(words.clone()));
        }
        Ok(Run::FromMemory)
    }

    /// Validates the QMD at `qmd_va` like Hopper and, if it would run, records it and performs its releases; returns
    /// the QMD it schedules next.
    fn launch_one(
        &mut self,
        qmd_va: u64,
        words: &[u32],
        prefetched: bool,
        view: &SimView<'_>,
        now: &dyn Fn() -> u64,
        rec: &mut Records,
    ) -> Result<qmd::QmdDesc, SimErrorKind> {
        let bad = |violation| SimErrorKind::BadQmd { qmd_va, violation };
        qmd::check_address(qmd_va).map_err(bad)?;
        let major = qmd::major_version(words);
        if major == 3 {
            // Hopper drops a V03 QMD without an error: nothing runs and nothing is released.
            self.stats.dropped_qmds += 1;
            rec.dropped.push(DroppedQmd {
                token: self.ch.token,
                qmd_va,
                major_version: major as u8,
            });
            return Ok(qmd::QmdDesc {
                dependents: Vec::new(),
                self_copy: false,
                ..qmd::QmdDesc::null()
            });
        }
        let d = qmd::check_fields(words, self.sm_version).map_err(bad)?;
        if d.null {
            self.stats.null_grids += 1;
            for r in &d.releases {
                release(view, r, now)?;
            }
            return Ok(d);
        }
        qmd::check_environment(&d, &self.compute.launch, view).map_err(|e| match e {
            EnvFault::Address { what, va, len } => SimErrorKind::Mmu {
                what,
                source: AccessError::Unmapped { va, len },
            },
            EnvFault::Violation(v) => bad(v),
        })?;
        let (cb0, cb0_size) = d.const_banks[0].unwrap_or_default();
        let mut params =
            vec![0u8; (cb0_size as usize).saturating_sub(crate::launch::cbank::DRIVER_BYTES)];
        view.read(cb0 + crate::launch::cbank::DRIVER_BYTES as u64, &mut params)
            .map_err(mmu("constant bank 0"))?;
        let mut driver = vec![0u8; crate::launch::cbank::DRIVER_BYTES.min(cb0_size as usize)];
        view.read(cb0, &mut driver)
            .map_err(mmu("constant bank 0"))?;
        if let Some(l) = d.wait_latch
            && !self.compute.latches.contains(&l)
        {
            return Err(bad(qmd::QmdViolation::State(
                "WAIT_ON_LATCH names a latch no earlier grid of the channel arrived at: it would wait forever",
            )));
        }
        for r in &d.releases {
            release(view, r, now)?;
        }
        if let Some(l) = d.arrive_latch {
            self.compute.latches.insert(l);
        }
        self.stats.launches += 1;
        rec.launches.push(Launch {
            token: self.ch.token,
            qmd_va,
            grid: d.grid,
            cluster: d.cluster,
            block: d.block,
            shared_bytes: d.shared_bytes,
            registers: d.registers,
            barriers: d.barriers,
            program_va: d.program_va,
            local_bytes_per_thread: d.local_bytes_per_thread,
            cbank0_va: cb0,
            cbank0_size: cb0_size as u32,
            params,
            driver_words: driver
                .chunks_exact(4)
                .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
                .collect(),
            releases: d.releases.iter().map(|r| (r.va, r.payload)).collect(),
            latch_arrive: d.arrive_latch,
            latch_wait: d.wait_latch,
            qmd: words.to_vec(),
            prefetched,
        });
        Ok(d)
    }
}

/// What reaches a QMD: a PCAS from the host (copying or not), a predecessor's schedule or decrement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Event {
    HostSchedule { copy: bool, force_require: bool },
    Schedule { copy: bool },
    Decrement,
}

/// Performs one release of a completed QMD.
fn release(
    view: &SimView<'_>,
    r: &qmd::ReleaseDesc,
    now: &dyn Fn() -> u64,
) -> Result<(), SimErrorKind> {
    let res = match r.kind {
        ReleaseKind::FourWords { payload64 } => {
            let first = if payload64 {
                view.write_u64(r.va, r.payload)
            } else {
                view.write_u32(r.va, r.payload as u32)
            };
            first.and_then(|()| view.write_u64(r.va + 8, now()))
        }
        ReleaseKind::OneWord => view.write_u32(r.va, r.payload as u32),
        ReleaseKind::AddOneWord => view
            .read_words(r.va, 1)
            .and_then(|w| view.write_u32(r.va, w[0].wrapping_add(r.payload as u32))),
        ReleaseKind::TwoWords => view.write_u64(r.va, r.payload),
    };
    res.map_err(mmu("QMD release semaphore"))
}
