//! The prebuilt methods a replay pushes: for [`GraphSchedule::Gpu`], the roots' sends, the wide fan-outs' and the
//! completion word's acquires and their resets, and the arming sends; for [`GraphSchedule::FrontEnd`], each head
//! after its waits, the sinks' acquires and the resets. And their cut into GPFIFO entries.
//!
//! [`GraphSchedule::Gpu`]: super::GraphSchedule::Gpu
//! [`GraphSchedule::FrontEnd`]: super::GraphSchedule::FrontEnd

use crate::launch::Result;
use crate::launch::graph::NodeId;
use crate::pushbuf::{Acquire, Push, Release};

/// Words of one host semaphore method group (header + address, payload, execute).
const SEMAPHORE_WORDS: usize = 6;
/// Words of SEND_PCAS_A + SEND_SIGNALING_PCAS2_B.
const PCAS_WORDS: usize = 4;

/// Prebuilt methods: (replay words, their cut points, arming words, their cut points, nodes sent, acquires).
type Methods = (Vec<u32>, Vec<usize>, Vec<u32>, Vec<usize>, usize, usize);
/// What [`gpu_methods`] needs of an instantiation.
pub(super) struct GpuPlan<'a> {
    pub(super) deps: &'a crate::launch::graph::Dependencies,
    pub(super) indeg: &'a [usize],
    /// Nodes whose successors the front end sends, in topological order; the k-th adds 1 to the word `4(k + 1)`
    /// bytes past `done`.
    pub(super) wide: &'a [usize],
    /// Nodes the front end schedules (a wide fan-out's successors with no other predecessor).
    pub(super) host_sent: &'a [bool],
    pub(super) qmd_va: &'a dyn Fn(usize) -> u64,
    pub(super) null_va: &'a dyn Fn(usize) -> u64,
    pub(super) nulls: usize,
    /// The completion word; the wide fan-outs' words follow it.
    pub(super) done: u64,
}

/// The methods of [`GraphSchedule::Gpu`]: send every root; for each wide fan-out in topological order, wait for its
/// word, then send its successors that have no other predecessor and count the others down (PCAS
/// DECREMENT_DEPENDENCE); acquire the completion word at the number of sinks (each adds 1 when it has completed);
/// finally zero the words for the next replay (they start zeroed at instantiation). Arming, pushed before
/// the first replay and after an update rewrote a QMD: a copying PCAS for every node the work distributor
/// schedules, sinks first, which records its counter and requirement without running it.
///
/// [`GraphSchedule::Gpu`]: super::GraphSchedule::Gpu
pub(super) fn gpu_methods(plan: &GpuPlan<'_>) -> Result<Methods> {
    let GpuPlan {
        deps,
        indeg,
        wide,
        host_sent,
        qmd_va,
        null_va,
        nulls,
        done,
    } = *plan;
    let n = indeg.len();
    if n == 0 {
        return Ok((Vec::new(), Vec::new(), Vec::new(), Vec::new(), 0, 0));
    }
    let id = NodeId::at;
    let roots: Vec<usize> = deps
        .order()
        .iter()
        .map(|v| v.index())
        .filter(|&v| indeg[v] == 0)
        .collect();
    let sinks = (0..n).filter(|&v| deps.succs(id(v)).is_empty()).count();
    let fan_edges: usize = wide.iter().map(|&u| deps.succs(id(u)).len()).sum();
    let reset = wide.len() + 1;
    let mut words = vec![
        0u32;
        PCAS_WORDS * (roots.len() + fan_edges)
            + SEMAPHORE_WORDS * (wide.len() + 1 + reset)
    ];
    let mut push = Push::new(&mut words);
    let mut cuts = Vec::with_capacity(roots.len() + fan_edges + wide.len() + 1 + reset);
    for &r in &roots {
        push.send_pcas(qmd_va(r));
        cuts.push(push.len());
    }
    for (k, &u) in wide.iter().enumerate() {
        push.sem_acquire(
            done + 4 * (k as u64 + 1),
            1,
            Acquire::CircularGeq,
            false,
            false,
        );
        for v in deps.succs(id(u)).iter().map(|v| v.index()) {
            if host_sent[v] {
                push.send_pcas(qmd_va(v));
            } else {
                push.send_pcas_decrement(qmd_va(v));
            }
            // Entries may end between the sends: the acquire before them stays first.
            cuts.push(push.len());
        }
    }
    push.sem_acquire(done, sinks as u64, Acquire::CircularGeq, false, false);
    cuts.push(push.len());
    // Zero the words for the next replay with the front end's own releases, in order with its acquires (a reset by
    // the compute engine could land after the next replay's acquire had read a stale 1). Every add of this replay
    // has landed: each wide node's before its acquire passed, every sink's before the last one did.
    for k in 0..reset {
        push.sem_release(
            done + 4 * k as u64,
            0,
            Release {
                wfi: false,
                wide: false,
                timestamp: false,
            },
        );
        cuts.push(push.len());
    }
    let len = push.finish().map_err(crate::pushbuf::Error::from)?;
    words.truncate(len);

    let armed: Vec<usize> = deps
        .order()
        .iter()
        .rev()
        .map(|v| v.index())
        .filter(|&v| indeg[v] > 0 && !host_sent[v])
        .collect();
    let mut arm = vec![0u32; PCAS_WORDS * (armed.len() + nulls)];
    let mut push = Push::new(&mut arm);
    let mut arm_cuts = Vec::with_capacity(armed.len() + nulls);
    for v in armed {
        push.send_pcas(qmd_va(v));
        arm_cuts.push(push.len());
    }
    for k in (0..nulls).rev() {
        push.send_pcas(null_va(k));
        arm_cuts.push(push.len());
    }
    let len = push.finish().map_err(crate::pushbuf::Error::from)?;
    arm.truncate(len);
    let sent = roots.len() + host_sent.iter().filter(|&&h| h).count();
    Ok((words, cuts, arm, arm_cuts, sent, 1 + wide.len()))
}

/// The methods of [`GraphSchedule::FrontEnd`] (see [`GraphExec`]): heads with their waits, the sinks, the resets.
///
/// [`GraphSchedule::FrontEnd`]: super::GraphSchedule::FrontEnd
/// [`GraphExec`]: super::GraphExec
pub(super) fn front_end_methods(
    deps: &crate::launch::graph::Dependencies,
    prev: &[Option<usize>],
    ends: &[usize],
    semaphore: &[Option<u64>],
    qmd_va: impl Fn(usize) -> u64,
) -> Result<Methods> {
    let id = NodeId::at;
    let n = semaphore.len();
    // The heads (every node that is no chain link), by level, then topological order.
    let levels = deps.levels();
    let mut position = vec![0usize; n];
    for (p, v) in deps.order().iter().enumerate() {
        position[v.index()] = p;
    }
    let mut heads: Vec<usize> = (0..n).filter(|&v| prev[v].is_none()).collect();
    heads.sort_unstable_by_key(|&v| (levels[v], position[v]));
    let heads = &heads[..];
    let preds_total: usize = heads.iter().map(|&h| deps.preds(id(h)).len()).sum();
    let sinks: Vec<usize> = deps
        .order()
        .iter()
        .map(|v| v.index())
        .filter(|&v| deps.succs(id(v)).is_empty())
        .collect();
    let capacity =
        SEMAPHORE_WORDS * (preds_total + sinks.len() + ends.len()) + PCAS_WORDS * heads.len();
    let mut words = vec![0u32; capacity];
    let mut push = Push::new(&mut words);
    // Where the methods may be cut into GPFIFO entries: between groups, never inside one.
    let mut cuts = Vec::new();
    let mut known = vec![false; n];
    let mut waits = 0;
    let wait = |push: &mut Push<'_>, known: &mut Vec<bool>, v: usize| {
        let Some(sem) = semaphore[v] else {
            return false;
        };
        push.sem_acquire(sem, 1, Acquire::CircularGeq, true, false);
        // Its completion implies its ancestors' (it started after them).
        let mut stack = vec![v];
        while let Some(u) = stack.pop() {
            if !std::mem::replace(&mut known[u], true) {
                stack.extend(deps.preds(id(u)).iter().map(|p| p.index()));
            }
        }
        true
    };
    for &h in heads {
        for p in deps.preds(id(h)) {
            if !known[p.index()] && wait(&mut push, &mut known, p.index()) {
                waits += 1;
            }
        }
        push.send_pcas(qmd_va(h));
        cuts.push(push.len());
    }
    for &s in &sinks {
        if !known[s] && wait(&mut push, &mut known, s) {
            waits += 1;
            cuts.push(push.len());
        }
    }
    for &e in ends {
        if let Some(sem) = semaphore[e] {
            push.sem_release(
                sem,
                0,
                Release {
                    wfi: false,
                    wide: true,
                    timestamp: false,
                },
            );
            cuts.push(push.len());
        }
    }
    let len = push.finish().map_err(crate::pushbuf::Error::from)?;
    words.truncate(len);
    debug_assert!(
        ends.iter().all(|&e| known[e]),
        "every semaphore is acquired before it is reset"
    );
    Ok((words, cuts, Vec::new(), Vec::new(), heads.len(), waits))
}

/// Cuts `[0, last cut)` into runs of at most `max` words, at the cut points (each group is far shorter than
/// `max`). Returns (start, words) pairs.
pub(super) fn split(cuts: &[usize], max: usize) -> Vec<(usize, usize)> {
    let mut pieces = Vec::new();
    let (mut start, mut last) = (0, 0);
    for &c in cuts {
        if c - start > max && last > start {
            pieces.push((start, last - start));
            start = last;
        }
        last = c;
    }
    if last > start {
        pieces.push((start, last - start));
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::split;

    #[test]
    fn methods_are_cut_between_groups() {
        assert_eq!(split(&[], 10), vec![]);
        assert_eq!(split(&[4, 8, 12], 100), vec![(0, 12)]);
        assert_eq!(split(&[4, 8, 12], 10), vec![(0, 8), (8, 4)]);
        assert_eq!(split(&[6, 12, 18, 24], 12), vec![(0, 12), (12, 12)]);
        // Every piece within the limit, together covering everything.
        let cuts: Vec<usize> = (1..=100).map(|i| i * 7).collect();
        let pieces = split(&cuts, 50);
        assert!(pieces.iter().all(|&(_, l)| l <= 50));
        assert_eq!(pieces.iter().map(|p| p.1).sum::<usize>(), 700);
        for w in pieces.windows(2) {
            assert_eq!(w[0].0 + w[0].1, w[1].0);
        }
    }
}
