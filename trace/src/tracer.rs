//! The tracer's state: which fds are NVIDIA nodes, what driver memory is mapped where, the channels
//! found, the record queue, and the background thread that polls channels and writes records.

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use apex::gpfifo::GpEntry;
use apex::launch::occupancy::{self, DeviceLimits, KernelResources};
use apex::rm::sys;

use crate::decode::ChannelDecoder;
use crate::record::*;

/// What an fd refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Node {
    /// Not looked at yet.
    Unknown,
    /// Not an NVIDIA device node.
    Other,
    /// `/dev/nvidiactl`, the control node RM clients are created on.
    Ctl,
    /// `/dev/nvidia-uvm`.
    Uvm,
    /// Another `/dev/nvidia*` node (`nvidia-modeset`, `nvidia-caps`, ...).
    OtherNvidia,
    /// `/dev/nvidiaN`.
    Gpu(u8),
}

impl Node {
    fn to_u8(self) -> u8 {
        match self {
            Node::Unknown => 0,
            Node::Other => 1,
            Node::Ctl => 2,
            Node::Uvm => 3,
            Node::OtherNvidia => 4,
            Node::Gpu(n) => 16u8.saturating_add(n),
        }
    }

    fn from_u8(v: u8) -> Node {
        match v {
            0 => Node::Unknown,
            1 => Node::Other,
            2 => Node::Ctl,
            3 => Node::Uvm,
            4 => Node::OtherNvidia,
            n => Node::Gpu(n - 16),
        }
    }

    /// Whether this is one of NVIDIA's device nodes (the tracer records its ioctls and mappings).
    pub fn is_nvidia(self) -> bool {
        !matches!(self, Node::Unknown | Node::Other)
    }

    /// The name records use for the node (`nvidiactl`, `nvidia0`, `nvidia-uvm`, ...).
    pub fn name(self) -> String {
        match self {
            Node::Ctl => "nvidiactl".into(),
            Node::Uvm => "nvidia-uvm".into(),
            Node::Gpu(n) => format!("nvidia{n}"),
            Node::OtherNvidia => "nvidia-other".into(),
            Node::Unknown | Node::Other => "other".into(),
        }
    }

    /// Classifies a device path (no allocation: called from open hooks).
    pub fn of_path(p: &[u8]) -> Node {
        let Some(rest) = p.strip_prefix(b"/dev/nvidia") else {
            return Node::Other;
        };
        match rest {
            b"ctl" => Node::Ctl,
            b"-uvm" => Node::Uvm,
            d if !d.is_empty() && d.len() <= 3 && d.iter().all(u8::is_ascii_digit) => {
                let n = d.iter().fold(0u32, |a, c| a * 10 + u32::from(c - b'0'));
                Node::Gpu(n.min(200) as u8)
            }
            _ => Node::OtherNvidia,
        }
    }
}

const FD_SLOTS: usize = 1 << 16;
/// Node kind per fd (0 = not looked at yet). Static: the hooks must not allocate to consult it.
static FD_KIND: [AtomicU8; FD_SLOTS] = [const { AtomicU8::new(0) }; FD_SLOTS];

/// Records what `fd` refers to (from the open hooks; `close` resets it).
pub fn set_fd(fd: i32, node: Node) {
    if let Some(slot) = usize::try_from(fd).ok().and_then(|i| FD_KIND.get(i)) {
        slot.store(node.to_u8(), Ordering::Relaxed);
    }
}

/// The node behind `fd`, from the open hooks or else from /proc/self/fd (cached).
pub fn fd_node(fd: i32) -> Node {
    let slot = usize::try_from(fd).ok().and_then(|i| FD_KIND.get(i));
    if let Some(s) = slot {
        let v = Node::from_u8(s.load(Ordering::Relaxed));
        if v != Node::Unknown {
            return v;
        }
    }
    let node = readlink_fd(fd).unwrap_or(Node::Other);
    set_fd(fd, node);
    node
}

fn readlink_fd(fd: i32) -> Option<Node> {
    if fd < 0 {
        return None;
    }
    // "/proc/self/fd/<fd>\0" in a stack buffer.
    let mut path = [0u8; 32];
    let prefix = b"/proc/self/fd/";
    path[..prefix.len()].copy_from_slice(prefix);
    let mut digits = [0u8; 10];
    let (mut n, mut i) = (fd as u32, 0);
    loop {
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        i += 1;
        if n == 0 {
            break;
        }
    }
    for k in 0..i {
        path[prefix.len() + k] = digits[i - 1 - k];
    }
    let mut buf = [0u8; 256];
    // SAFETY: `path` is NUL-terminated (zero-filled past the digits); `buf` is writable for its length.
    let len = unsafe { libc::readlink(path.as_ptr().cast(), buf.as_mut_ptr().cast(), buf.len()) };
    let len = usize::try_from(len).ok()?;
    Some(Node::of_path(&buf[..len]))
}

/// A CPU mapping of an NVIDIA node.
#[derive(Clone, Copy, Debug)]
struct Mapping {
    addr: u64,
    len: u64,
    readable: bool,
}

/// An RM memory handle mapped for the CPU: RM_MAP_MEMORY, then mmap on the fd it named.
#[derive(Clone, Copy, Debug)]
struct HandleMap {
    handle: u32,
    mem_offset: u64,
    len: u64,
    cpu: u64,
}

#[derive(Default)]
struct Memory {
    maps: Vec<Mapping>,
    handles: Vec<HandleMap>,
    /// RM_MAP_MEMORY calls waiting for their mmap: (fd, handle, offset, length).
    pending: Vec<(i32, u32, u64, u64)>,
}

impl Memory {
    fn forget(&mut self, addr: u64, len: u64) {
        let end = addr.saturating_add(len);
        self.maps
            .retain(|m| m.addr + m.len <= addr || m.addr >= end);
        self.handles
            .retain(|h| h.cpu + h.len <= addr || h.cpu >= end);
    }
}

struct Chan {
    rec: ChannelRecord,
    dec: ChannelDecoder,
    last_put: u32,
    userd_cpu: Option<u64>,
}

#[derive(Default)]
struct Agg {
    launches: u64,
    shapes: BTreeMap<([u32; 3], [u32; 3], u32), u64>,
    registers: u32,
    shared: u32,
    version: u8,
}

impl Agg {
    fn add(&mut self, grid: [u32; 3], block: [u32; 3], shared: u32) {
        self.launches += 1;
        *self.shapes.entry((grid, block, shared)).or_default() += 1;
    }
}

#[derive(Default)]
struct Stats {
    s: SummaryRecord,
    by_address: BTreeMap<u64, Agg>,
    by_name: BTreeMap<String, Agg>,
    /// Driver launches not yet matched to a QMD, in order: (name, grid, block).
    unmatched: VecDeque<(String, [u32; 3], [u32; 3])>,
    names: BTreeMap<u64, String>,
    /// Driver-API stream and event calls by entry point.
    calls: BTreeMap<String, u64>,
}

/// Records kept in memory before the writer thread catches up; beyond this they are dropped.
const QUEUE_MAX: usize = 1 << 18;

/// The tracer: the start time, the record queue and output file, the NVIDIA mappings and the channels being
/// decoded.
pub struct Tracer {
    start: Instant,
    queue: Mutex<VecDeque<Record>>,
    writer: Mutex<Option<BufWriter<File>>>,
    mem: Mutex<Memory>,
    chans: Mutex<Vec<Chan>>,
    stats: Mutex<Stats>,
    stop: AtomicBool,
    finished: AtomicBool,
}

/// Locks even if a panicking thread poisoned the lock: the tracer must keep the program running.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

static TRACER: OnceLock<Tracer> = OnceLock::new();
/// Set in a fork child: the child's copy of the locks may be held by threads that do not exist there.
pub static DISABLED: AtomicBool = AtomicBool::new(false);

/// The tracer, started on first use (the first NVIDIA fd seen).
pub fn get() -> &'static Tracer {
    let mut fresh = false;
    let t = TRACER.get_or_init(|| {
        fresh = true;
        let writer = std::env::var_os("APEX_TRACE_FILE")
            .and_then(|p| File::create(trace_path(&p, std::process::id())).ok())
            .map(BufWriter::new);
        Tracer {
            start: Instant::now(),
            queue: Mutex::new(VecDeque::new()),
            writer: Mutex::new(writer),
            mem: Mutex::new(Memory::default()),
            chans: Mutex::new(Vec::new()),
            stats: Mutex::new(Stats::default()),
            stop: AtomicBool::new(false),
            finished: AtomicBool::new(false),
        }
    });
    if fresh {
        crate::hooks::on_tracer_start();
        // The poller runs with the hook guard set for its whole life: its own I/O is not traced.
        let _ = std::thread::Builder::new()
            .name("apex-trace".into())
            .spawn(|| {
                crate::hooks::enter_forever();
                let t = get();
                while !t.stop.load(Ordering::Relaxed) {
                    let busy = t.poll();
                    t.drain();
                    if !busy {
                        std::thread::sleep(Duration::from_micros(20));
                    }
                }
            });
    }
    t
}

/// The tracer if it was started.
pub fn started() -> Option<&'static Tracer> {
    TRACER.get()
}

impl Tracer {
    /// Nanoseconds since the tracer started (the records' `t_ns`).
    pub fn now_ns(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    /// Counts `r` for the summary and queues it for the file.
    pub fn emit(&self, r: Record) {
        {
            let mut st = lock(&self.stats);
            st.count(&r);
        }
        if lock(&self.writer).is_none() {
            return;
        }
        let mut q = lock(&self.queue);
        if q.len() < QUEUE_MAX {
            q.push_back(r);
        } else {
            lock(&self.stats).s.dropped += 1;
        }
    }

    fn drain(&self) {
        let mut w = lock(&self.writer);
        let Some(w) = w.as_mut() else {
            return;
        };
        let batch: Vec<Record> = lock(&self.queue).drain(..).collect();
        for r in batch {
            let _ = serde_json::to_writer(&mut *w, &r);
            let _ = w.write_all(b"\n");
        }
    }

    // ---- memory ----

    /// Notes a successful mmap of an NVIDIA node at `addr`, so the poller may read it; if RM_MAP_MEMORY prepared
    /// a mapping on `fd` ([`Tracer::map_requested`]), the RM memory handle is now known at that CPU address.
    pub fn mapped(&self, fd: i32, addr: u64, len: u64, prot: i32) {
        let mut m = lock(&self.mem);
        m.forget(addr, len);
        m.maps.push(Mapping {
            addr,
            len,
            readable: prot & libc::PROT_READ != 0,
        });
        if let Some(i) = m.pending.iter().position(|p| p.0 == fd) {
            let (_, handle, mem_offset, _) = m.pending.remove(i);
            m.handles.push(HandleMap {
                handle,
                mem_offset,
                len,
                cpu: addr,
            });
        }
    }

    /// Takes the memory lock across the caller's munmap/MAP_FIXED so the poller never reads a
    /// range while it goes away.
    pub fn unmapping(&self, addr: u64, len: u64) -> impl Drop + '_ {
        let mut m = lock(&self.mem);
        m.forget(addr, len);
        m
    }

    /// Notes a successful RM_MAP_MEMORY: the mmap of `fd` that follows maps `len` bytes at `offset` of the RM
    /// memory `handle` (how the tracer finds a channel's USERD to read GP_PUT).
    pub fn map_requested(&self, fd: i32, handle: u32, offset: u64, len: u64) {
        let mut m = lock(&self.mem);
        m.pending.retain(|p| p.0 != fd);
        m.pending.push((fd, handle, offset, len));
    }

    /// Copies `len` bytes at CPU address `addr` if one readable NVIDIA mapping covers them.
    pub fn read(&self, addr: u64, len: usize) -> Option<Vec<u8>> {
        let m = lock(&self.mem);
        let end = addr.checked_add(len as u64)?;
        m.maps
            .iter()
            .find(|x| x.readable && x.addr <= addr && end <= x.addr + x.len)?;
        let mut out = vec![0u8; len];
        // SAFETY: [addr, end) lies inside a live readable mapping of an NVIDIA node; it cannot be
        // unmapped meanwhile because munmap and MAP_FIXED through our hooks wait for `mem`.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), len) };
        Some(out)
    }

    fn read_u32(&self, addr: u64) -> Option<u32> {
        let m = lock(&self.mem);
        m.maps
            .iter()
            .find(|x| x.readable && x.addr <= addr && addr + 4 <= x.addr + x.len)?;
        // SAFETY: as in `read`; a volatile read because the program's other threads write it.
        Some(unsafe { std::ptr::read_volatile(addr as *const u32) })
    }

    fn userd_cpu(&self, handle: u32, offset: u64) -> Option<u64> {
        let m = lock(&self.mem);
        m.handles
            .iter()
            .find(|h| h.handle == handle && h.mem_offset <= offset && offset < h.mem_offset + h.len)
            .map(|h| h.cpu + (offset - h.mem_offset))
    }

    // ---- channels ----

    /// Starts following a GPFIFO channel the program allocated, and emits its record.
    pub fn channel(&self, rec: ChannelRecord) {
        let mut c = lock(&self.chans);
        c.push(Chan {
            dec: ChannelDecoder::new(rec.handle),
            rec: rec.clone(),
            last_put: 0,
            userd_cpu: None,
        });
        drop(c);
        self.emit(Record::Channel(rec));
    }

    /// Decodes the new GPFIFO entries of every channel; true if there were any.
    fn poll(&self) -> bool {
        let gpput = std::mem::offset_of!(sys::HopperAControlGPFifo, GPPut) as u64;
        let mut any = false;
        let mut out = Vec::new();
        let mut chans = lock(&self.chans);
        for c in chans.iter_mut() {
            if c.userd_cpu.is_none() {
                c.userd_cpu = self.userd_cpu(c.rec.userd_handle, c.rec.userd_offset);
            }
            let Some(userd) = c.userd_cpu else { continue };
            let entries = c.rec.entries;
            let Some(put) = self.read_u32(userd + gpput) else {
                continue;
            };
            if put >= entries || put == c.last_put {
                continue;
            }
            any = true;
            while c.last_put != put {
                let slot = c.last_put;
                c.last_put = (slot + 1) % entries;
                let Some(raw) = self
                    .read(c.rec.gpfifo_va + 8 * u64::from(slot), 8)
                    .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
                else {
                    continue;
                };
                let e = GpEntry(raw);
                let (va, dwords) = (e.va(), e.dwords());
                let t = self.now_ns();
                let mut sub = SubmissionRecord {
                    t_ns: t,
                    channel: c.rec.handle,
                    slot,
                    entry: raw,
                    va,
                    dwords: dwords as u32,
                    methods: Vec::new(),
                    undecoded: None,
                };
                match self.read(va, dwords as usize * 4) {
                    Some(bytes) => {
                        let words: Vec<u32> = bytes
                            .chunks_exact(4)
                            .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
                            .collect();
                        let seg = c.dec.segment(&words, t, &|a, n| self.read(a, n));
                        sub.methods = seg.methods;
                        sub.undecoded = seg.undecoded;
                        out.push(Record::Submission(sub));
                        out.extend(seg.qmd_uploads.into_iter().map(Record::QmdUpload));
                        out.extend(seg.launches.into_iter().map(Record::Launch));
                    }
                    None => {
                        sub.undecoded = Some(Undecoded {
                            reason: "pushbuffer segment not mapped for the CPU".into(),
                            words: Vec::new(),
                        });
                        out.push(Record::Submission(sub));
                    }
                }
            }
        }
        drop(chans);
        for r in out {
            self.emit(r);
        }
        any
    }

    /// At exit: a last poll, the summary, everything written.
    pub fn finish(&self) {
        if self.finished.swap(true, Ordering::SeqCst) {
            return;
        }
        self.stop.store(true, Ordering::SeqCst);
        self.poll();
        let summary = lock(&self.stats).summary();
        let traced =
            summary.ioctls > 0 || summary.driver_launches > 0 || !summary.driver_calls.is_empty();
        {
            let mut w = lock(&self.writer);
            if let Some(w) = w.as_mut() {
                let batch: Vec<Record> = lock(&self.queue).drain(..).collect();
                for r in batch.iter().chain([&Record::Summary(summary.clone())]) {
                    let _ = serde_json::to_writer(&mut *w, r);
                    let _ = w.write_all(b"\n");
                }
                let _ = w.flush();
            }
        }
        if traced {
            eprint!("{}", render(&summary));
        }
    }
}

impl Stats {
    fn count(&mut self, r: &Record) {
        match r {
            Record::Ioctl(_) => self.s.ioctls += 1,
            Record::Channel(_) => self.s.channels += 1,
            Record::Submission(s) => {
                self.s.submissions += 1;
                self.s.undecoded += u64::from(s.undecoded.is_some());
            }
            Record::Launch(l) if l.kernel => {
                self.s.qmd_launches += 1;
                let a = self.by_address.entry(l.program_address).or_default();
                a.add(l.grid, l.block, l.shared_bytes);
                a.registers = l.registers;
                a.shared = l.shared_bytes;
                a.version = l.qmd_version;
                // Driver launches and QMDs come in program order: the first driver launch of the
                // same shape names this program address.
                if !self.names.contains_key(&l.program_address)
                    && let Some(i) = self
                        .unmatched
                        .iter()
                        .position(|(_, g, b)| *g == l.grid && *b == l.block)
                {
                    let (name, _, _) = self.unmatched.remove(i).expect("position is in range");
                    self.unmatched.drain(..i);
                    self.names.insert(l.program_address, name);
                }
            }
            Record::Launch(_) | Record::QmdUpload(_) => {}
            Record::DriverLaunch(d) => {
                self.s.driver_launches += 1;
                let name = d
                    .name
                    .clone()
                    .unwrap_or_else(|| format!("{:#x}", d.function));
                self.by_name
                    .entry(name.clone())
                    .or_default()
                    .add(d.grid, d.block, d.shared_bytes);
                if self.unmatched.len() < 4096 {
                    self.unmatched.push_back((name, d.grid, d.block));
                }
            }
            Record::DriverCall(c) => {
                if let Some(n) = self.calls.get_mut(c.api.as_str()) {
                    *n += 1;
                } else {
                    self.calls.insert(c.api.clone(), 1);
                }
            }
            Record::Summary(_) => {}
        }
    }

    fn summary(&self) -> SummaryRecord {
        let sm_count = std::env::var("APEX_TRACE_SM_COUNT")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(132);
        let shapes = |a: &Agg| {
            let mut v: Vec<ShapeCount> = a
                .shapes
                .iter()
                .map(|(&(grid, block, shared_bytes), &count)| ShapeCount {
                    grid,
                    block,
                    shared_bytes,
                    count,
                })
                .collect();
            v.sort_by_key(|s| std::cmp::Reverse(s.count));
            v
        };
        let mut s = self.s.clone();
        s.driver_calls = self
            .calls
            .iter()
            .map(|(api, &count)| CallCount {
                api: api.clone(),
                count,
            })
            .collect();
        s.driver_calls
            .sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.api.cmp(&b.api)));
        s.kernels = self
            .by_address
            .iter()
            .map(|(&addr, a)| {
                let shapes = shapes(a);
                let (occ, advice) = advise(a, &shapes, sm_count);
                KernelSummary {
                    name: self.names.get(&addr).cloned(),
                    program_address: Some(addr),
                    launches: a.launches,
                    shapes,
                    registers: a.registers,
                    shared_bytes: a.shared,
                    occupancy: occ,
                    advice,
                }
            })
            .collect();
        s.driver_kernels = self
            .by_name
            .iter()
            .map(|(name, a)| KernelSummary {
                name: Some(name.clone()),
                program_address: None,
                launches: a.launches,
                shapes: shapes(a),
                registers: 0,
                shared_bytes: 0,
                occupancy: None,
                advice: Vec::new(),
            })
            .collect();
        s
    }
}

/// Occupancy and advice for a kernel's most frequent shape (QMD V4 → sm_90; others unknown).
fn advise(a: &Agg, shapes: &[ShapeCount], sm_count: u32) -> (Option<String>, Vec<String>) {
    let sm = match a.version {
        4 => 90,
        _ => return (None, Vec::new()),
    };
    let (Some(limits), Some(top)) = (DeviceLimits::for_sm(sm, sm_count), shapes.first()) else {
        return (None, Vec::new());
    };
    // The QMD's shared size is static (with the reserve on sm_90) + dynamic: all of it counts.
    let k = KernelResources::new(a.registers, top.shared_bytes, true);
    let threads = top.block.iter().product::<u32>();
    let grid = top.grid.iter().map(|&g| u64::from(g)).product::<u64>();
    let occ = occupancy::occupancy(&limits, &k, threads, 0)
        .map(|o| o.to_string())
        .unwrap_or_else(|e| e.to_string());
    let advice = occupancy::advise(&limits, &k, grid, threads, 0)
        .iter()
        .map(ToString::to_string)
        .collect();
    (Some(occ), advice)
}

/// The trace file's path: `APEX_TRACE_FILE` with every `%p` replaced by the process id, so that the processes of
/// one job (`torchrun`'s ranks, spawned workers) write one file each.
pub fn trace_path(setting: &std::ffi::OsStr, pid: u32) -> std::path::PathBuf {
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    let bytes = setting.as_bytes();
    let mut out = Vec::with_capacity(bytes.len() + 8);
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i..].starts_with(b"%p") {
            out.extend_from_slice(pid.to_string().as_bytes());
            i += 2;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    std::ffi::OsString::from_vec(out).into()
}

/// The stderr summary.
pub fn render(s: &SummaryRecord) -> String {
    let mut o = format!(
        "apex-trace: {} ioctls, {} channels, {} GPFIFO entries ({} undecoded), {} QMD launches, {} driver launches, {} records dropped\n",
        s.ioctls,
        s.channels,
        s.submissions,
        s.undecoded,
        s.qmd_launches,
        s.driver_launches,
        s.dropped
    );
    for k in &s.kernels {
        o += &format!(
            "  kernel {} @ {:#x}: {} launches, {} regs, {} B shared\n",
            k.name.as_deref().unwrap_or("?"),
            k.program_address.unwrap_or(0),
            k.launches,
            k.registers,
            k.shared_bytes
        );
        for sh in k.shapes.iter().take(4) {
            o += &format!(
                "    grid {:?} block {:?} shared {}: {}\n",
                sh.grid, sh.block, sh.shared_bytes, sh.count
            );
        }
        if let Some(occ) = &k.occupancy {
            o += &format!("    occupancy: {occ}\n");
        }
        for a in &k.advice {
            o += &format!("    advice: {a}\n");
        }
    }
    for k in &s.driver_kernels {
        o += &format!(
            "  driver launches of {}: {}\n",
            k.name.as_deref().unwrap_or("?"),
            k.launches
        );
    }
    if !s.driver_calls.is_empty() {
        let calls: Vec<String> = s
            .driver_calls
            .iter()
            .map(|c| format!("{} {}", c.api, c.count))
            .collect();
        o += &format!("  stream and event calls: {}\n", calls.join(", "));
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_path_names_each_process() {
        let p = |s: &str| trace_path(std::ffi::OsStr::new(s), 4242);
        assert_eq!(
            p("/tmp/t-%p.jsonl"),
            std::path::PathBuf::from("/tmp/t-4242.jsonl")
        );
        assert_eq!(p("/tmp/t.jsonl"), std::path::PathBuf::from("/tmp/t.jsonl"));
        assert_eq!(p("%p/%p"), std::path::PathBuf::from("4242/4242"));
        assert_eq!(p("100%"), std::path::PathBuf::from("100%"));
    }
}
