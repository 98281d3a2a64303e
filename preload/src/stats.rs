//! What the preload did, for `APEX_PRELOAD_STATS`: launches through APEX, fallbacks per reason, launches forwarded
//! while APEX was being set up and what the set-up cost, ordering hops.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::Refusal;
use crate::order::HopCounts;

/// Fallbacks of one reason.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReasonCount {
    /// Launches that fell back for it.
    pub launches: u64,
    /// The first refusal's message.
    pub example: String,
}

/// How long the set-up pieces of one kind took.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SetupTimes {
    /// Pieces made.
    pub count: u64,
    /// Their time together, milliseconds.
    pub total_ms: f64,
    /// The longest one, milliseconds.
    pub max_ms: f64,
}

impl SetupTimes {
    /// Counts a piece that took `d`.
    pub fn add(&mut self, d: Duration) {
        let ms = d.as_secs_f64() * 1e3;
        self.count += 1;
        self.total_ms += ms;
        self.max_ms = self.max_ms.max(ms);
    }
}

/// The preload's set-up (`APEX_PRELOAD_SETUP`): where it ran, and what each kind of piece cost.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SetupSummary {
    /// `background` (a thread of the preload's prepared each piece while the launches that needed it went to
    /// libcuda: [`Summary::warmup`]) or `inline` (each piece made on the program's thread, at the launch that needed
    /// it).
    pub mode: String,
    /// Attaching APEX to a CUDA context (with the GPU's first queue).
    pub attach: SetupTimes,
    /// Building a queue (for a stream taken over, or the spare kept ready for the next one).
    pub queue: SetupTimes,
    /// Loading a module or library into APEX.
    pub module: SetupTimes,
    /// When a stream is taken over (`APEX_PRELOAD_TAKEOVER`): `earned` (once its launches on libcuda have cost what
    /// its takeover costs), `first`, or `after N launches`. Launches made before are counted in
    /// [`Summary::warmup`].
    #[serde(default)]
    pub takeover: String,
    /// What earlier runs of the program advised (`APEX_PRELOAD_HISTORY`): `off`, `no earlier run recorded`, or
    /// whether their launches paid for a takeover from the first launch on (then this run was taken over at its
    /// first launch, with `earned`).
    #[serde(default)]
    pub history: String,
    /// Streams whose launches went to libcuda for the policy above and that were never taken over.
    #[serde(default)]
    pub streams_not_earned: u64,
    /// What loading the modules those streams' kernels need would take, as the policy estimated it (milliseconds):
    /// part of what their takeover has to pay for.
    #[serde(default)]
    pub modules_owed_ms: f64,
    /// What libcuda's `cuLaunchKernel` cost in this process, timed on launches forwarded before a takeover
    /// (nanoseconds; 0 until 8 were timed, one in 16 forwarded on the credit): the saving per launch that priced the
    /// takeovers is this less the hook's own 0.4 µs, kept between 0.5 and 12 µs (3 µs while it is 0).
    #[serde(default)]
    pub libcuda_launch_ns: u64,
    /// Freeing APEX's objects when the takeover ended (queues, modules, the attachment: RM's channel teardown).
    #[serde(default)]
    pub teardown: SetupTimes,
    /// Pieces that failed: what they were for stays on libcuda, with the refusal that says why.
    pub failed: u64,
    /// Finished pieces dropped because what they were for was gone by then (a module unloaded, the takeover
    /// ended).
    pub dropped: u64,
}

/// The summary written at exit.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Kernel launches the program made (`cuLaunchKernel*`, `cuLaunchCooperativeKernel`): `apex + fallback +
    /// warmup`.
    pub launches: u64,
    /// Launches sent through an APEX queue.
    pub apex: u64,
    /// Launches left to libcuda for a reason ([`Summary::reasons`]).
    pub fallback: u64,
    /// Launches forwarded to libcuda while what they needed (the context's attachment, a queue for their stream,
    /// their module) was being set up in the background, or before their stream's launches had earned its takeover
    /// ([`SetupSummary::takeover`]): not refusals, the set-up's warm-up.
    #[serde(default)]
    pub warmup: u64,
    /// The set-up: its mode and what each piece cost.
    #[serde(default)]
    pub setup: SetupSummary,
    /// Fallbacks by [`Refusal::label`].
    pub reasons: BTreeMap<String, ReasonCount>,
    /// CUDA streams made to wait for an APEX queue.
    pub hops_to_cuda: u64,
    /// APEX queues made to wait for a CUDA stream.
    pub hops_to_apex: u64,
    /// Hops replaced by a CPU wait because the GPU-side one failed.
    pub cpu_syncs: u64,
    /// Queues made to wait for another queue on the GPU, with no CUDA call.
    #[serde(default)]
    pub hops_between_queues: u64,
    /// APEX queues built (one per stream taken over).
    pub queues: u64,
    /// Idle queues handed from a stream that stopped launching to a new stream, when every queue served one
    /// (`APEX_PRELOAD_QUEUES`).
    #[serde(default)]
    pub queues_reassigned: u64,
    /// Modules and libraries the program loaded while the preload watched.
    pub modules_seen: u64,
    /// Of those, loaded by APEX for a launch.
    pub modules_loaded: u64,
    /// How the attach went: `not attempted`, `direct`, or the error (the last context's); in the background mode
    /// also `being set up in the background` (still running at the end) or `direct (ready only after the last
    /// launch)`.
    pub attach: String,
    /// How the attach went in each context, in the order they were met.
    #[serde(default)]
    pub contexts: Vec<String>,
    /// Hops to CUDA not made because the queue's work was already complete.
    #[serde(default)]
    pub hops_avoided: u64,
    /// Synchronizations (`cuStreamSynchronize`, `cuStreamQuery`, `cuCtxSynchronize`, `cuEventSynchronize`,
    /// `cuEventQuery`) answered from APEX's fences without calling libcuda.
    #[serde(default)]
    pub syncs_on_cpu: u64,
    /// Synchronizations libcuda had to answer (CUDA had work of its own), with no hop before them.
    #[serde(default)]
    pub syncs_forwarded: u64,
    /// Waits for APEX's work that slept in libcuda (on an event recorded after the queues' work) rather than spin,
    /// because the program asked CUDA to sleep while it waits (`cudaDeviceScheduleBlockingSync`,
    /// `cudaEventBlockingSync`) and the work ran longer than a short spin.
    #[serde(default)]
    pub syncs_asleep: u64,
    /// Events recorded by the preload after an APEX queue's work instead of by libcuda.
    #[serde(default)]
    pub events_on_apex: u64,
    /// Of those, recorded in libcuda later because libcuda had to read them.
    #[serde(default)]
    pub events_materialized: u64,
    /// Those, by what needed libcuda to hold the event: `cuStreamWaitEvent` (a wait the preload could not make
    /// itself), `cuEventElapsedTime`, `cuIpcGetEventHandle`, `stream destroyed`, `queue handed to another stream`,
    /// `graph launch`, `capture`, `end of the takeover` (at exit, or before a context is destroyed).
    #[serde(default)]
    pub events_materialized_for: BTreeMap<String, u64>,
    /// `cuStreamWaitEvent` calls for an event the preload kept, answered without libcuda: the stream's APEX queue
    /// waits for the event's fence on the GPU, or nothing is left to wait for (the fence is complete, or the event
    /// is of the same queue).
    #[serde(default)]
    pub waits_on_apex: u64,
    /// Launch shapes (function, stream, grid, block, shared memory) prepared: each one once, unless more than 16
    /// shapes of one function alternate.
    #[serde(default)]
    pub prepared_shapes: u64,
    /// Copies between the host and the device the program asked for on a taken-over stream, run by its APEX queue.
    #[serde(default)]
    pub copies_on_apex: u64,
    /// Memsets of device memory on a taken-over stream, run by its APEX queue.
    #[serde(default)]
    pub sets_on_apex: u64,
    /// Work the program gave libcuda (copies, sets, waits, host functions, graph launches: every call but the
    /// launches, which `reasons` counts) once APEX was attached, by driver function: what still needs hops between
    /// libcuda and APEX. (Before the first attach such calls go straight to libcuda, uncounted.)
    #[serde(default)]
    pub cuda_work: BTreeMap<String, u64>,
    /// Failed device asserts of APEX's kernels, reported through libcuda.
    #[serde(default)]
    pub asserts: u64,
    /// `cuMemAlloc` calls answered from the allocation cache ([`crate::alloc_cache`]).
    #[serde(default)]
    pub alloc_cache_hits: u64,
    /// `cuMemAlloc` calls that went to libcuda.
    #[serde(default)]
    pub alloc_cache_misses: u64,
    /// The most bytes the allocation cache held at once (both paths).
    #[serde(default)]
    pub alloc_cache_peak_bytes: u64,
    /// Bytes it held at exit (both paths; freed by libcuda with the context).
    #[serde(default)]
    pub alloc_cache_held_bytes: u64,
    /// `cuMemAllocAsync` calls answered from the allocation cache's stream-ordered path.
    #[serde(default)]
    pub alloc_async_hits: u64,
    /// `cuMemAllocAsync` calls it served that went to libcuda (not counted: calls while another pool is current or a
    /// graph is captured, which always go to libcuda).
    #[serde(default)]
    pub alloc_async_misses: u64,
    /// Of those, the ones for which blocks of the size were held but none was safe for the allocation's stream (freed
    /// on another stream whose work up to the free was not known complete).
    #[serde(default)]
    pub alloc_async_unready: u64,
    /// `cuMemFreeAsync` calls whose block the cache kept.
    #[serde(default)]
    pub alloc_async_kept: u64,
    /// With `APEX_PRELOAD_PROFILE=1`: mean nanoseconds per launch through APEX of each phase of the hook.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub profile: BTreeMap<String, f64>,
}

impl Summary {
    /// Counts a launch through APEX.
    pub fn taken(&mut self) {
        self.launches += 1;
        self.apex += 1;
    }

    /// Counts a launch forwarded to libcuda while what it needs is set up in the background.
    pub fn warmed(&mut self) {
        self.launches += 1;
        self.warmup += 1;
    }

    /// Counts a launch left to libcuda for `why`.
    pub fn refused(&mut self, why: &Refusal) {
        self.launches += 1;
        self.fallback += 1;
        // Counted without allocating once the reason has been seen (every launch of a refused kernel comes here).
        if let Some(e) = self.reasons.get_mut(why.label()) {
            e.launches += 1;
            return;
        }
        let e = self.reasons.entry(why.label().to_string()).or_default();
        e.example = why.to_string();
        e.launches += 1;
    }

    /// Adds one context's hop counts.
    pub fn add_hops(&mut self, h: HopCounts) {
        self.hops_to_cuda += h.to_cuda;
        self.hops_to_apex += h.to_apex;
        self.cpu_syncs += h.cpu_syncs;
        self.hops_between_queues += h.between_queues;
        self.hops_avoided += h.avoided;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up_and_round_trip_as_json() {
        let mut s = Summary::default();
        s.taken();
        s.taken();
        s.refused(&Refusal::DeviceRuntime("vprintf".into()));
        s.refused(&Refusal::DeviceRuntime("__assertfail".into()));
        s.refused(&Refusal::Capturing);
        s.warmed();
        s.setup.queue.add(Duration::from_millis(5));
        s.setup.queue.add(Duration::from_millis(3));
        let h = HopCounts {
            to_cuda: 3,
            to_apex: 4,
            cpu_syncs: 0,
            between_queues: 0,
            avoided: 2,
        };
        s.add_hops(h);
        s.add_hops(h);
        assert_eq!((s.hops_to_cuda, s.hops_avoided), (6, 4), "contexts add up");
        assert_eq!((s.launches, s.apex, s.fallback, s.warmup), (6, 2, 3, 1));
        assert_eq!(s.setup.queue.count, 2);
        assert!(
            (s.setup.queue.total_ms - 8.0).abs() < 1e-9
                && (s.setup.queue.max_ms - 5.0).abs() < 1e-9
        );
        let d = &s.reasons["device_runtime"];
        assert_eq!(d.launches, 2);
        assert!(d.example.contains("vprintf"), "the first message is kept");
        let json = serde_json::to_string(&s).unwrap();
        let back: Summary = serde_json::from_str(&json).unwrap();
        assert_eq!(back, s);
    }
}
