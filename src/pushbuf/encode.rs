//! Method encoding: headers per subchannel (incrementing, non-incrementing, immediate, increment-once) and
//! typed methods of the host, compute and copy classes. Every offset and field comes from [`crate::hw`]: the
//! classes are the generation table's [`encoder`](crate::hw::generation::encoder) classes (Hopper's, whose methods
//! sit at the same offsets in every row that has them), the method-header formats c56f's.

use crate::hw::generation::encoder::{compute, copy, host};
use crate::hw::host::c56f;

/// Subchannels as libcuda and NVK bind them: host methods on 0, compute on 1, copy on 4.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Subchannel(pub u8);

impl Subchannel {
    /// Subchannel 0: the host (GPFIFO) class, semaphores and channel control.
    pub const HOST: Subchannel = Subchannel(0);
    /// Subchannel 1: the compute class, QMD launches.
    pub const COMPUTE: Subchannel = Subchannel(1);
    /// Subchannel 4: the copy class, DMA copies.
    pub const COPY: Subchannel = Subchannel(4);
}

/// The kinds of method header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Header {
    /// Each data word goes to the next method.
    Incrementing,
    /// Every data word goes to the same method.
    NonIncrementing,
    /// The first word goes to the method, the rest to the one after it.
    IncrementOnce,
}

/// Builds one method header word.
pub const fn header(kind: Header, subc: Subchannel, method: u32, count: u32) -> u32 {
    let op = match kind {
        Header::Incrementing => c56f::DMA_SEC_OP_INC_METHOD,
        Header::NonIncrementing => c56f::DMA_SEC_OP_NON_INC_METHOD,
        Header::IncrementOnce => c56f::DMA_SEC_OP_ONE_INC,
    };
    c56f::DMA_SEC_OP.pack(op)
        | c56f::DMA_METHOD_COUNT.pack(count)
        | c56f::DMA_METHOD_SUBCHANNEL.pack(subc.0 as u32)
        | c56f::DMA_METHOD_ADDRESS.pack(method >> 2)
}

/// An immediate-data header: the 13-bit value travels in the header itself.
pub const fn immediate(subc: Subchannel, method: u32, value: u32) -> u32 {
    c56f::DMA_SEC_OP.pack(c56f::DMA_SEC_OP_IMMD_DATA_METHOD)
        | c56f::DMA_IMMD_DATA.pack(value)
        | c56f::DMA_METHOD_SUBCHANNEL.pack(subc.0 as u32)
        | c56f::DMA_METHOD_ADDRESS.pack(method >> 2)
}

/// The header that ends a pushbuffer segment early: the front end ignores the words after it, up to the length
/// its GPFIFO entry gave.
pub const END_SEGMENT: u32 = c56f::DMA_SEC_OP.pack(c56f::DMA_SEC_OP_END_PB_SEGMENT);

/// Largest method count one header carries.
pub const MAX_COUNT: u32 = c56f::DMA_METHOD_COUNT.mask() as u32;
/// Largest value an immediate-data header carries (13 bits).
pub const MAX_IMMEDIATE: u32 = c56f::DMA_IMMD_DATA.mask() as u32;

/// The pushbuffer did not have room for what was written; nothing past its end was touched.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "pushbuffer overflow: {needed} words needed, {capacity} available; flush more often or make the pushbuffer larger"
)]
pub struct Overflow {
    /// Words the writes needed.
    pub needed: usize,
    /// Words the buffer holds.
    pub capacity: usize,
}

/// Writes methods into a word buffer (ordinarily the pushbuffer itself). Writes past the end are dropped and
/// remembered; [`finish`](Push::finish) then reports the overflow, so no method is silently lost.
#[derive(Debug)]
pub struct Push<'a> {
    buf: &'a mut [u32],
    len: usize,
    needed: usize,
}

/// Options of a host semaphore release.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Release {
    /// Wait for the engines to go idle first, so all earlier work is complete when the value lands.
    pub wfi: bool,
    /// Write a 64-bit payload (else 32).
    pub wide: bool,
    /// Write the GPU timestamp after the payload (needs a 16-byte slot).
    pub timestamp: bool,
}

impl Release {
    /// A 64-bit release after the engines are idle, without a timestamp: the usual fence.
    pub const AFTER_IDLE_64: Release = Release {
        wfi: true,
        wide: true,
        timestamp: false,
    };
    /// A 64-bit release as soon as the front end reaches it: for releases ordered by an acquire just before them
    /// (of a value whose own release already followed the work), where waiting for idle would only add latency.
    pub const NOW_64: Release = Release {
        wfi: false,
        wide: true,
        timestamp: false,
    };
}

/// Acquire comparisons the host class offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acquire {
    /// Wait until the value equals the payload.
    Equal,
    /// Wait until the value is at or past the payload, in wrapping (circular) order.
    CircularGeq,
    /// Wait until the value is at or past the payload, as unsigned numbers.
    StrictGeq,
}

impl<'a> Push<'a> {
    /// Writes into `buf` from its start.
    pub fn new(buf: &'a mut [u32]) -> Push<'a> {
        Push {
            buf,
            len: 0,
            needed: 0,
        }
    }

    /// Words written so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing was written.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The words written so far.
    pub fn words(&self) -> &[u32] {
        &self.buf[..self.len]
    }

    /// Words written, or the overflow if any write did not fit.
    pub fn finish(self) -> Result<usize, Overflow> {
        if self.needed > self.len {
            Err(Overflow {
                needed: self.needed,
                capacity: self.buf.len(),
            })
        } else {
            Ok(self.len)
        }
    }

    #[inline(always)]
    fn put(&mut self, word: u32) {
        self.needed += 1;
        if let Some(slot) = self.buf.get_mut(self.len) {
            *slot = word;
            self.len += 1;
        }
    }

    /// A header and its data words.
    #[inline]
    pub fn methods(&mut self, kind: Header, subc: Subchannel, method: u32, data: &[u32]) {
        self.put(header(kind, subc, method, data.len() as u32));
        for &w in data {
            self.put(w);
        }
    }

    /// One method with one data word.
    #[inline]
    pub fn method(&mut self, subc: Subchannel, method: u32, value: u32) {
        self.put(header(Header::Incrementing, subc, method, 1));
        self.put(value);
    }

    /// One method with a 13-bit value carried in the header.
    #[inline]
    pub fn immediate(&mut self, subc: Subchannel, method: u32, value: u32) {
        debug_assert!(value <= MAX_IMMEDIATE);
        self.put(immediate(subc, method, value));
    }

    /// Raw words (already encoded).
    pub fn raw(&mut self, words: &[u32]) {
        for &w in words {
            self.put(w);
        }
    }

    // ---- host class -------------------------------------------------------------------------------------

    /// Binds `class` to `subc`.
    pub fn set_object(&mut self, subc: Subchannel, class: u32) {
        self.method(subc, host::SET_OBJECT, class);
    }

    fn semaphore(&mut self, va: u64, payload: u64, execute: u32) {
        self.methods(
            Header::Incrementing,
            Subchannel::HOST,
            host::SEM_ADDR_LO,
            &[
                host::SEM_ADDR_LO_OFFSET.pack((va as u32) >> 2),
                host::SEM_ADDR_HI_OFFSET.pack((va >> 32) as u32),
                payload as u32,
                (payload >> 32) as u32,
                execute,
            ],
        );
    }

    /// Host semaphore release: writes `payload` at `va` when the channel reaches this point.
    pub fn sem_release(&mut self, va: u64, payload: u64, opts: Release) {
        let exec = host::SEM_EXECUTE_OPERATION.pack(host::SEM_EXECUTE_OPERATION_RELEASE)
            | host::SEM_EXECUTE_RELEASE_WFI.pack(if opts.wfi {
                c56f::SEM_EXECUTE_RELEASE_WFI_EN
            } else {
                host::SEM_EXECUTE_RELEASE_WFI_DIS
            })
            | host::SEM_EXECUTE_PAYLOAD_SIZE.pack(if opts.wide {
                c56f::SEM_EXECUTE_PAYLOAD_SIZE_64BIT
            } else {
                host::SEM_EXECUTE_PAYLOAD_SIZE_32BIT
            })
            | host::SEM_EXECUTE_RELEASE_TIMESTAMP.pack(if opts.timestamp {
                host::SEM_EXECUTE_RELEASE_TIMESTAMP_EN
            } else {
                host::SEM_EXECUTE_RELEASE_TIMESTAMP_DIS
            });
        self.semaphore(va, payload, exec);
    }

    /// Host semaphore acquire: the channel stops here until the value at `va` satisfies `cmp` against
    /// `payload`. With `switch_tsg` the scheduler may run other channel groups meanwhile.
    pub fn sem_acquire(
        &mut self,
        va: u64,
        payload: u64,
        cmp: Acquire,
        wide: bool,
        switch_tsg: bool,
    ) {
        let op = match cmp {
            Acquire::Equal => host::SEM_EXECUTE_OPERATION_ACQUIRE,
            Acquire::CircularGeq => host::SEM_EXECUTE_OPERATION_ACQ_CIRC_GEQ,
            Acquire::StrictGeq => c56f::SEM_EXECUTE_OPERATION_ACQ_STRICT_GEQ,
        };
        let exec = host::SEM_EXECUTE_OPERATION.pack(op)
            | host::SEM_EXECUTE_PAYLOAD_SIZE.pack(if wide {
                c56f::SEM_EXECUTE_PAYLOAD_SIZE_64BIT
            } else {
                host::SEM_EXECUTE_PAYLOAD_SIZE_32BIT
            })
            | host::SEM_EXECUTE_ACQUIRE_SWITCH_TSG
                .pack(u32::from(switch_tsg) * host::SEM_EXECUTE_ACQUIRE_SWITCH_TSG_EN);
        self.semaphore(va, payload, exec);
    }

    /// Host wait-for-idle of every engine of the channel.
    pub fn wfi(&mut self) {
        self.method(
            Subchannel::HOST,
            host::WFI,
            host::WFI_SCOPE.pack(host::WFI_SCOPE_ALL),
        );
    }

    /// Raises the channel's non-stall interrupt (for waiters that sleep instead of polling).
    pub fn non_stall_interrupt(&mut self) {
        self.method(Subchannel::HOST, c56f::NON_STALL_INTERRUPT, 0);
    }

    /// A system-scope memory barrier by the host.
    pub fn membar_sys(&mut self) {
        self.methods(
            Header::Incrementing,
            Subchannel::HOST,
            host::MEM_OP_A,
            &[
                0,
                0,
                host::MEM_OP_C_MEMBAR_TYPE.pack(host::MEM_OP_C_MEMBAR_TYPE_SYS_MEMBAR),
                host::MEM_OP_D_OPERATION.pack(host::MEM_OP_D_OPERATION_MEMBAR),
            ],
        );
    }

    // ---- compute class ------------------------------------------------------------------------------------

    /// Inline upload by the compute engine: `data` is copied to GPU address `dst` when the channel gets here.
    pub fn inline_upload(&mut self, dst: u64, data: &[u32]) {
        self.methods(
            Header::Incrementing,
            Subchannel::COMPUTE,
            compute::LINE_LENGTH_IN,
            &[
                (data.len() * 4) as u32,
                1,
                compute::OFFSET_OUT_UPPER_VALUE.pack((dst >> 32) as u32),
                dst as u32,
            ],
        );
        self.method(
            Subchannel::COMPUTE,
            compute::LAUNCH_DMA,
            compute::LAUNCH_DMA_DST_MEMORY_LAYOUT.pack(compute::LAUNCH_DMA_DST_MEMORY_LAYOUT_PITCH)
                | compute::LAUNCH_DMA_SYSMEMBAR_DISABLE
                    .pack(compute::LAUNCH_DMA_SYSMEMBAR_DISABLE_TRUE),
        );
        self.methods(
            Header::NonIncrementing,
            Subchannel::COMPUTE,
            compute::LOAD_INLINE_DATA,
            data,
        );
    }

    /// Shared- and local-memory windows (GPU addresses where shared and local memory appear to kernels).
    pub fn set_shader_windows(&mut self, shared: u64, local: u64) {
        self.methods(
            Header::Incrementing,
            Subchannel::COMPUTE,
            compute::SET_SHADER_SHARED_MEMORY_WINDOW_A,
            &[
                compute::SET_SHADER_SHARED_MEMORY_WINDOW_A_BASE_ADDRESS_UPPER
                    .pack((shared >> 32) as u32),
                compute::SET_SHADER_SHARED_MEMORY_WINDOW_B_BASE_ADDRESS.pack(shared as u32),
            ],
        );
        self.methods(
            Header::Incrementing,
            Subchannel::COMPUTE,
            compute::SET_SHADER_LOCAL_MEMORY_WINDOW_A,
            &[
                compute::SET_SHADER_LOCAL_MEMORY_WINDOW_A_BASE_ADDRESS_UPPER
                    .pack((local >> 32) as u32),
                compute::SET_SHADER_LOCAL_MEMORY_WINDOW_B_BASE_ADDRESS.pack(local as u32),
            ],
        );
    }

    /// The local-memory (stack) buffer: its address, bytes per TPC, and the SM count it is sized for.
    pub fn set_local_memory(&mut self, va: u64, bytes_per_tpc: u64, max_sm_count: u32) {
        self.methods(
            Header::Incrementing,
            Subchannel::COMPUTE,
            compute::SET_SHADER_LOCAL_MEMORY_A,
            &[
                compute::SET_SHADER_LOCAL_MEMORY_A_ADDRESS_UPPER.pack((va >> 32) as u32),
                va as u32,
            ],
        );
        self.methods(
            Header::Incrementing,
            Subchannel::COMPUTE,
            compute::SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_A,
            &[
                compute::SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_A_SIZE_UPPER
                    .pack((bytes_per_tpc >> 32) as u32),
                bytes_per_tpc as u32,
                compute::SET_SHADER_LOCAL_MEMORY_NON_THROTTLED_C_MAX_SM_COUNT.pack(max_sm_count),
            ],
        );
    }

    /// Which QMD versions the compute engine is told to expect (libcuda sends current 0x40, oldest 1).
    pub fn set_qmd_version(&mut self, current: u32, oldest: u32) {
        self.method(
            Subchannel::COMPUTE,
            compute::SET_QMD_VERSION,
            compute::SET_QMD_VERSION_CURRENT.pack(current)
                | compute::SET_QMD_VERSION_OLDEST_SUPPORTED.pack(oldest),
        );
    }

    /// The SM ISA version the channel's kernels are compiled for (major 9 minor 0 on Hopper).
    pub fn set_spa_version(&mut self, major: u32, minor: u32) {
        self.method(
            Subchannel::COMPUTE,
            compute::SET_SPA_VERSION,
            compute::SET_SPA_VERSION_MAJOR.pack(major) | compute::SET_SPA_VERSION_MINOR.pack(minor),
        );
    }

    /// Invalidates the shader instruction and constant caches without waiting for idle (after uploading code).
    pub fn invalidate_shader_caches_no_wfi(&mut self) {
        self.method(
            Subchannel::COMPUTE,
            compute::INVALIDATE_SHADER_CACHES_NO_WFI,
            compute::INVALIDATE_SHADER_CACHES_NO_WFI_INSTRUCTION.pack(1)
                | compute::INVALIDATE_SHADER_CACHES_NO_WFI_GLOBAL_DATA.pack(1)
                | compute::INVALIDATE_SHADER_CACHES_NO_WFI_CONSTANT.pack(1),
        );
    }

    // ---- copy class ------------------------------------------------------------------------------------------

    /// Largest copy one LAUNCH_DMA moves (LINE_LENGTH_IN is a 32-bit byte count).
    pub const MAX_COPY_CHUNK: u64 = 1 << 30;

    /// A linear copy of `bytes` from `src` to `dst` (GPU virtual addresses) by the copy engine, split into
    /// chunks of at most [`MAX_COPY_CHUNK`](Self::MAX_COPY_CHUNK). When `release` is given, the copy engine
    /// writes that 32-bit payload at that address after the last byte has landed (flushed).
    pub fn copy_linear(&mut self, src: u64, dst: u64, bytes: u64, release: Option<(u64, u32)>) {
        let mut done = 0u64;
        while done < bytes {
            let n = (bytes - done).min(Self::MAX_COPY_CHUNK);
            let last = done + n == bytes;
            let (s, d) = (src + done, dst + done);
            self.methods(
                Header::Incrementing,
                Subchannel::COPY,
                copy::OFFSET_IN_UPPER,
                &[
                    copy::OFFSET_IN_UPPER_UPPER.pack((s >> 32) as u32),
                    s as u32,
                    copy::OFFSET_OUT_UPPER_UPPER.pack((d >> 32) as u32),
                    d as u32,
                ],
            );
            self.method(Subchannel::COPY, copy::LINE_LENGTH_IN, n as u32);
            let mut launch = copy::LAUNCH_DMA_DATA_TRANSFER_TYPE
                .pack(copy::LAUNCH_DMA_DATA_TRANSFER_TYPE_NON_PIPELINED)
                | copy::LAUNCH_DMA_SRC_MEMORY_LAYOUT.pack(copy::LAUNCH_DMA_SRC_MEMORY_LAYOUT_PITCH)
                | copy::LAUNCH_DMA_DST_MEMORY_LAYOUT.pack(copy::LAUNCH_DMA_DST_MEMORY_LAYOUT_PITCH)
                | copy::LAUNCH_DMA_MULTI_LINE_ENABLE.pack(copy::LAUNCH_DMA_MULTI_LINE_ENABLE_FALSE)
                | copy::LAUNCH_DMA_SRC_TYPE.pack(copy::LAUNCH_DMA_SRC_TYPE_VIRTUAL)
                | copy::LAUNCH_DMA_DST_TYPE.pack(copy::LAUNCH_DMA_DST_TYPE_VIRTUAL);
            if last {
                launch |= copy::LAUNCH_DMA_FLUSH_ENABLE.pack(copy::LAUNCH_DMA_FLUSH_ENABLE_TRUE)
                    | copy::LAUNCH_DMA_FLUSH_TYPE.pack(copy::LAUNCH_DMA_FLUSH_TYPE_SYS);
                if let Some((va, payload)) = release {
                    self.methods(
                        Header::Incrementing,
                        Subchannel::COPY,
                        copy::SET_SEMAPHORE_A,
                        &[
                            copy::SET_SEMAPHORE_A_UPPER.pack((va >> 32) as u32),
                            va as u32,
                            payload,
                        ],
                    );
                    launch |= copy::LAUNCH_DMA_SEMAPHORE_TYPE
                        .pack(copy::LAUNCH_DMA_SEMAPHORE_TYPE_RELEASE_ONE_WORD_SEMAPHORE)
                        | copy::LAUNCH_DMA_SEMAPHORE_PAYLOAD_SIZE
                            .pack(copy::LAUNCH_DMA_SEMAPHORE_PAYLOAD_SIZE_ONE_WORD);
                }
            }
            self.method(Subchannel::COPY, copy::LAUNCH_DMA, launch);
            done += n;
        }
    }

    /// Launches a V04 QMD carried in the pushbuffer itself (`SET_INLINE_QMD_ADDRESS_A/B` with `INLINE_384`, then
    /// `LOAD_INLINE_QMD_DATA` x96, in one incrementing run): the compute work distributor takes the QMD from the
    /// methods instead of fetching it, and the GPU stores it at `qmd_va` (256-byte aligned memory that must be
    /// valid). No `SEND_PCAS` follows (H200 and H100 probes).
    #[inline]
    pub fn send_inline_qmd(&mut self, qmd_va: u64, qmd: &[u32; 96]) {
        self.put(header(
            Header::Incrementing,
            Subchannel::COMPUTE,
            compute::SET_INLINE_QMD_ADDRESS_A,
            2 + qmd.len() as u32,
        ));
        self.put(
            compute::SET_INLINE_QMD_ADDRESS_A_INLINE_SIZE
                .pack(compute::SET_INLINE_QMD_ADDRESS_A_INLINE_SIZE_INLINE_384)
                | compute::SET_INLINE_QMD_ADDRESS_A_QMD_ADDRESS_SHIFTED8_UPPER
                    .pack(((qmd_va >> 40) & 0x1ff) as u32),
        );
        self.put(
            compute::SET_INLINE_QMD_ADDRESS_B_QMD_ADDRESS_SHIFTED8_LOWER.pack((qmd_va >> 8) as u32),
        );
        for &w in qmd {
            self.put(w);
        }
    }

    /// Launches the QMD at `qmd_va` (256-byte aligned, below 2^40).
    #[inline]
    pub fn send_pcas(&mut self, qmd_va: u64) {
        self.send_pcas_action(
            qmd_va,
            compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_INVALIDATE_PREFETCH_COPY_SCHEDULE,
        );
    }

    /// Has the compute work distributor read the QMD at `qmd_va` ahead of its launch: its cached copy is dropped
    /// (PCAS INVALIDATE), then the QMD is fetched afresh (PCAS PREFETCH). Sent before a wait for the work ahead of the
    /// launch, so that the fetch overlaps that work; [`schedule_prefetched`](Self::schedule_prefetched) launches it.
    /// The QMD must be final in memory when this is sent, and stay so until it has run.
    #[inline]
    pub fn prefetch_qmd(&mut self, qmd_va: u64) {
        // Both actions on the one address: five words where two whole PCAS pairs would take eight.
        self.send_pcas_actions(
            qmd_va,
            &[
                compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_INVALIDATE,
                compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_PREFETCH,
            ],
        );
    }

    /// Launches the QMD at `qmd_va` that [`prefetch_qmd`](Self::prefetch_qmd) fetched ahead (PCAS PREFETCH_SCHEDULE:
    /// what was prefetched, or fetched now if it was not).
    #[inline]
    pub fn schedule_prefetched(&mut self, qmd_va: u64) {
        self.send_pcas_action(
            qmd_va,
            compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_PREFETCH_SCHEDULE,
        );
    }

    /// Counts one predecessor of the armed QMD at `qmd_va` down (PCAS DECREMENT_DEPENDENCE): the compute work
    /// distributor schedules it when its dependence counter reaches zero.
    pub fn send_pcas_decrement(&mut self, qmd_va: u64) {
        self.send_pcas_action(
            qmd_va,
            compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_DECREMENT_DEPENDENCE,
        );
    }

    #[inline]
    fn send_pcas_action(&mut self, qmd_va: u64, action: u32) {
        self.send_pcas_actions(qmd_va, &[action]);
    }

    /// `SEND_PCAS_A` with the QMD's address, then each action in `SEND_SIGNALING_PCAS2_B` (one header for all).
    #[inline]
    fn send_pcas_actions(&mut self, qmd_va: u64, actions: &[u32]) {
        self.method(
            Subchannel::COMPUTE,
            compute::SEND_PCAS_A,
            compute::SEND_PCAS_A_QMD_ADDRESS_SHIFTED8.pack((qmd_va >> 8) as u32),
        );
        // One action keeps the incrementing header libcuda writes; several go to the one method.
        let kind = if actions.len() == 1 {
            Header::Incrementing
        } else {
            Header::NonIncrementing
        };
        self.put(header(
            kind,
            Subchannel::COMPUTE,
            compute::SEND_SIGNALING_PCAS2_B,
            actions.len() as u32,
        ));
        for &a in actions {
            self.put(compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION.pack(a));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pushbuf::decode::{SubchannelClasses, decode};

    #[test]
    fn an_inline_qmd_is_the_98_word_run_the_h200_probe_launched() {
        let mut buf = [0u32; 128];
        let mut p = Push::new(&mut buf);
        let qmd: [u32; 96] = std::array::from_fn(|i| i as u32 * 3 + 1);
        p.send_inline_qmd(0x12_3456_7800, &qmd);
        let n = p.finish().unwrap();
        assert_eq!(n, 99);
        // nvk-compute-launch.md §2.3: one INCR header at 0x318, count 98, then A, B and the 96 QMD words.
        assert_eq!(buf[0], 0x2062_20c6);
        assert_eq!(
            buf[1],
            (1 << 30) | ((0x12_3456_7800u64 >> 40) as u32 & 0x1ff)
        );
        assert_eq!(buf[2], (0x12_3456_7800u64 >> 8) as u32);
        assert_eq!(&buf[3..99], &qmd[..]);
    }

    #[test]
    fn headers_match_the_words_libcuda_and_nvk_emit() {
        // SET_OBJECT on subchannel 1 with one word (nvk-compute-launch.md §2.2).
        assert_eq!(
            header(Header::Incrementing, Subchannel::COMPUTE, 0, 1),
            0x2001_2000
        );
        // The host semaphore block: subchannel 0, SEM_ADDR_LO (0x5c), 5 words.
        assert_eq!(
            header(Header::Incrementing, Subchannel::HOST, 0x5c, 5),
            0x2005_0017
        );
        // SEND_PCAS_A as an incrementing header with count 1.
        assert_eq!(
            header(
                Header::Incrementing,
                Subchannel::COMPUTE,
                compute::SEND_PCAS_A,
                1
            ),
            0x2001_20ad
        );
        // NVK's immediate PCAS2_B with action 3.
        assert_eq!(
            immediate(Subchannel::COMPUTE, compute::SEND_SIGNALING_PCAS2_B, 3),
            0x8003_20b0
        );
        assert_eq!(
            header(
                Header::NonIncrementing,
                Subchannel::COMPUTE,
                compute::LOAD_INLINE_DATA,
                7
            ) >> 29,
            3
        );
        assert_eq!(
            header(Header::IncrementOnce, Subchannel::COPY, 0x400, 2) >> 29,
            5
        );
    }

    #[test]
    fn semaphore_release_encodes_like_tinygrad_on_the_h200() {
        let mut buf = [0u32; 8];
        let mut p = Push::new(&mut buf);
        p.sem_release(
            0x1_2345_6780,
            0xdead_beef_0000_0001,
            Release {
                wfi: true,
                wide: true,
                timestamp: true,
            },
        );
        assert_eq!(p.finish(), Ok(6));
        // tinygrad's signal: RELEASE | RELEASE_WFI | 64-bit | timestamp = 0x03100001.
        assert_eq!(
            buf,
            [
                0x2005_0017,
                0x2345_6780,
                0x1,
                0x0000_0001,
                0xdead_beef,
                0x0310_0001,
                0,
                0
            ]
        );
    }

    #[test]
    fn acquire_circ_geq_64_matches_tinygrad() {
        let mut buf = [0u32; 6];
        let mut p = Push::new(&mut buf);
        p.sem_acquire(0x1000, 7, Acquire::CircularGeq, true, false);
        assert_eq!(buf[5], 0x0100_0003);
    }

    #[test]
    fn overflow_is_reported_not_lost() {
        let mut buf = [0u32; 4];
        let mut p = Push::new(&mut buf);
        p.sem_release(0x1000, 1, Release::AFTER_IDLE_64);
        assert_eq!(
            p.finish(),
            Err(Overflow {
                needed: 6,
                capacity: 4
            })
        );
    }

    #[test]
    fn a_qmd_read_ahead_is_invalidate_and_prefetch_on_one_address_then_a_prefetch_schedule() {
        let mut buf = [0u32; 16];
        let mut p = Push::new(&mut buf);
        p.prefetch_qmd(0x2_04e0_d800);
        p.schedule_prefetched(0x2_04e0_d800);
        let n = p.finish().unwrap();
        assert_eq!(n, 9, "five words ahead of the wait, four after it");
        let m = decode(&buf[..n], &SubchannelClasses::hopper()).unwrap();
        let got: Vec<(String, u32)> = m
            .iter()
            .map(|d| (d.name.clone().unwrap_or_default(), d.value))
            .collect();
        let pcas2 = |action| compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION.pack(action);
        assert_eq!(
            got,
            [
                ("SEND_PCAS_A".to_owned(), 0x0204_e0d8),
                (
                    "SEND_SIGNALING_PCAS2_B".to_owned(),
                    pcas2(compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_INVALIDATE)
                ),
                (
                    "SEND_SIGNALING_PCAS2_B".to_owned(),
                    pcas2(compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_PREFETCH)
                ),
                ("SEND_PCAS_A".to_owned(), 0x0204_e0d8),
                (
                    "SEND_SIGNALING_PCAS2_B".to_owned(),
                    pcas2(compute::SEND_SIGNALING_PCAS2_B_PCAS_ACTION_PREFETCH_SCHEDULE)
                ),
            ]
        );
    }

    #[test]
    fn encoded_methods_decode_back() {
        let mut buf = [0u32; 64];
        let mut p = Push::new(&mut buf);
        p.set_object(Subchannel::COMPUTE, compute::CLASS);
        p.set_shader_windows(0x7293_0000_0000, 0x7294_0000_0000);
        p.send_pcas(0x2_04e0_d800);
        p.sem_release(0x2_0460_fff0, 5, Release::AFTER_IDLE_64);
        p.wfi();
        p.inline_upload(0x7fee_ae2b_0000, &[1, 2, 3]);
        let n = p.finish().unwrap();
        let m = decode(&buf[..n], &SubchannelClasses::hopper()).unwrap();
        let names: Vec<String> = m
            .iter()
            .map(|d| d.name.clone().unwrap_or_default())
            .collect();
        let expect = [
            "SET_OBJECT",
            "SET_SHADER_SHARED_MEMORY_WINDOW_A",
            "SET_SHADER_SHARED_MEMORY_WINDOW_B",
            "SET_SHADER_LOCAL_MEMORY_WINDOW_A",
            "SET_SHADER_LOCAL_MEMORY_WINDOW_B",
            "SEND_PCAS_A",
            "SEND_SIGNALING_PCAS2_B",
            "SEM_ADDR_LO",
            "SEM_ADDR_HI",
            "SEM_PAYLOAD_LO",
            "SEM_PAYLOAD_HI",
            "SEM_EXECUTE",
            "WFI",
            "LINE_LENGTH_IN",
            "LINE_COUNT",
            "OFFSET_OUT_UPPER",
            "OFFSET_OUT",
            "LAUNCH_DMA",
            "LOAD_INLINE_DATA",
            "LOAD_INLINE_DATA",
            "LOAD_INLINE_DATA",
        ];
        assert_eq!(names, expect);
        assert_eq!(m[5].value, 0x0204_e0d8);
        assert_eq!(m[6].value, 0xa);
        assert_eq!(m[8].value, 2);
    }
}
