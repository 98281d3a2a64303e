//! A launch description for [`Queue::submit`](super::Queue::submit): what runs, with which arguments, in which
//! order; and the prepared launch ([`PreparedLaunch`]) it may name.

use super::backend::Backed;
use super::{Error, Kernel, Result};
use crate::driver::{self, LaunchMode as How};
use crate::launch::{self, Arg, DevicePtr, LaunchConfig};

/// One launch for [`Queue::submit`](crate::Queue::submit): what runs (a kernel over a launch shape, a
/// [`PreparedLaunch`], or one of APEX's own memsets and copies), with which arguments, and how it is ordered against
/// the work before it on the queue.
///
/// Built by [`Launch::new`], [`Launch::prepared`], [`Launch::fill`] or [`Launch::copy`]; without a modifier it is a plain launch in stream order (it starts
/// once the work before it on the queue has completed), as [`Queue::launch`](crate::Queue::launch) makes. The modifiers
/// choose another order: [`programmatic`](Self::programmatic), [`cooperative`](Self::cooperative) and
/// [`chained`](Self::chained) (`.chained().programmatic()`: a programmatic link of a chain). Building one is free (it
/// borrows what it names and checks nothing); [`Queue::submit`](crate::Queue::submit) checks the launch, and refuses
/// combinations that mean nothing (cooperative with programmatic or chained, a cooperative prepared launch) with
/// [`Error::InvalidArgument`].
///
/// ```no_run
/// use apex::{Arg, Gpu, Launch, LaunchConfig};
/// # fn main() -> apex::Result<()> {
/// let gpu = Gpu::open(0)?;
/// let step = gpu.load_module_file("kernels/apex_pdl.sm_90.cubin")?.kernel("pdl_step")?;
/// let n = 1u32 << 20;
/// let buf = gpu.alloc(u64::from(n) * 4)?;
/// let mut q = gpu.queue()?;
/// let cfg = LaunchConfig::linear(n / 256, 256);
/// for v in 0..100u32 {
///     let args = [buf.arg(), Arg::U32(n), Arg::U32(v)];
///     // SAFETY: pdl_step runs griddepcontrol.wait before it reads or writes `buf`, which only this queue uses.
///     unsafe { q.submit(&Launch::new(&step, &cfg, &args).programmatic())? };
/// }
/// q.synchronize()?;
/// # Ok(())
/// # }
/// ```
#[must_use = "a Launch only describes a launch: Queue::submit submits it"]
#[derive(Clone, Copy, Debug)]
pub struct Launch<'a> {
    pub(super) what: What<'a>,
    pub(super) args: &'a [Arg<'a>],
    programmatic: bool,
    cooperative: bool,
    chained: bool,
    deferred: bool,
}

/// What a [`Launch`] runs.
#[derive(Clone, Copy, Debug)]
pub(super) enum What<'a> {
    Kernel(&'a Kernel, &'a LaunchConfig),
    Prepared(&'a PreparedLaunch),
    /// [`Launch::fill`].
    Fill {
        dst: u64,
        value: u32,
        width: u32,
        count: u64,
    },
    /// [`Launch::copy`].
    Copy {
        src: u64,
        dst: u64,
        bytes: u64,
    },
}

impl<'a> Launch<'a> {
    /// A plain launch of `kernel` over `cfg` with `args`, checked against the kernel's parameter table and the
    /// device limits when it is submitted.
    #[inline]
    pub const fn new(kernel: &'a Kernel, cfg: &'a LaunchConfig, args: &'a [Arg<'a>]) -> Launch<'a> {
        Launch::plain(What::Kernel(kernel, cfg), args)
    }

    /// A plain launch of `prepared` ([`Queue::prepare`](crate::Queue::prepare)) with `args`, checked against the
    /// kernel's parameter table when it is submitted, on the queue that prepared it: the lowest CPU cost per launch (on
    /// the direct path the QMD, constant-bank words and limits were checked and built by `prepare`, and a submission
    /// writes only the parameters and the completion value; it allocates nothing on either backend).
    #[inline]
    pub const fn prepared(prepared: &'a PreparedLaunch, args: &'a [Arg<'a>]) -> Launch<'a> {
        Launch::plain(What::Prepared(prepared), args)
    }

    /// Sets `count` elements of `width` bytes (1, 2 or 4) at GPU address `dst` to the low bytes of `value`, in the
    /// queue's order, as `cuMemsetD8Async`/`D16`/`D32` do ([`Queue::fill_addresses`](crate::Queue::fill_addresses)
    /// as a launch): on the direct path a prepared launch of APEX's built-in fill kernel, so it costs what a prepared
    /// launch costs and returns a [`Ticket`](crate::Ticket) (no reference count), and it may be
    /// [`deferred`](Self::deferred); on the driver backend `cuMemsetD*Async`. Submitting it is `unsafe` for what it
    /// writes: `dst` must be memory the queue's GPU reaches for `count * width` bytes, aligned to `width`, and stay so
    /// until it completes. A fill of 0 elements is refused. Only in plain stream order
    /// ([`Queue::submit`](crate::Queue::submit) refuses the modifiers but [`deferred`](Self::deferred)).
    #[inline]
    pub const fn fill(dst: DevicePtr, value: u32, width: u32, count: u64) -> Launch<'static> {
        Launch::plain(
            What::Fill {
                dst: dst.get(),
                value,
                width,
                count,
            },
            &[],
        )
    }

    /// Copies `bytes` bytes from GPU address `src` to `dst` (device memory, or host memory mapped for the GPU), in
    /// the queue's order ([`Queue::copy_addresses`](crate::Queue::copy_addresses) as a launch): on the direct path a
    /// prepared launch of APEX's built-in copy kernel on the SMs, at a prepared launch's cost, returning a
    /// [`Ticket`](crate::Ticket), and it may be [`deferred`](Self::deferred); on the driver backend
    /// `cuMemcpyAsync`. Submitting it is `unsafe` for what it reads and writes: both ranges must be memory the queue's
    /// GPU reaches for `bytes` bytes, must not overlap, and must stay valid until it completes, and nothing else may
    /// write `dst` meanwhile. A copy of 0 bytes is refused. Only in plain stream order, as [`fill`](Self::fill).
    #[inline]
    pub const fn copy(src: DevicePtr, dst: DevicePtr, bytes: u64) -> Launch<'static> {
        Launch::plain(
            What::Copy {
                src: src.get(),
                dst: dst.get(),
                bytes,
            },
            &[],
        )
    }

    /// Makes it a programmatic dependent of the launch right before it on the queue (CUDA's programmatic stream
    /// serialization, `cudaLaunchAttributeProgrammaticStreamSerialization`): it may start once every block of that
    /// launch has exited or run `griddepcontrol.launch_dependents`, and its `griddepcontrol.wait` returns once that
    /// launch has completed with its writes visible. Later work on the queue still waits for it as for any launch.
    ///
    /// On the direct path the GPU's work distributor starts it through a gate of the previous launch, as libcuda
    /// does, when that launch was programmatic too; where nothing can start it early (the queue's first
    /// programmatic launch, or one after a plain launch, a copy, a wait or a chain) it is an ordinary launch, which
    /// the attribute allows. On the driver backend, `cuLaunchKernelEx` with the attribute.
    ///
    /// With [`chained`](Self::chained), a programmatic link of a chain: the work distributor schedules it once every
    /// block of the link before it has exited or run `griddepcontrol.launch_dependents`, and its
    /// `griddepcontrol.wait` returns once that link has completed with its writes visible, as a programmatic edge of
    /// a graph ([`GraphLaunch::programmatic`](crate::GraphLaunch::programmatic)). On the direct path the link before
    /// arrives at a latch this launch waits on; the first launch of a chain (or of a part of a long one) waits for
    /// the work before it as usual. On the driver backend it is `cuLaunchKernelEx` with programmatic stream
    /// serialization, which may also overlap a chain's first launch with the work before it (as the attribute
    /// allows; correct for kernels that wait as [`Queue::submit`](crate::Queue::submit)'s safety section requires).
    ///
    /// Not with [`cooperative`](Self::cooperative).
    #[inline]
    pub const fn programmatic(self) -> Launch<'a> {
        Launch {
            programmatic: true,
            ..self
        }
    }

    /// Makes it a launch of a kernel that synchronizes its whole grid (cooperative groups `this_grid().sync()`), as
    /// `cuLaunchCooperativeKernel` does: refused unless every block can be resident at once. Cooperative launches
    /// on one queue run in order and share one grid barrier.
    ///
    /// Not with [`programmatic`](Self::programmatic) or [`chained`](Self::chained), nor for a
    /// [`prepared`](Self::prepared) launch (cooperative launches are not prepared):
    /// [`Queue::submit`](crate::Queue::submit) refuses them.
    #[inline]
    pub const fn cooperative(self) -> Launch<'a> {
        Launch {
            cooperative: true,
            ..self
        }
    }

    /// Makes it the next link of a chain of dependent launches, ended by [`Queue::end_chain`](crate::Queue::end_chain).
    /// On the direct path each link is scheduled by the GPU when the one before completes, with no round trip through
    /// the channel's front end (as a CUDA graph runs), and long chains are sent part by part while they are recorded: a
    /// link is recorded, and sent with its part by [`Queue::end_chain`](crate::Queue::end_chain),
    /// [`Queue::flush`](crate::Queue::flush), any other work on the queue, or when its part is full. On the driver
    /// backend links are launched on the stream at once, which orders them the same way. Any other launch or copy on
    /// the queue ends the chain first.
    ///
    /// The [`Ticket`](crate::Ticket) of a link completes when its chain's part does (on the driver backend, with the
    /// stream); wait on its fence only once the part is sent.
    ///
    /// Not with [`cooperative`](Self::cooperative).
    #[inline]
    pub const fn chained(self) -> Launch<'a> {
        Launch {
            chained: true,
            ..self
        }
    }

    /// Records it without telling the GPU: on the direct path the launch is written to the queue but its doorbell is
    /// not rung, so the GPU starts it only at the queue's next doorbell: [`Queue::flush`](crate::Queue::flush), or any
    /// later submission that is not deferred (a launch, a copy, a wait, [`Queue::synchronize`](crate::Queue::synchronize)).
    /// The queue still rings on its own where it must wait for room (a free launch slot, pushbuffer space, ring
    /// entries) or grows its local memory, and a chained queue ([`QueueOptions::chained`](crate::QueueOptions::chained))
    /// that finds the GPU idle sends the links it holds, so none of the queue's own waits waits on a launch it has
    /// not sent; "one doorbell for all of them" holds only while none of that happens.
    /// Several deferred launches then go under one doorbell, and the caller chooses where the doorbell falls among
    /// its own stores. The doorbell's store fences and uncached store leave the CPU only after the call that makes
    /// them; until they have, a locked instruction waits for them, and so does a load the CPU cannot forward from a
    /// store made after them (a 16-byte copy of a value the call returned as two 8-byte words). A caller that keeps
    /// the [`Ticket`](crate::Ticket) in its own structures stores it first and flushes after: apex-preload's launch
    /// call returns in 0.24 instead of 0.68 µs on an H200 host that way. It changes nothing on the driver backend
    /// (the launch is made at once) and for [`cooperative`](Self::cooperative) and [`chained`](Self::chained) launches,
    /// which are sent as they always are.
    ///
    /// Its [`Ticket`](crate::Ticket) and fence are the launch's; a fence of a deferred launch completes only after a
    /// doorbell has sent it, so flush before waiting on it.
    ///
    /// ```no_run
    /// use apex::{Gpu, Launch, LaunchConfig};
    /// # fn main() -> apex::Result<()> {
    /// let gpu = Gpu::open(0)?;
    /// let empty = gpu.load_module_file("kernels/apex_test_kernels.sm_90.cubin")?.kernel("empty")?;
    /// let mut q = gpu.queue()?;
    /// let one = q.prepare(&empty, &LaunchConfig::linear(1, 1))?;
    /// for _ in 0..8 {
    ///     // SAFETY: the empty kernel touches no memory.
    ///     unsafe { q.submit(&Launch::prepared(&one, &[]).deferred())? };
    /// }
    /// q.flush()?; // the eight launches go under one doorbell
    /// q.synchronize()?;
    /// # Ok(())
    /// # }
    /// ```
    #[inline]
    pub const fn deferred(self) -> Launch<'a> {
        Launch {
            deferred: true,
            ..self
        }
    }

    /// A plain launch of `what` with `args`: in stream order, no modifier.
    #[inline]
    const fn plain(what: What<'a>, args: &'a [Arg<'a>]) -> Launch<'a> {
        Launch {
            what,
            args,
            programmatic: false,
            cooperative: false,
            chained: false,
            deferred: false,
        }
    }

    /// Whether the doorbell is left to a later call ([`deferred`](Self::deferred)).
    #[inline]
    pub(super) const fn is_deferred(&self) -> bool {
        self.deferred
    }

    /// How it is ordered, or why it cannot be: the combinations [`Queue::submit`](crate::Queue::submit) refuses.
    #[inline]
    pub(super) fn mode(&self) -> Result<How> {
        let modified = self.cooperative || self.chained || self.programmatic;
        if modified && matches!(self.what, What::Fill { .. } | What::Copy { .. }) {
            return Err(Error::InvalidArgument(
                "a fill or copy runs in plain stream order: submit it without .programmatic(), .cooperative() and \
                 .chained() (.deferred() is allowed)"
                    .into(),
            ));
        }
        Ok(match (self.cooperative, self.chained, self.programmatic) {
            (false, false, false) => How::Plain,
            (false, false, true) => How::Programmatic,
            (false, true, false) => How::Chained,
            (false, true, true) => How::ChainedProgrammatic,
            (true, false, false) if matches!(self.what, What::Kernel(..)) => How::Cooperative,
            _ => return Err(self.refusal()),
        })
    }

    /// Why [`mode`](Self::mode) refuses this launch, in a sentence that says what to do.
    #[cold]
    #[inline(never)]
    fn refusal(&self) -> Error {
        let why = if self.programmatic {
            "a cooperative launch cannot be programmatic: every block of its grid must be resident at once, so it \
             cannot overlap the launch before it; drop .programmatic() or .cooperative()"
        } else if self.chained {
            "a cooperative launch cannot be a link of a chain: submit it without .chained() (it ends the open chain), \
             or drop .cooperative()"
        } else {
            return cooperative_prepared();
        };
        Error::InvalidArgument(why.into())
    }
}

/// The refusal of a cooperative prepared launch.
#[cold]
#[inline(never)]
pub(super) fn cooperative_prepared() -> Error {
    Error::InvalidArgument(
        "a prepared launch cannot be cooperative (cooperative launches are not prepared): submit \
         Launch::new(kernel, cfg, args).cooperative() instead"
            .into(),
    )
}

/// A launch checked once by [`Queue::prepare`](crate::Queue::prepare), submitted again and again with new arguments
/// by [`Queue::submit`](crate::Queue::submit) (as [`Launch::prepared`]) on the queue that prepared it.
#[derive(Clone, Debug)]
pub struct PreparedLaunch(pub(super) Backed<launch::PreparedLaunch, driver::Prepared>);

impl PreparedLaunch {
    /// The direct path's prepared launch, when a direct-path queue prepared it.
    pub fn direct(&self) -> Option<&launch::PreparedLaunch> {
        self.0.direct()
    }

    /// The grid, block, shared memory and cluster shape it launches with.
    pub fn config(&self) -> &LaunchConfig {
        match &self.0 {
            Backed::Direct(p) => p.config(),
            Backed::Driver(p) => p.config(),
        }
    }
}
