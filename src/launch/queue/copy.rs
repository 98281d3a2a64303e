//! Copies and fills ordered like launches: on the copy engines, or with the built-in kernels on the SMs.

use std::sync::Arc;

use crate::launch::copies::{COPY_SEMAPHORE_SLOT, record_copy};
use crate::launch::params::Arg;
use crate::launch::{Error, Result};
use crate::module::Kernel;
use crate::pushbuf::{Acquire, Fence, Signal};

use super::config::LaunchConfig;
use super::{ComputeQueue, PreparedLaunch};

/// Kernels APEX launches itself (kernels/apex_builtin.cu).
const BUILTIN_CUBIN: &[u8] = include_bytes!("../../../kernels/apex_builtin.sm_90.cubin");

/// Threads per block of the built-in kernels.
const BUILTIN_THREADS: u32 = 256;

/// Size classes of the built-in kernels' grids: the grid's size rounded up to a power of two, 2^0 to 2^32.
const GRID_CLASSES: usize = 33;

/// A built-in kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Builtin {
    Copy = 0,
    Fill = 1,
}

/// The built-in kernels, and per kernel and grid size class the prepared launch that runs it: a copy or memset
/// costs what a prepared launch costs (no kernel looked up by name, no QMD built, no reference count taken or
/// dropped after the doorbell).
pub(super) struct BuiltinLaunches {
    copy: Kernel,
    fill: Kernel,
    prepared: [[Option<PreparedLaunch>; GRID_CLASSES]; 2],
}

impl BuiltinLaunches {
    fn kernel(&self, which: Builtin) -> &Kernel {
        match which {
            Builtin::Copy => &self.copy,
            Builtin::Fill => &self.fill,
        }
    }
}

/// Blocks of a built-in kernel's launch over `bytes` bytes: 16 bytes per thread per pass, rounded up to a power of
/// two, at most 8 per SM. The kernels stride over the grid, so any grid covers any size; whole powers of two keep
/// the shapes, and so the prepared launches, few.
pub(super) fn builtin_blocks(bytes: u64, sm_count: u32) -> u32 {
    let cap = u64::from(sm_count.max(1)) * 8;
    bytes
        .div_ceil(16 * u64::from(BUILTIN_THREADS))
        .max(1)
        .next_power_of_two()
        .min(cap) as u32
}

/// The size class of a grid of `blocks` blocks ([`builtin_blocks`]): log2 of its size rounded up to a power of two.
/// Distinct for every grid `builtin_blocks` makes: a power of two below the cap, or the cap, whose class is above
/// theirs.
fn grid_class(blocks: u32) -> usize {
    blocks
        .checked_next_power_of_two()
        .map_or(GRID_CLASSES - 1, |p| p.trailing_zeros() as usize)
}

impl ComputeQueue {
    /// Copies `bytes` from `src` to `dst` on the copy engines of `engines` (split across them), after every
    /// earlier launch and copy of this queue; later ones run after it. Both ranges must be mapped on the
    /// engines' GPU (a peer's memory included): the way to fill an NVLink with one copy. The engines may belong
    /// to another GPU of this queue's peer domain (the source GPU of a copy between GPUs, pushing into the
    /// destination's memory): this queue's timeline is then mapped on that GPU and the engines' on this one,
    /// once, so the GPUs order the copy between them without the CPU.
    pub fn copy_on(
        &mut self,
        engines: &mut crate::launch::CopyEngines,
        src: u64,
        dst: u64,
        bytes: u64,
    ) -> Result<Fence> {
        if !Arc::ptr_eq(engines.gpu(), &self.gpu) {
            // Refused with the reason (no shared address space) before anything is mapped.
            self.gpu.check_same_domain(engines.gpu())?;
            self.queue
                .timeline()
                .semaphores()
                .memory()
                .map_on(engines.gpu())?;
            engines.map_semaphores_on(&self.gpu)?;
        }
        let prev = self.settle_earlier()?;
        let after =
            (!self.queue.timeline().is_reached(prev)).then(|| (self.queue.timeline().va(), prev));
        let parts = engines.copy(src, dst, bytes, after)?;
        // Yield while the engines work (see CopyEngines::copy), unless yielding would switch out the group other
        // queues' kernels run in; spinning there holds up only this channel.
        let yield_group = !self.queue.channel().shares_group();
        Ok(self
            .queue
            .submit(8 * parts.len() + 8, Signal::Host, |p, _| {
                for &(va, value) in parts {
                    p.sem_acquire(va, value, Acquire::CircularGeq, true, yield_group);
                }
            })?)
    }

    /// Copies `bytes` of device memory from `src` to `dst` with a copy kernel on the SMs, ordered like a launch:
    /// the copy engine moves device-to-device data at about 90 GB/s on the H200, the SMs at the HBM's bandwidth.
    ///
    /// # Safety
    /// Both ranges must be device memory mapped in this GPU's address space for `bytes` bytes; the kernel writes
    /// `dst` as any kernel would.
    pub unsafe fn copy_device(&mut self, src: u64, dst: u64, bytes: u64) -> Result<Fence> {
        // SAFETY: forwarded to the caller.
        let value = unsafe { self.record_copy_device_value(src, dst, bytes)? };
        // The fence (a reference count, a locked instruction) before the doorbell: after it, it would wait for the
        // doorbell's uncached store to leave the CPU.
        let fence = self.queue.fence_for(value);
        self.send_launch_now();
        Ok(fence)
    }

    /// As [`copy_device`](Self::copy_device) without ringing the doorbell ([`flush`](Self::flush) sends it), returning
    /// the copy's value on the queue's timeline ([`fence_for`](Self::fence_for) makes its fence). The copy is a
    /// prepared launch of the built-in copy kernel: it allocates nothing once the queue has copied a range of this
    /// size class before.
    ///
    /// # Safety
    /// As for [`copy_device`](Self::copy_device).
    pub unsafe fn record_copy_device_value(
        &mut self,
        src: u64,
        dst: u64,
        bytes: u64,
    ) -> Result<u64> {
        if bytes == 0 {
            return Err(Error::InvalidLaunch {
                kernel: "apex_copy".into(),
                why: "a copy of 0 bytes".into(),
            });
        }
        // SAFETY: forwarded to the caller.
        unsafe {
            self.record_builtin(
                Builtin::Copy,
                bytes,
                &[Arg::Ptr(src), Arg::Ptr(dst), Arg::U64(bytes)],
            )
        }
    }

    /// Sets `count` elements of `width` bytes (1, 2 or 4) at `dst` to the low bytes of `value`
    /// (`cuMemsetD8/16/32`) with a fill kernel on the SMs, ordered like a launch.
    ///
    /// # Safety
    /// `dst` must be memory mapped in this GPU's address space for `count * width` bytes, aligned to `width`; the
    /// kernel writes it as any kernel would.
    pub unsafe fn fill(&mut self, dst: u64, value: u32, width: u32, count: u64) -> Result<Fence> {
        // SAFETY: forwarded to the caller.
        let v = unsafe { self.record_fill_value(dst, value, width, count)? };
        // As in `copy_device`: the fence before the doorbell.
        let fence = self.queue.fence_for(v);
        self.send_launch_now();
        Ok(fence)
    }

    /// As [`fill`](Self::fill) without ringing the doorbell ([`flush`](Self::flush) sends it), returning the fill's
    /// value on the queue's timeline. The fill is a prepared launch of the built-in fill kernel: it allocates nothing
    /// once the queue has filled a range of this size class before.
    ///
    /// # Safety
    /// As for [`fill`](Self::fill).
    pub unsafe fn record_fill_value(
        &mut self,
        dst: u64,
        value: u32,
        width: u32,
        count: u64,
    ) -> Result<u64> {
        let bad = |why: String| Error::InvalidLaunch {
            kernel: "apex_fill".into(),
            why,
        };
        if !matches!(width, 1 | 2 | 4) {
            return Err(bad(format!(
                "an element width of {width} bytes (1, 2 or 4)"
            )));
        }
        if !dst.is_multiple_of(u64::from(width)) {
            return Err(bad(format!("{dst:#x} is not aligned to {width} bytes")));
        }
        let bytes = count
            .checked_mul(u64::from(width))
            .filter(|&b| b > 0)
            .ok_or_else(|| bad(format!("{count} elements of {width} bytes")))?;
        // SAFETY: forwarded to the caller.
        unsafe {
            self.record_builtin(
                Builtin::Fill,
                bytes,
                &[
                    Arg::Ptr(dst),
                    Arg::U32(value),
                    Arg::U32(width),
                    Arg::U64(count),
                ],
            )
        }
    }

    /// Records a launch of built-in kernel `which` over `bytes` bytes, in stream order, as the prepared launch of its
    /// size class (built at the class's first use, and again when the queue's local memory has grown since).
    ///
    /// # Safety
    /// `args` must be what the kernel may run with: the ranges they name mapped on this GPU, as the public callers
    /// require.
    unsafe fn record_builtin(
        &mut self,
        which: Builtin,
        bytes: u64,
        args: &[Arg<'_>],
    ) -> Result<u64> {
        let blocks = builtin_blocks(bytes, self.gpu.info().sm_count);
        let class = grid_class(blocks);
        let held = self.builtin_launches()?.prepared[which as usize][class].take();
        let prepared = match held {
            Some(p)
                if p.built_for_local() == self.local_per_thread && p.config().grid[0] == blocks =>
            {
                p
            }
            _ => {
                let kernel = self.builtin_launches()?.kernel(which).clone();
                self.prepare_launch(&kernel, &LaunchConfig::linear(blocks, BUILTIN_THREADS))?
            }
        };
        // Never held as a link of a chained queue: the callers ring with a plain doorbell (which sends no held link),
        // and may wait for the work at once. Recorded after the links held so far, which it sends first.
        self.hold_off = true;
        // SAFETY: forwarded to the caller.
        let value = unsafe { self.record_prepared_value(&prepared, args, false) };
        self.hold_off = false;
        // Put back whether or not the launch was recorded (a move: no reference count changes hands).
        if let Some(b) = self.builtin.as_mut() {
            b.prepared[which as usize][class] = Some(prepared);
        }
        value
    }

    /// The built-in kernels and their prepared launches, the module loaded on first use.
    fn builtin_launches(&mut self) -> Result<&mut BuiltinLaunches> {
        if self.builtin.is_none() {
            let module = crate::module::Module::load(&self.gpu, BUILTIN_CUBIN)?;
            self.builtin = Some(Box::new(BuiltinLaunches {
                copy: module.kernel("apex_copy")?,
                fill: module.kernel("apex_fill")?,
                prepared: std::array::from_fn(|_| std::array::from_fn(|_| None)),
            }));
        }
        self.builtin
            .as_deref_mut()
            .ok_or(Error::Unsupported("the built-in kernels".into()))
    }

    /// The built-in copy kernel (loaded on first use) and the launch shape that copies `bytes` bytes with it
    /// ([`builtin_blocks`]).
    pub(super) fn copy_launch(&mut self, bytes: u64) -> Result<(Kernel, LaunchConfig)> {
        let blocks = builtin_blocks(bytes, self.gpu.info().sm_count);
        let k = self.builtin_launches()?.copy.clone();
        Ok((k, LaunchConfig::linear(blocks, BUILTIN_THREADS)))
    }

    /// Copies `bytes` from `src` to `dst` (GPU addresses: device or host memory mapped for the GPU) with the copy
    /// engine, after every earlier launch and copy of this queue; later ones run after it.
    pub fn copy(&mut self, src: u64, dst: u64, bytes: u64) -> Result<Fence> {
        if bytes == 0 {
            return Err(Error::InvalidLaunch {
                kernel: "copy".into(),
                why: "a copy of 0 bytes".into(),
            });
        }
        let prev = self.settle_earlier()?;
        let prev_done = self.queue.timeline().is_reached(prev);
        let timeline_va = self.queue.timeline().va();
        let copy_sem = self.queue.channel().semaphores().va(COPY_SEMAPHORE_SLOT);
        let chunks = bytes.div_ceil(crate::pushbuf::Push::MAX_COPY_CHUNK) as usize;
        let fence = self
            .queue
            .submit(chunks * 12 + 32, Signal::Recorded, |p, v| {
                if !prev_done {
                    p.sem_acquire(timeline_va, prev, Acquire::CircularGeq, true, false);
                }
                record_copy(p, src, dst, bytes, copy_sem, timeline_va, v);
            })?;
        Ok(fence)
    }
}
