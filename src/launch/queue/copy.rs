//! Copies and fills ordered like launches: on the copy engines, or with the built-in kernels on the SMs.

use std::sync::Arc;

use crate::launch::copies::{COPY_SEMAPHORE_SLOT, record_copy};
use crate::launch::params::Arg;
use crate::launch::{Error, Result};
use crate::module::Kernel;
use crate::pushbuf::{Acquire, Fence, Signal};

use super::ComputeQueue;
use super::config::LaunchConfig;

/// Kernels APEX launches itself (kernels/apex_builtin.cu).
const BUILTIN_CUBIN: &[u8] = include_bytes!("../../../kernels/apex_builtin.sm_90.cubin");

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
        if bytes == 0 {
            return Err(Error::InvalidLaunch {
                kernel: "apex_copy".into(),
                why: "a copy of 0 bytes".into(),
            });
        }
        let (k, cfg) = self.copy_launch(bytes)?;
        // SAFETY: forwarded to the caller.
        unsafe { self.launch(&k, &cfg, &[Arg::Ptr(src), Arg::Ptr(dst), Arg::U64(bytes)]) }
    }

    /// Sets `count` elements of `width` bytes (1, 2 or 4) at `dst` to the low bytes of `value`
    /// (`cuMemsetD8/16/32`) with a fill kernel on the SMs, ordered like a launch.
    ///
    /// # Safety
    /// `dst` must be memory mapped in this GPU's address space for `count * width` bytes, aligned to `width`; the
    /// kernel writes it as any kernel would.
    pub unsafe fn fill(&mut self, dst: u64, value: u32, width: u32, count: u64) -> Result<Fence> {
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
        let (k, cfg) = self.builtin_launch("apex_fill", bytes)?;
        // SAFETY: forwarded to the caller.
        unsafe {
            self.launch(
                &k,
                &cfg,
                &[
                    Arg::Ptr(dst),
                    Arg::U32(value),
                    Arg::U32(width),
                    Arg::U64(count),
                ],
            )
        }
    }

    /// The built-in copy kernel (loaded on first use) and the launch shape that copies `bytes` bytes with it:
    /// 16 bytes per thread per pass, at most 8 blocks per SM (grid-stride beyond).
    pub(super) fn copy_launch(&mut self, bytes: u64) -> Result<(Kernel, LaunchConfig)> {
        self.builtin_launch("apex_copy", bytes)
    }

    /// Built-in kernel `name` (its module loaded on first use) and the launch shape that covers `bytes` bytes with
    /// it: 16 bytes per thread per pass, at most 8 blocks per SM (grid-stride beyond).
    fn builtin_launch(&mut self, name: &str, bytes: u64) -> Result<(Kernel, LaunchConfig)> {
        if self.builtin.is_none() {
            self.builtin = Some(crate::module::Module::load(&self.gpu, BUILTIN_CUBIN)?);
        }
        let module = self
            .builtin
            .as_ref()
            .ok_or(Error::Unsupported("the built-in kernels".into()))?;
        let k = module.kernel(name)?;
        let threads = 256u64;
        let blocks = bytes
            .div_ceil(16 * threads)
            .clamp(1, u64::from(self.gpu.info().sm_count) * 8) as u32;
        Ok((k, LaunchConfig::linear(blocks, threads as u32)))
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
