//! A queue: our channel, its pushbuffer space and a timeline. Every submission releases the next timeline
//! value when it is done, so completion, pushbuffer reuse and fences all follow one counter.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::gpfifo::{Channel, ChannelConfig, FaultWatch, PushSpace, Timeline, wait_until};
use crate::rm::{GpuCore, Placement};

use super::armed::{Armed, ArmedSlots};
use super::encode::{Push, Release, Subchannel};
use super::error::{Error, Result};

/// How a [`Queue`] is built: start from [`QueueConfig::default`] and change it with the `with_*` methods
/// (`#[non_exhaustive]`, so new options are not breaking changes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueueConfig {
    /// The channel under the queue.
    pub channel: ChannelConfig,
    /// Pushbuffer bytes, used as a ring.
    pub push_bytes: u64,
    /// Where the pushbuffer lives (write-combined system memory by default, as libcuda places it).
    pub push_placement: Placement,
    /// How long waits inside the queue (ring or pushbuffer full) may take before failing.
    pub timeout: Duration,
    /// How submissions reach the front end.
    pub submission: Submission,
}

/// How a queue's submissions reach the channel's front end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Submission {
    /// Each submission is a GPFIFO entry, published with GP_PUT and the doorbell (as libcuda does).
    #[default]
    Doorbell,
    /// Entries are published ahead of the work they carry, and the front end waits at a gate word in host
    /// memory: a submission that fits a slot is cached stores and no doorbell (see [`Armed`]). Larger ones, and
    /// prebuilt methods, go through the ring with a doorbell, after the front end passes the slots left empty.
    Armed(Armed),
}

impl Default for QueueConfig {
    fn default() -> QueueConfig {
        QueueConfig {
            channel: ChannelConfig::default(),
            push_bytes: 4 << 20,
            push_placement: Placement::SystemWriteCombined,
            timeout: Duration::from_secs(10),
            submission: Submission::Doorbell,
        }
    }
}

impl QueueConfig {
    /// Sets [`channel`](Self::channel).
    pub fn with_channel(mut self, channel: ChannelConfig) -> QueueConfig {
        self.channel = channel;
        self
    }

    /// Sets [`push_bytes`](Self::push_bytes).
    pub fn with_push_bytes(mut self, bytes: u64) -> QueueConfig {
        self.push_bytes = bytes;
        self
    }

    /// Sets [`push_placement`](Self::push_placement).
    pub fn with_push_placement(mut self, placement: Placement) -> QueueConfig {
        self.push_placement = placement;
        self
    }

    /// Sets [`timeout`](Self::timeout).
    pub fn with_timeout(mut self, timeout: Duration) -> QueueConfig {
        self.timeout = timeout;
        self
    }

    /// Sets [`submission`](Self::submission).
    pub fn with_submission(mut self, submission: Submission) -> QueueConfig {
        self.submission = submission;
        self
    }
}

/// Who makes the GPU release a submission's timeline value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    /// The queue appends a host semaphore release after the submission's methods (waiting for idle first).
    Host,
    /// The submission's own methods release it (for example a QMD's release semaphore).
    Recorded,
}

/// A point on a queue's timeline: done once the GPU has released `value`.
#[derive(Clone, Debug)]
pub struct Fence {
    /// The queue's timeline and fault watch, shared: a fence is made per launch, so it clones one `Arc`.
    shared: Arc<FenceShared>,
    value: u64,
}

#[derive(Debug)]
struct FenceShared {
    timeline: Timeline,
    watch: FaultWatch,
}

impl Fence {
    /// The timeline value the fence waits for.
    pub fn value(&self) -> u64 {
        self.value
    }

    /// Whether the GPU has released the value (no waiting).
    pub fn is_done(&self) -> bool {
        self.shared.timeline.is_reached(self.value)
    }

    /// The timeline this fence is a value of: another channel waits for the fence by acquiring
    /// `timeline().va()` at [`value`](Self::value).
    pub fn timeline(&self) -> &Timeline {
        &self.shared.timeline
    }

    /// Waits until done, failing with a timeout or the channel's fault.
    pub fn wait(&self, timeout: Duration) -> Result<()> {
        let (t, v) = (&self.shared.timeline, self.value);
        Ok(wait_until(
            "a fence on the queue's timeline",
            timeout,
            || t.is_reached(v),
            || self.shared.watch.check(),
        )?)
    }
}

/// A channel with a pushbuffer ring and a timeline.
#[derive(Debug)]
pub struct Queue {
    channel: Channel,
    space: PushSpace,
    timeline: Timeline,
    /// What every fence of this queue shares.
    fences: Arc<FenceShared>,
    last: u64,
    timeout: Duration,
    /// The armed slots, on a queue built with [`Submission::Armed`].
    armed: Option<ArmedSlots>,
}

/// Records a submission into `words` (a reservation of the ring, or an armed slot's body): its methods, then for
/// [`Signal::Host`] the release of `value` on the timeline at `timeline_va`. Returns the words used.
#[inline]
fn fill(
    words: &mut [u32],
    timeline_va: u64,
    value: u64,
    signal: Signal,
    f: impl FnOnce(&mut Push<'_>, u64),
) -> Result<usize> {
    let mut push = Push::new(words);
    f(&mut push, value);
    if signal == Signal::Host {
        push.sem_release(timeline_va, value, Release::AFTER_IDLE_64);
    }
    Ok(push.finish()?)
}

impl Queue {
    /// The longest run of prebuilt methods one [`push_prebuilt`](Self::push_prebuilt) takes (one GPFIFO entry).
    pub const MAX_PREBUILT_DWORDS: u64 = crate::gpfifo::GpEntry::MAX_DWORDS;

    /// Builds the channel and binds its engine classes; waits (up to the configured timeout) until the GPU has
    /// run that first submission, so a queue that exists is known to work.
    pub fn new(core: &Arc<GpuCore>, config: QueueConfig) -> Result<Queue> {
        if let Submission::Armed(a) = config.submission
            && config.channel.entries <= 2 * a.slots
        {
            // Arming takes two entries per slot, half the slots at a time, beside what goes through the ring.
            return Err(crate::gpfifo::Error::InvalidConfig(format!(
                "armed submission with {} slots on a ring of {} GPFIFO entries: the ring needs more than twice as \
                 many entries as slots",
                a.slots, config.channel.entries
            ))
            .into());
        }
        if matches!(config.submission, Submission::Armed(_)) && core.attachment().is_some() {
            // The channel would be one of CUDA's channel group: parked at its gate it would hold up (or, yielding,
            // switch out) the group that runs CUDA's own streams.
            return Err(crate::gpfifo::Error::InvalidConfig(
                "polled submission on a GPU attached to a CUDA context: the queue's channel shares CUDA's channel \
                 group, which a channel parked at its gate would hold up; use a doorbell queue (polled: false)"
                    .into(),
            )
            .into());
        }
        let mut channel_config = config.channel;
        // Parked at its gate, the channel yields its group (ACQUIRE_SWITCH_TSG): in the group other queues share,
        // it would yield theirs too.
        channel_config.own_group |= matches!(config.submission, Submission::Armed(_));
        let mut channel = Channel::new(core, channel_config)?;
        channel.note_write_combined(config.push_placement);
        let max_pending = 4096;
        let space = PushSpace::new(core, config.push_bytes, config.push_placement, max_pending)?;
        let armed = match config.submission {
            Submission::Doorbell => None,
            Submission::Armed(a) => Some(ArmedSlots::new(core, a)?),
        };
        let timeline = channel.timeline(0);
        let watch = channel.fault_watch();
        let mut q = Queue {
            channel,
            space,
            fences: Arc::new(FenceShared {
                timeline: timeline.clone(),
                watch,
            }),
            timeline,
            last: 0,
            timeout: config.timeout,
            armed,
        };
        let classes = q.channel.classes();
        let fence = q.submit(16, Signal::Host, |p, _| {
            if let Some(c) = classes.compute {
                p.set_object(Subchannel::COMPUTE, c);
            }
            if let Some(c) = classes.copy {
                p.set_object(Subchannel::COPY, c);
            }
        })?;
        q.wait_kicking(fence.value(), config.timeout)?;
        Ok(q)
    }

    /// The channel the queue submits to.
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// Says that work of this queue is also written through a write-combined mapping of `placement` (see
    /// [`Channel::note_write_combined`]).
    pub fn note_write_combined(&mut self, placement: Placement) {
        self.channel.note_write_combined(placement);
    }

    /// The GPU the queue runs on.
    pub fn gpu(&self) -> &Arc<GpuCore> {
        self.channel.gpu()
    }

    /// The queue's timeline: slot 0 of its channel's semaphore page.
    pub fn timeline(&self) -> &Timeline {
        &self.timeline
    }

    /// How long waits inside the queue may take before failing.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Whether the queue's submissions go out through armed slots ([`Submission::Armed`]).
    pub fn is_armed(&self) -> bool {
        self.armed.is_some()
    }

    /// The value the last submission releases.
    pub fn last_submitted(&self) -> u64 {
        self.last
    }

    /// A fence on this queue's timeline at `value`.
    pub fn fence_for(&self, value: u64) -> Fence {
        Fence {
            shared: self.fences.clone(),
            value,
        }
    }

    /// Records up to `max_words` methods with `f` (which gets the timeline value this submission must release)
    /// and rings the doorbell.
    pub fn submit(
        &mut self,
        max_words: usize,
        signal: Signal,
        f: impl FnOnce(&mut Push<'_>, u64),
    ) -> Result<Fence> {
        let fence = self.record(max_words, signal, f)?;
        self.kick();
        Ok(fence)
    }

    /// As [`submit`](Self::submit) without ringing the doorbell: many recordings can go out under one
    /// [`kick`](Self::kick).
    pub fn record(
        &mut self,
        max_words: usize,
        signal: Signal,
        f: impl FnOnce(&mut Push<'_>, u64),
    ) -> Result<Fence> {
        let value = self.record_value(max_words, signal, f)?;
        Ok(self.fence_for(value))
    }

    /// As [`record`](Self::record), returning the timeline value the submission releases instead of a fence:
    /// making a fence takes an atomic reference count, whose locked instruction waits for every store before it
    /// to leave the CPU (the doorbell's and the pushbuffer's among them). [`fence_for`](Self::fence_for) makes one
    /// later.
    pub fn record_value(
        &mut self,
        max_words: usize,
        signal: Signal,
        f: impl FnOnce(&mut Push<'_>, u64),
    ) -> Result<u64> {
        let value = self.last + 1;
        let extra = if signal == Signal::Host { 6 } else { 0 };
        if let Some(armed) = self.armed.as_mut() {
            let words = max_words + extra;
            if armed.fits(words) {
                // The slot's body is the pushbuffer; as in the ring, the submission gets the words it asked for.
                let mut body = armed.body(words);
                // On an overflow the body is left empty again (the guard's drop), so the slot never runs a
                // fragment once its gate opens.
                let used = fill(body.words(), self.timeline.va(), value, signal, f)?;
                body.keep();
                armed.commit(used, value);
                self.last = value;
                return Ok(value);
            }
            // Through the ring: the entry goes after the armed slots, which run empty once the gate opens.
            armed.give_up_empty(value, words <= armed.capacity());
            armed.open(&self.channel);
        }
        if !self
            .space
            .fits_now(max_words + extra, self.timeline.known())
            && !self
                .space
                .fits_now(max_words + extra, self.timeline.completed())
        {
            // Recorded work may be what frees the space: send it before waiting (without arming slots, which would
            // go ahead of the entry recorded here).
            self.publish();
        }
        let (va, words) = self
            .space
            .reserve(max_words + extra, &self.timeline, self.timeout)?;
        let timeline_va = self.timeline.va();
        let used = fill(words, timeline_va, value, signal, f)?;
        self.channel.push(va, used as u64, self.timeout)?;
        self.space.commit(va, used, value);
        self.last = value;
        Ok(value)
    }

    /// Queues `dwords` methods prebuilt at `va` (outside the queue's pushbuffer ring, written once and run many
    /// times) without ringing the doorbell. They take no timeline value of their own: the next submission's
    /// release follows them, so its fence covers them. The methods must leave the channel as they found it
    /// (no open method, subchannels bound as before). At most [`MAX_PREBUILT_DWORDS`](Self::MAX_PREBUILT_DWORDS)
    /// words, 4-byte aligned, below 2^40.
    pub fn push_prebuilt(&mut self, va: u64, dwords: u64) -> Result<()> {
        if let Some(armed) = self.armed.as_mut() {
            armed.give_up_empty(self.last + 1, false);
            armed.open(&self.channel);
        }
        Ok(self.channel.push(va, dwords, self.timeout)?)
    }

    /// As [`kick`](Self::kick), but on a queue that is not armed rings nothing when nothing was pushed to the ring
    /// since the last doorbell: a launch call that only held its launch back (a chain link not sent yet) has nothing
    /// new for the GPU, and a doorbell's two store fences would cost it more than the launch (each waits for every
    /// write-combined store before it to leave the CPU).
    #[inline]
    pub fn kick_recorded(&mut self) {
        if self.armed.is_none() && !self.channel.has_unpublished() {
            return;
        }
        self.kick();
    }

    /// Sends everything recorded: rings the doorbell, or on an armed queue opens the gate (and rings the
    /// doorbell only for entries pushed to the ring, or to arm more slots).
    #[inline]
    pub fn kick(&mut self) {
        let Some(armed) = self.armed.as_mut() else {
            self.channel.kick();
            return;
        };
        armed.open(&self.channel);
        if armed.wants_arming(self.timeline.known())
            && let Err(e) = armed.arm(&mut self.channel, &self.timeline, self.timeout)
        {
            tracing::warn!(error = %e, "arming GPFIFO slots failed; submissions go through the ring");
        }
        if self.channel.has_unpublished() {
            self.channel.kick();
        }
    }

    /// Prefetches for writing the lines the next small submission most likely writes: the next armed slot's body,
    /// or the pushbuffer's head and the ring's next entry. A hint for CPU-cached placements; call after a kick.
    #[inline]
    pub fn prefetch_next(&self) {
        match &self.armed {
            Some(armed) if armed.empty() > 0 => armed.prefetch_next(),
            _ => {
                self.space.prefetch_head();
                self.channel.prefetch_next_entry();
            }
        }
    }

    /// Opens the gate over everything recorded and rings the doorbell, whether or not anything is new (a doorbell
    /// the GPU missed is rung again this way); arms nothing.
    fn publish(&mut self) {
        if let Some(armed) = self.armed.as_mut() {
            armed.open(&self.channel);
        }
        self.channel.kick();
    }

    /// Waits until every submission so far is complete.
    pub fn wait_idle(&self, timeout: Duration) -> Result<()> {
        self.fence_for(self.last).wait(timeout)
    }

    /// Waits until the timeline reaches `value` (up to `timeout`), ringing the doorbell again whenever the wait
    /// grows long: a doorbell the GPU missed (seen on freshly started machines, on a queue's first submissions)
    /// would otherwise leave published work unfetched until the timeout. A second doorbell for the same GP_PUT is
    /// harmless, and only the queue's owner (`&mut self`) may ring it, after its own ordered stores.
    pub fn wait_kicking(&mut self, value: u64, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        let mut slice = Duration::from_millis(1);
        let mut rings = 0u32;
        loop {
            let left = timeout.saturating_sub(start.elapsed());
            match self.fence_for(value).wait(slice.min(left)) {
                Ok(()) => {
                    if rings > 0 {
                        tracing::warn!(
                            rings,
                            waited = ?start.elapsed(),
                            "work completed only after the doorbell was rung again"
                        );
                    }
                    return Ok(());
                }
                Err(Error::Channel(crate::gpfifo::Error::Timeout { what, .. })) => {
                    let (get, put) = (self.channel.read_gp_get(), self.channel.published_put());
                    if left <= slice {
                        tracing::warn!(
                            value,
                            completed = self.timeline.completed(),
                            gp_get = get,
                            gp_put = put,
                            rings,
                            "wait on the queue's timeline timed out"
                        );
                        return Err(crate::gpfifo::Error::Timeout {
                            what,
                            waited: start.elapsed(),
                        }
                        .into());
                    }
                    tracing::debug!(
                        value,
                        gp_get = get,
                        gp_put = put,
                        "long wait: ringing the doorbell again"
                    );
                    self.publish();
                    rings += 1;
                    slice = (slice * 4).min(Duration::from_millis(250));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// As [`wait_idle`](Self::wait_idle), ringing the doorbell again during a long wait
    /// ([`wait_kicking`](Self::wait_kicking)).
    pub fn wait_idle_kicking(&mut self, timeout: Duration) -> Result<()> {
        self.wait_kicking(self.last, timeout)
    }
}
