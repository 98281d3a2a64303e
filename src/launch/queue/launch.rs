//! Launches of a kernel with its arguments, checked and built per call: stream-ordered, cooperative,
//! programmatic and unordered.

use crate::launch::params::Arg;
use crate::launch::{Error, Result};
use crate::module::Kernel;
use crate::pushbuf::{Fence, Signal};
use crate::rm::{Memory, MemoryDesc};

use super::ComputeQueue;
use super::config::LaunchConfig;
use super::order::{Order, Release};

impl ComputeQueue {
    /// Launches `kernel` over `cfg` with `args` (checked against the kernel's parameter table). Launches on one
    /// queue run in order. The fence completes when the kernel has finished.
    ///
    /// # Safety
    /// The kernel runs with the queue's GPU access: it may read and write any address the arguments lead it to.
    /// The caller guarantees that buffers the kernel writes are not in use elsewhere until the fence completes.
    pub unsafe fn launch(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<Fence> {
        // SAFETY: forwarded.
        let fence = unsafe { self.record_launch(kernel, cfg, args)? };
        self.send_launch_now();
        Ok(fence)
    }

    /// Launches a kernel that synchronizes its whole grid (cooperative groups `this_grid().sync()`), as
    /// `cuLaunchCooperativeKernel` does: refused unless every block of the grid can be resident at once, and the
    /// kernel gets the grid barrier it synchronizes on. Cooperative launches on one queue run in order and share
    /// one barrier. A kernel that syncs its grid but is launched with [`launch`](Self::launch) traps, as it does
    /// under CUDA.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch).
    pub unsafe fn launch_cooperative(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<Fence> {
        // SAFETY: forwarded.
        let value = unsafe { self.launch_cooperative_value(kernel, cfg, args)? };
        Ok(self.queue.fence_for(value))
    }

    /// As [`launch_cooperative`](Self::launch_cooperative), returning the launch's value on the queue's timeline
    /// instead of a fence ([`fence_for`](Self::fence_for) makes one).
    ///
    /// # Safety
    /// As for [`launch`](Self::launch).
    pub unsafe fn launch_cooperative_value(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<u64> {
        let k = kernel.info();
        let info = self.gpu.info();
        let blocks = u64::from(cfg.grid[0]) * u64::from(cfg.grid[1]) * u64::from(cfg.grid[2]);
        let threads = cfg.block[0]
            .saturating_mul(cfg.block[1])
            .saturating_mul(cfg.block[2]);
        let limits = crate::launch::occupancy::DeviceLimits::for_sm(info.sm_version, info.sm_count)
            .ok_or_else(|| {
                Error::Unsupported(format!("no occupancy table for sm_{}", info.sm_version))
            })?;
        let resources = crate::launch::occupancy::KernelResources::from_kernel(
            k,
            kernel.module().cubin().sm_version(),
        );
        let occ =
            crate::launch::occupancy::occupancy(&limits, &resources, threads, cfg.shared_bytes)
                .map_err(|e| Error::InvalidLaunch {
                    kernel: k.name.clone(),
                    why: e.to_string(),
                })?;
        let resident = u64::from(occ.active_blocks) * u64::from(info.sm_count);
        if blocks > resident {
            return Err(Error::InvalidLaunch {
                kernel: k.name.clone(),
                why: format!(
                    "a cooperative launch of {blocks} blocks, but at most {resident} can be resident at once \
                     ({} per SM on {} SMs); a grid-wide sync would wait forever",
                    occ.active_blocks, info.sm_count
                ),
            });
        }
        let barrier = match &self.grid_barrier {
            Some(m) => m.va(),
            None => {
                let m = Memory::alloc(&self.gpu, MemoryDesc::video(256).with_cpu())?;
                m.fill(0, 256, 0)?;
                let va = m.va();
                self.grid_barrier = Some(m);
                va
            }
        };
        self.cooperative = Some(barrier);
        // SAFETY: forwarded.
        let value = unsafe { self.launch_value(kernel, cfg, args) };
        self.cooperative = None;
        value
    }

    /// As [`launch`](Self::launch), returning the launch's value on the queue's timeline instead of a fence
    /// ([`fence_for`](Self::fence_for) makes one when it is wanted; see
    /// [`launch_prepared_value`](Self::launch_prepared_value)).
    ///
    /// # Safety
    /// As for [`launch`](Self::launch).
    #[inline]
    pub unsafe fn launch_value(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<u64> {
        let value = self.record(kernel, cfg, args, Order::Stream)?;
        self.send_launch_now();
        Ok(value)
    }

    /// As [`launch`](Self::launch) without ringing the doorbell; [`flush`](Self::flush) sends everything
    /// recorded under one doorbell.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch).
    pub unsafe fn record_launch(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<Fence> {
        let value = self.record(kernel, cfg, args, Order::Stream)?;
        Ok(self.queue.fence_for(value))
    }

    /// Launches `kernel` as a programmatic dependent of the launch right before it on this queue, as CUDA's
    /// programmatic stream serialization does (`CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`): the GPU
    /// schedules it once every block of that launch has exited or run `griddepcontrol.launch_dependents`
    /// (`cudaTriggerProgrammaticLaunchCompletion`), and its `griddepcontrol.wait` (`cudaGridDependencySynchronize`)
    /// returns once that launch has completed and its writes are visible. The launch's start overlaps the tail of
    /// the one before instead of waiting for its completion in the channel's front end.
    ///
    /// Built as libcuda builds it (apex-trace of `probes/pdl_stream.cu`): a programmatic launch counts down a gate of
    /// its slot when it pre-exits, and the programmatic launch after it counts the same gate down from the front end,
    /// which then schedules it. Only programmatic launches carry gates (a gate costs the GPU ~0.3 µs per launch,
    /// which plain launches do not pay), so a programmatic launch right after a plain one, a copy, a wait, a join or
    /// a chain, the first of a queue, and one on a queue that sends QMDs inline
    /// ([`LaunchMemory::Host`](super::LaunchMemory::Host)) or has a single launch slot are ordered as ordinary
    /// launches: nothing can start them early. That is always correct: the attribute allows overlap, it does not
    /// require it.
    ///
    /// A kernel that touches nothing the launch before it writes may skip `griddepcontrol.wait`: it then runs
    /// alongside that launch, but its fence still completes only after that launch has (the work distributor holds
    /// a gate-scheduled grid's completion until its latch; `tests/gpu_pdl.rs` checks it on the GPU), so fences and
    /// the queue's order stay as for any launch.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch); also, the kernel must run `griddepcontrol.wait` before it touches memory
    /// the launch before it writes, and must not, before that wait, write memory the launch before it reads or
    /// writes (that launch may still be running).
    pub unsafe fn launch_programmatic(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<Fence> {
        // SAFETY: forwarded.
        let fence = unsafe { self.record_launch_programmatic(kernel, cfg, args)? };
        self.send_launch_now();
        Ok(fence)
    }

    /// As [`launch_programmatic`](Self::launch_programmatic), returning the launch's value on the queue's timeline
    /// instead of a fence (see [`launch_value`](Self::launch_value)).
    ///
    /// # Safety
    /// As for [`launch_programmatic`](Self::launch_programmatic).
    #[inline]
    pub unsafe fn launch_programmatic_value(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<u64> {
        let value = self.record(kernel, cfg, args, Order::Programmatic)?;
        self.send_launch_now();
        Ok(value)
    }

    /// As [`launch_programmatic`](Self::launch_programmatic) without ringing the doorbell.
    ///
    /// # Safety
    /// As for [`launch_programmatic`](Self::launch_programmatic).
    pub unsafe fn record_launch_programmatic(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<Fence> {
        let value = self.record(kernel, cfg, args, Order::Programmatic)?;
        Ok(self.queue.fence_for(value))
    }

    /// As [`launch_value`](Self::launch_value) (or, `programmatic`,
    /// [`launch_programmatic_value`](Self::launch_programmatic_value)) without ringing the doorbell: the GPU learns
    /// of the launch at the queue's next doorbell ([`flush`](Self::flush), or any later call that rings).
    ///
    /// # Safety
    /// As for [`launch`](Self::launch) (and, `programmatic`, [`launch_programmatic`](Self::launch_programmatic)).
    #[inline]
    pub unsafe fn record_launch_value(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
        programmatic: bool,
    ) -> Result<u64> {
        self.record(kernel, cfg, args, Order::stream_or(programmatic))
    }

    /// Whether this queue has launched programmatically ([`launch_programmatic`](Self::launch_programmatic)) and
    /// built the gates its programmatic launches use.
    pub fn is_programmatic(&self) -> bool {
        self.gates.is_some()
    }

    /// Records a launch that may run concurrently with the launches around it (no wait for the previous one,
    /// no completion signal of its own). [`join`](Self::join) returns the fence that covers it; an ordered
    /// launch or copy after it joins first.
    ///
    /// # Safety
    /// As for [`launch`](Self::launch); also, nothing orders this kernel against the other unordered ones.
    pub unsafe fn record_launch_unordered(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<()> {
        self.record(kernel, cfg, args, Order::Unordered).map(drop)
    }

    pub(super) fn record(
        &mut self,
        kernel: &Kernel,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
        order: Order,
    ) -> Result<u64> {
        if let Some(value) = self.hold(kernel, cfg, args, order)? {
            return Ok(value);
        }
        self.end_open_chain()?;
        let ordered = order != Order::Unordered;
        let (slot, mut q) = self.prepare(kernel, cfg, args, Release::next_if(ordered))?;
        let gated = self.gate(order, slot, &mut q)?;
        self.stage_qmd(slot, &q)?;

        if ordered && self.unordered_pending {
            // Join the unordered launches first (recorded; the doorbell below sends both).
            self.queue.record(0, Signal::Host, |_, _| {})?;
            self.unordered_pending = false;
        }
        let value = self.send_ordered(slot, kernel, ordered, gated)?;
        if !ordered {
            self.unordered_pending = true;
        }
        Ok(value)
    }
}
