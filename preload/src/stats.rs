//! What the preload did, for `APEX_PRELOAD_STATS`: launches through APEX, fallbacks per reason, ordering hops.

use std::collections::BTreeMap;

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

/// The summary written at exit.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    /// Kernel launches the program made (`cuLaunchKernel*`, `cuLaunchCooperativeKernel`).
    pub launches: u64,
    /// Launches sent through an APEX queue.
    pub apex: u64,
    /// Launches left to libcuda.
    pub fallback: u64,
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
    /// Modules and libraries the program loaded while the preload watched.
    pub modules_seen: u64,
    /// Of those, loaded by APEX for a launch.
    pub modules_loaded: u64,
    /// How the attach went: `not attempted`, `direct`, or the error.
    pub attach: String,
}

impl Summary {
    /// Counts a launch through APEX.
    pub fn taken(&mut self) {
        self.launches += 1;
        self.apex += 1;
    }

    /// Counts a launch left to libcuda for `why`.
    pub fn refused(&mut self, why: &Refusal) {
        self.launches += 1;
        self.fallback += 1;
        let e = self.reasons.entry(why.label().to_string()).or_default();
        if e.launches == 0 {
            e.example = why.to_string();
        }
        e.launches += 1;
    }

    /// Takes the hop counts.
    pub fn hops(&mut self, h: HopCounts) {
        self.hops_to_cuda = h.to_cuda;
        self.hops_to_apex = h.to_apex;
        self.cpu_syncs = h.cpu_syncs;
        self.hops_between_queues = h.between_queues;
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
        s.hops(HopCounts {
            to_cuda: 3,
            to_apex: 4,
            cpu_syncs: 0,
            between_queues: 0,
        });
        assert_eq!((s.launches, s.apex, s.fallback), (5, 2, 3));
        let d = &s.reasons["device_runtime"];
        assert_eq!(d.launches, 2);
        assert!(d.example.contains("vprintf"), "the first message is kept");
        let json = serde_json::to_string(&s).unwrap();
        let back: Summary = serde_json::from_str(&json).unwrap();
        assert_eq!(back, s);
    }
}
