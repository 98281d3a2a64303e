//! The compute class's methods: inline uploads, shader memory windows and local memory, versions, cache
//! invalidation, inline QMDs and PCAS (send, prefetch, invalidate, decrement).

use super::super::headers::cbc0 as compute;
use super::decode::Method;
use super::launch::Event;
use super::{ChannelModel, Flow, mmu, set_lower, set_upper};
use crate::rm::sim::SimView;

use super::super::qmd::{self, QMD_WORDS_V04};
use super::super::{Records, SimErrorKind};

#[derive(Debug)]
pub(super) struct Inline {
    dst: u64,
    bytes: usize,
    data: Vec<u8>,
}

#[derive(Debug, Default)]
pub(super) struct InlineQmd {
    /// The address's upper bits and the inline size, from `_A`.
    upper: Option<(u64, usize)>,
    va: Option<u64>,
    words: Vec<u32>,
}

impl ChannelModel {
    pub(super) fn compute_method(
        &mut self,
        m: &Method,
        view: &SimView<'_>,
        now: &dyn Fn() -> u64,
        rec: &mut Records,
    ) -> Result<Flow, SimErrorKind> {
        let v = m.value;
        let c = &mut self.compute;
        match m.offset {
            compute::NO_OPERATION | compute::WAIT_FOR_IDLE => {}
            compute::LINE_LENGTH_IN => c.line_length = v,
            compute::LINE_COUNT => c.line_count = v,
            compute::OFFSET_OUT_UPPER => {
                set_upper(&mut c.offset_out, compute::OFFSET_OUT_UPPER_VALUE.unpack(v))
            }
            compute::OFFSET_OUT => set_lower(&mut c.offset_out, v),
            compute::LAUNCH_DMA => {
                let bad = |why| Err(SimErrorKind::BadInlineUpload { why });
                if compute::LAUNCH_DMA_DST_MEMORY_LAYOUT.unpack(v)
                    != compute::LAUNCH_DMA_DST_MEMORY_LAYOUT_PITCH
                {
                    return bad("block-linear destinations are not modelled");
                }
                if compute::LAUNCH_DMA_COMPLETION_TYPE.unpack(v)
                    == compute::LAUNCH_DMA_COMPLETION_TYPE_RELEASE_SEMAPHORE
                    || compute::LAUNCH_DMA_REDUCTION_ENABLE.unpack(v) != 0
                {
                    return bad("semaphore completion and reductions are not modelled");
                }
                if c.line_count != 1 {
                    return bad(
                        "LINE_COUNT must be 1 (pitched multi-line copies are not modelled)",
                    );
                }
                if c.inline.is_some() {
                    return bad("LAUNCH_DMA before the previous upload's data arrived");
                }
                c.inline = Some(Inline {
                    dst: c.offset_out,
                    bytes: c.line_length as usize,
                    data: Vec::with_capacity(c.line_length as usize),
                });
            }
            compute::LOAD_INLINE_DATA => {
                let Some(up) = c.inline.as_mut() else {
                    return Err(SimErrorKind::BadInlineUpload {
                        why: "LOAD_INLINE_DATA with no upload in progress",
                    });
                };
                up.data.extend_from_slice(&v.to_le_bytes());
                if up.data.len() >= up.bytes {
                    up.data.truncate(up.bytes);
                    view.write(up.dst, &up.data)
                        .map_err(mmu("inline upload destination"))?;
                    c.inline = None;
                    self.stats.inline_uploads += 1;
                }
            }
            compute::SET_SHADER_SHARED_MEMORY_WINDOW_A => set_upper(
                &mut c.launch.shared_window,
                compute::SET_SHADER_SHARED_MEMORY_WINDOW_A_BASE_ADDRESS_UPPER.unpack(v),
            ),
            compute::SET_SHADER_SHARED_MEMORY_WINDOW_B => set_lower(&mut c.launch.shared_window, v),
            compute::SET_SHADER_LOCAL_MEMORY_WINDOW_A => set_upper(
                &mut c.launch.local_window,
                compute::SET_SHADER_LOCAL_MEMORY_WINDOW_A_BASE_ADDRESS_UPPER.unpack(v),
            ),
            compute::SET_SHADER_LOCAL_MEMORY_WINDOW_B => set_lower(&mut c.launch.local_window, v),
            compute::SET_SHADER_LOCAL_MEMORY_A => set_upper(
                &mut c.launch.local_memory_va,
                compute::SET_SHADER_LOCAL_MEMORY_A_ADDRESS_UPPER.unpack(v),
            ),
            compute::SET_SHADER_LOCAL_MEMORY_B => set_lower(&mut c.launch.local_memory_va, v),
            compute::SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_A => set_upper(
                &mut c.launch.local_bytes_per_tpc,
                compute::SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_A_SIZE_UPPER.unpack(v),
            ),
            compute::SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_B => {
                set_lower(&mut c.launch.local_bytes_per_tpc, v)
            }
            compute::SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_C => {
                c.launch.local_max_sm_count =
                    compute::SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_C_MAX_SM_COUNT.unpack(v)
            }
            compute::SET_QMD_VERSION => c.qmd_version = v,
            compute::SET_SPA_VERSION => c.spa_version = v,
            compute::INVALIDATE_SHADER_CACHES | compute::INVALIDATE_SHADER_CACHES_NO_WFI => {
                self.stats.cache_invalidations += 1
            }
            compute::SET_INLINE_QMD_ADDRESS_A => {
                let size = match compute::SET_INLINE_QMD_ADDRESS_A_INLINE_SIZE.unpack(v) {
                    compute::SET_INLINE_QMD_ADDRESS_A_INLINE_SIZE_INLINE_384 => 96,
                    _ => 64,
                };
                let upper = u64::from(
                    compute::SET_INLINE_QMD_ADDRESS_A_QMD_ADDRESS_SHIFTED8_UPPER.unpack(v),
                );
                c.inline_qmd = Some(InlineQmd {
                    upper: Some((upper << 40, size)),
                    ..InlineQmd::default()
                });
            }
            compute::SET_INLINE_QMD_ADDRESS_B => {
                let q = c.inline_qmd.as_mut().ok_or(SimErrorKind::BadInlineUpload {
                    why: "SET_INLINE_QMD_ADDRESS_B without SET_INLINE_QMD_ADDRESS_A",
                })?;
                let upper = q.upper.map_or(0, |(u, _)| u);
                q.va = Some(upper | (u64::from(v) << 8));
            }
            o if (compute::LOAD_INLINE_QMD_DATA(0)..compute::LOAD_INLINE_QMD_DATA(96))
                .contains(&o) =>
            {
                let i = ((o - compute::LOAD_INLINE_QMD_DATA(0)) / 4) as usize;
                let q = c.inline_qmd.as_mut().ok_or(SimErrorKind::BadInlineUpload {
                    why: "LOAD_INLINE_QMD_DATA without SET_INLINE_QMD_ADDRESS_A/B",
                })?;
                let (Some((_, size)), Some(va)) = (q.upper, q.va) else {
                    return Err(SimErrorKind::BadInlineUpload {
                        why: "LOAD_INLINE_QMD_DATA before the QMD's address was set",
                    });
                };
                if i != q.words.len() {
                    return Err(SimErrorKind::BadInlineUpload {
                        why: "LOAD_INLINE_QMD_DATA words out of order",
                    });
                }
                q.words.push(v);
                if q.words.len() == size {
                    // The hardware stores the QMD at its address, then launches it.
                    let bytes: Vec<u8> = q.words.iter().flat_map(|w| w.to_le_bytes()).collect();
                    c.inline_qmd = None;
                    view.write(va, &bytes).map_err(mmu("inline QMD address"))?;
                    self.stats.inline_qmds += 1;
                    self.launch(
                        va,
                        Event::HostSchedule {
                            copy: true,
                            force_require: false,
                        },
                        view,
                        now,
                        rec,
                    )?;
                }
            }
            compute::SEND_PCAS_A => c.pcas_a = Some(v),
            compute::SEND_SIGNALING_PCAS2_B => {
                let action = compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION.unpack(v);
                let named = || {
                    c.pcas_a.map(|a| u64::from(a) << 8).ok_or(SimErrorKind::BadQmd {
                        qmd_va: 0,
                        violation: qmd::QmdViolation::State(
                            "SEND_SIGNALING_PCAS2_B acts on a QMD but SEND_PCAS_A never named one",
                        ),
                    })
                };
                // The QMD cache: invalidating actions drop a prefetched copy; PREFETCH reads one.
                match action {
                    compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_INVALIDATE
                    | compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_INVALIDATE_COPY_SCHEDULE
                    | compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_INVALIDATE_PREFETCH_COPY_SCHEDULE
                    | compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_INVALIDATE_PREFETCH_COPY_FORCE_REQUIRE_SCHEDULING => {
                        c.prefetched.remove(&named()?);
                    }
                    compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_PREFETCH => {
                        let va = named()?;
                        qmd::check_address(va).map_err(|v| SimErrorKind::BadQmd {
                            qmd_va: va,
                            violation: v,
                        })?;
                        let words = view.read_words(va, QMD_WORDS_V04).map_err(mmu("QMD"))?;
                        c.prefetched.insert(va, words);
                        self.stats.qmd_prefetches += 1;
                    }
                    _ => {}
                }
                let c = &mut self.compute;
                let event = match action {
                    compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_SCHEDULE
                    | compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_PREFETCH_SCHEDULE => {
                        Some(Event::HostSchedule { copy: false, force_require: false })
                    }
                    compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_INVALIDATE_COPY_SCHEDULE
                    | compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_INVALIDATE_PREFETCH_COPY_SCHEDULE => {
                        Some(Event::HostSchedule { copy: true, force_require: false })
                    }
                    compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_INVALIDATE_PREFETCH_COPY_FORCE_REQUIRE_SCHEDULING => {
                        Some(Event::HostSchedule { copy: true, force_require: true })
                    }
                    compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_DECREMENT_DEPENDENCE => Some(Event::Decrement),
                    _ => None,
                };
                if let Some(event) = event {
                    let a = c.pcas_a.ok_or(SimErrorKind::BadQmd {
                        qmd_va: 0,
                        violation: qmd::QmdViolation::State(
                            "SEND_SIGNALING_PCAS2_B acts on a QMD but SEND_PCAS_A never named one",
                        ),
                    })?;
                    self.launch(u64::from(a) << 8, event, view, now, rec)?;
                }
            }
            method => {
                return Err(SimErrorKind::UnknownMethod {
                    subchannel: m.subchannel,
                    class: compute::CLASS,
                    method,
                });
            }
        }
        Ok(Flow::Continue)
    }
}
