//! The ring the device runtime writes records into ([`PrintfFifo`]), one per GPU, and the host's half of its
//! protocol: taking the records out, printing them.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use tracing::{debug, warn};

use super::format::format_printf;
use super::record::{AssertFailure, DeviceRecord, decode_record};
use crate::rm::{GpuCore, Memory, MemoryDesc, Placement};

/// The FIFO size when none is set: 1 MiB, as CUDA's default `cudaLimitPrintfFifoSize`.
pub const DEFAULT_FIFO_BYTES: u64 = 1 << 20;
/// Bytes before the ring: `tail`, `head`, `capacity`, `dropped`, reserved.
pub(super) const HEADER_BYTES: u64 = 64;
pub(super) const TAIL: u64 = 0;
pub(super) const HEAD: u64 = 8;
pub(super) const CAPACITY: u64 = 16;
pub(super) const DROPPED: u64 = 24;
/// Header word the runtime reads at a failed `assert`: [`FLAG_ASSERT_ENDS_THREAD`].
const FLAGS: u64 = 32;
/// Header word holding the GPU address of the host word a failed `assert` sets (0: none).
const ASSERT_FLAG: u64 = 40;
/// In [`FLAGS`]: a failed `assert` ends its thread instead of trapping ([`AssertAction::EndThread`]).
const FLAG_ASSERT_ENDS_THREAD: u64 = 1;
/// Smallest ring: a record with a long format string must fit.
const MIN_FIFO_BYTES: u64 = 4096;
/// Largest ring: the record size field is 32 bits.
const MAX_FIFO_BYTES: u64 = 1 << 31;

/// How a failed device-side `assert` ends, in kernels launched on the direct path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum AssertAction {
    /// The failing thread traps, as in CUDA: its channel faults (and with it the channel group the queue shares),
    /// and the wait that sees the fault returns [`launch::Error::Assert`](crate::launch::Error::Assert). The
    /// default.
    #[default]
    Trap,
    /// The failing thread records the failure, sets a word in host memory and ends; the rest of the grid and the
    /// queue go on, and no channel faults. The next wait that drains the FIFO returns
    /// [`launch::Error::Assert`](crate::launch::Error::Assert) (without a fault), or a host that reports asserts its
    /// own way checks
    /// [`PrintfFifo::assert_seen`] and takes them with [`PrintfFifo::take_asserts`] (apex-preload replays them
    /// through the CUDA driver, so that the program sees CUDA's own report).
    EndThread,
}

/// What one drain found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Drained {
    /// `printf` records printed.
    pub printed: usize,
    /// Failed assertions (also printed to standard error, as CUDA reports them).
    pub asserts: Vec<AssertFailure>,
    /// Records dropped for lack of room since the last drain.
    pub dropped: u64,
}

/// The ring the device runtime writes records into: one per GPU, shared by its modules and queues.
#[derive(Debug)]
pub struct PrintfFifo {
    memory: Memory,
    capacity: u64,
    /// Serializes drains; holds the drop count already reported.
    drain: Mutex<u64>,
    /// The host word a failed `assert` sets under [`AssertAction::EndThread`] (CPU-cached system memory: reading
    /// it costs what reading any cached word costs).
    seen: Memory,
    /// The [`AssertAction`] in force, as its [`FLAGS`] word.
    flags: AtomicU64,
}

impl PrintfFifo {
    /// A ring of `bytes` (rounded up to a power of two, at least 4 KiB, at most 2 GiB) in video memory.
    pub fn new(gpu: &Arc<GpuCore>, bytes: u64) -> crate::rm::Result<PrintfFifo> {
        let capacity = bytes
            .clamp(MIN_FIFO_BYTES, MAX_FIFO_BYTES)
            .next_power_of_two();
        let memory = Memory::alloc(gpu, MemoryDesc::video(HEADER_BYTES + capacity).with_cpu())?;
        memory.fill(0, HEADER_BYTES + capacity, 0)?;
        memory.write(CAPACITY, &capacity.to_le_bytes())?;
        let seen = Memory::alloc(
            gpu,
            MemoryDesc::video(8)
                .placement(Placement::SystemCached)
                .with_cpu(),
        )?;
        seen.write_u64_volatile(0, 0)?;
        memory.write(ASSERT_FLAG, &seen.va().to_le_bytes())?;
        debug!(
            capacity,
            va = format_args!("{:#x}", memory.va()),
            "printf FIFO"
        );
        Ok(PrintfFifo {
            memory,
            capacity,
            drain: Mutex::new(0),
            seen,
            flags: AtomicU64::new(0),
        })
    }

    /// Sets how a failed `assert` ends from now on (kernels already running may still see the previous action).
    pub fn set_assert_action(&self, action: AssertAction) -> crate::rm::Result<()> {
        let flags = match action {
            AssertAction::Trap => 0,
            AssertAction::EndThread => FLAG_ASSERT_ENDS_THREAD,
        };
        self.memory.write_u64_volatile(FLAGS, flags)?;
        self.flags.store(flags, Ordering::Relaxed);
        Ok(())
    }

    /// How a failed `assert` ends.
    pub fn assert_action(&self) -> AssertAction {
        if self.flags.load(Ordering::Relaxed) & FLAG_ASSERT_ENDS_THREAD != 0 {
            AssertAction::EndThread
        } else {
            AssertAction::Trap
        }
    }

    /// Whether a kernel failed an `assert` that ended its thread ([`AssertAction::EndThread`]) since
    /// [`take_asserts`](Self::take_asserts) last ran: one read of a CPU-cached word, cheap enough for every
    /// synchronization. Read it after the work that may have failed is known complete.
    pub fn assert_seen(&self) -> bool {
        self.seen.read_u64_volatile(0).is_ok_and(|v| v != 0)
    }

    /// Takes every complete record out of the ring: prints `printf` output to standard output, as
    /// [`drain`](Self::drain) does, and returns the failed assertions without printing them, for a host that
    /// reports them its own way. Clears the word [`assert_seen`](Self::assert_seen) reads first, so an assert that
    /// lands during the call is seen next time.
    pub fn take_asserts(&self) -> crate::rm::Result<Drained> {
        self.seen.write_u64_volatile(0, 0)?;
        std::sync::atomic::fence(Ordering::SeqCst);
        self.drain_with(false)
    }

    /// GPU address of the ring's header (what the runtime's `apex_fifo` resolves to).
    pub fn va(&self) -> u64 {
        self.memory.va()
    }

    /// Bytes of the ring.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Takes every complete record out of the ring, prints `printf` output to standard output and failed
    /// assertions to standard error, and returns what it found.
    pub fn drain(&self) -> crate::rm::Result<Drained> {
        self.drain_with(true)
    }

    fn drain_with(&self, print_asserts: bool) -> crate::rm::Result<Drained> {
        let records = self.take()?;
        let mut drained = Drained::default();
        let mut stdout = std::io::stdout().lock();
        for r in records.0 {
            match r {
                DeviceRecord::Printf { format, args } => {
                    let _ = stdout.write_all(&format_printf(&format, &args));
                    drained.printed += 1;
                }
                DeviceRecord::Assert(a) => {
                    if print_asserts {
                        let _ = stdout.flush();
                        let _ = writeln!(std::io::stderr(), "{a}");
                    }
                    drained.asserts.push(a);
                }
            }
        }
        let _ = stdout.flush();
        drained.dropped = records.1;
        if drained.dropped > 0 {
            warn!(
                dropped = drained.dropped,
                capacity = self.capacity,
                "device printf output did not fit the FIFO and was dropped; make it larger"
            );
        }
        Ok(drained)
    }

    /// Decodes and consumes the complete records; returns them and the records dropped since the last call.
    pub fn take(&self) -> crate::rm::Result<(Vec<DeviceRecord>, u64)> {
        let mut reported = self.drain.lock().unwrap_or_else(|p| p.into_inner());
        take_records(&self.memory, self.capacity, &mut reported)
    }
}

/// CPU access to the ring's memory: the GPU's (through BAR1) or, in tests, a buffer that plays the device.
pub trait RingMemory {
    /// A volatile 64-bit load at `offset`.
    fn load(&self, offset: u64) -> crate::rm::Result<u64>;
    /// A volatile 64-bit store at `offset`.
    fn store(&self, offset: u64, value: u64) -> crate::rm::Result<()>;
    /// Copies bytes out at `offset`.
    fn read(&self, offset: u64, out: &mut [u8]) -> crate::rm::Result<()>;
    /// Zeroes `len` bytes at `offset`.
    fn zero(&self, offset: u64, len: u64) -> crate::rm::Result<()>;
}

impl RingMemory for Memory {
    fn load(&self, offset: u64) -> crate::rm::Result<u64> {
        self.read_u64_volatile(offset)
    }
    fn store(&self, offset: u64, value: u64) -> crate::rm::Result<()> {
        self.write_u64_volatile(offset, value)
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> crate::rm::Result<()> {
        Memory::read(self, offset, out)
    }
    fn zero(&self, offset: u64, len: u64) -> crate::rm::Result<()> {
        self.fill(offset, len, 0)
    }
}

/// The host's half of the ring protocol (the device's is `reserve`/`publish` in kernels/apex_printf.cu): takes
/// every published record from `head` on, zeroes what it consumed (so a later record's unwritten header reads as
/// "not ready"), then moves `head`. Stops at the first record reserved but not yet written.
pub fn take_records(
    m: &impl RingMemory,
    capacity: u64,
    reported: &mut u64,
) -> crate::rm::Result<(Vec<DeviceRecord>, u64)> {
    let mask = capacity - 1;
    let read_ring = |pos: u64, out: &mut [u8]| -> crate::rm::Result<()> {
        let at = pos & mask;
        let first = (capacity - at).min(out.len() as u64) as usize;
        let (a, b) = out.split_at_mut(first);
        m.read(HEADER_BYTES + at, a)?;
        if !b.is_empty() {
            m.read(HEADER_BYTES, b)?;
        }
        Ok(())
    };
    let consume = |pos: u64, len: u64| -> crate::rm::Result<()> {
        let at = pos & mask;
        let first = (capacity - at).min(len);
        m.zero(HEADER_BYTES + at, first)?;
        if len > first {
            m.zero(HEADER_BYTES, len - first)?;
        }
        Ok(())
    };
    let tail = m.load(TAIL)?;
    let head = m.load(HEAD)?;
    let dropped_total = m.load(DROPPED)?;
    let dropped = dropped_total.wrapping_sub(*reported);
    *reported = dropped_total;
    let mut out = Vec::new();
    if tail.wrapping_sub(head) > capacity {
        warn!(
            head,
            tail, "printf FIFO indices are inconsistent; its contents are discarded"
        );
        consume(0, capacity)?;
        m.store(HEAD, tail)?;
        return Ok((out, dropped));
    }
    let mut pos = head;
    while pos != tail {
        let first = m.load(HEADER_BYTES + (pos & mask))?;
        let (kind, len) = (first as u32, first >> 32);
        if kind == 0 {
            break; // reserved, not yet written: later records wait for it
        }
        if len < 8 || len % 8 != 0 || len > tail.wrapping_sub(pos) {
            warn!(
                kind,
                len, "corrupt printf record; the rest of the FIFO is discarded"
            );
            consume(pos, tail.wrapping_sub(pos))?;
            pos = tail;
            break;
        }
        std::sync::atomic::fence(Ordering::Acquire);
        let mut rec = vec![0u8; len as usize];
        read_ring(pos, &mut rec)?;
        match decode_record(&rec) {
            Ok(r) => out.push(r),
            Err(e) => warn!(error = %e, "skipping a printf record"),
        }
        consume(pos, len)?;
        pos = pos.wrapping_add(len);
    }
    if pos != head {
        m.store(HEAD, pos)?;
    }
    Ok((out, dropped))
}

/// The printf FIFO of one GPU, created on first use with the size set before it (as CUDA fixes
/// `cudaLimitPrintfFifoSize` once a module that uses printf is loaded).
#[derive(Debug, Default)]
pub struct PrintfFifoCell {
    fifo: OnceLock<Arc<PrintfFifo>>,
    bytes: AtomicU64,
    /// [`AssertAction::EndThread`] asked for (applied when the FIFO is made, or at once if it exists).
    end_thread: std::sync::atomic::AtomicBool,
}

impl PrintfFifoCell {
    /// An empty cell; the FIFO will have [`DEFAULT_FIFO_BYTES`] unless set otherwise first.
    pub fn new() -> PrintfFifoCell {
        PrintfFifoCell::default()
    }

    /// Sets the FIFO's size. Fails once the FIFO exists (a module that uses printf has been loaded).
    pub fn set_size(&self, bytes: u64) -> Result<(), u64> {
        match self.fifo.get() {
            Some(f) => Err(f.capacity()),
            None => {
                self.bytes.store(bytes, Ordering::Relaxed);
                Ok(())
            }
        }
    }

    /// Sets how a failed `assert` ends, for the FIFO now or when it is made.
    pub fn set_assert_action(&self, action: AssertAction) -> crate::rm::Result<()> {
        self.end_thread
            .store(action == AssertAction::EndThread, Ordering::SeqCst);
        match self.fifo.get() {
            Some(f) => f.set_assert_action(action),
            None => Ok(()),
        }
    }

    /// The FIFO, created now if it does not exist yet.
    pub fn get_or_create(&self, gpu: &Arc<GpuCore>) -> crate::rm::Result<Arc<PrintfFifo>> {
        if let Some(f) = self.fifo.get() {
            return Ok(f.clone());
        }
        let bytes = match self.bytes.load(Ordering::Relaxed) {
            0 => DEFAULT_FIFO_BYTES,
            b => b,
        };
        let fifo = Arc::new(PrintfFifo::new(gpu, bytes)?);
        // Two threads may race here: the loser's ring is dropped unused.
        let fifo = self.fifo.get_or_init(|| fifo).clone();
        if self.end_thread.load(Ordering::SeqCst) {
            fifo.set_assert_action(AssertAction::EndThread)?;
        }
        Ok(fifo)
    }

    /// The FIFO, if it exists.
    pub fn get(&self) -> Option<&Arc<PrintfFifo>> {
        self.fifo.get()
    }
}
