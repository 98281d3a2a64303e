//! Instantiating a graph ([`ComputeQueue::instantiate_graph`]): every launch checked, the dependencies cut into
//! chains (or resolved by the work distributor), the memory laid out, and the QMDs and constant banks written once.

use tracing::debug;

use crate::launch::cbank::DRIVER_BYTES;
use crate::launch::graph::{Graph, NodeId, Op};
use crate::launch::params::{Arg, pack};
use crate::launch::qmd::{self, DependentAction, GraphNodeForm, QMD_WORDS, QmdParams, QmdVersion};
use crate::launch::{Error, Result};
use crate::module::Kernel;
use crate::pushbuf::Queue;
use crate::rm::{Memory, MemoryDesc};

use super::super::slots::{bank0_size, qmd_params};
use super::super::{LOCAL_RESERVE, MAX_PARAM_BYTES, QMD_BYTES};
use super::methods::{GpuPlan, front_end_methods, gpu_methods, split};
use super::node::{driver_words, finish_node, latch_id};
use super::{
    ComputeQueue, DRIVER_WORDS, ExecNode, GraphExec, GraphSchedule, GraphStats, LaunchConfig,
};

/// A completion semaphore: the QMD's four-word release (64-bit payload, then a timestamp).
const SEMAPHORE_BYTES: u64 = 16;
/// QMDs are addressed in 256-byte units (SEND_PCAS_A, DEPENDENT_QMD0_POINTER).
const NODE_ALIGN: u64 = 256;
/// The widest fan-out the work distributor resolves itself ([`GraphSchedule::Gpu`]): at most two levels of null
/// grids. Measured on an H100 (empty kernels, replay + wait): a fan-out of 4 over nulls 8.61 µs against 8.79 µs
/// sent by the front end; of 32, 16.38 µs over four levels against 14.95 µs.
const MAX_SPREAD: usize = GraphExec::MAX_GPU_FAN_OUT;

/// A node as planned from the graph: the kernel that runs it and its checked launch.
struct Planned {
    kernel: Kernel,
    copy: bool,
    cfg: LaunchConfig,
    params: Vec<u8>,
    shape: (u32, Option<[u32; 3]>),
}

impl ComputeQueue {
    /// Builds `graph` for this queue, once: every launch checked as [`launch`](Self::launch) checks it, the
    /// dependencies derived and reduced, QMDs, constant banks and the methods that send them written to memory of
    /// the graph's own (see [`GraphExec`] for the schedule). Chain links use the chain action set now
    /// ([`set_chain_action`](Self::set_chain_action)). Local memory grows here if a kernel needs more stack, so no
    /// replay has to. Nothing runs until [`replay_graph`](Self::replay_graph).
    pub fn instantiate_graph(&mut self, graph: &Graph<Kernel>) -> Result<GraphExec> {
        let deps = graph.dependencies()?;
        let n = graph.len();
        let mut planned = Vec::with_capacity(n);
        for node in graph.nodes() {
            planned.push(match node.op() {
                Op::Launch {
                    kernel,
                    cfg,
                    params,
                } => {
                    let shape = self.check(kernel, cfg)?;
                    let k = kernel.info();
                    if params.len() != k.param_cbank_size as usize {
                        return Err(Error::InvalidLaunch {
                            kernel: k.name.clone(),
                            why: format!(
                                "a {}-byte parameter block, the kernel takes {} bytes; pack the arguments with \
                                 Graph::launch_args",
                                params.len(),
                                k.param_cbank_size
                            ),
                        });
                    }
                    Planned {
                        kernel: kernel.clone(),
                        copy: false,
                        cfg: *cfg,
                        params: params.clone(),
                        shape,
                    }
                }
                &Op::Copy { src, dst, bytes } => {
                    if bytes == 0 {
                        return Err(Error::InvalidLaunch {
                            kernel: "apex_copy".into(),
                            why: "a copy of 0 bytes in a graph".into(),
                        });
                    }
                    let (kernel, cfg) = self.copy_launch(bytes)?;
                    let mut params = vec![0u8; kernel.info().param_cbank_size as usize];
                    pack(
                        kernel.info(),
                        &[Arg::Ptr(src), Arg::Ptr(dst), Arg::U64(bytes)],
                        &mut params,
                    )?;
                    let shape = self.check(&kernel, &cfg)?;
                    Planned {
                        kernel,
                        copy: true,
                        cfg,
                        params,
                        shape,
                    }
                }
            });
        }

        // Stack and printf for every kernel now, so a replay never changes the queue's state.
        let stack = planned
            .iter()
            .map(|p| p.kernel.info().min_stack_size)
            .max()
            .unwrap_or(0);
        if stack + LOCAL_RESERVE > self.local_per_thread {
            self.ensure_local_memory(stack)?;
        }
        let printf = planned
            .iter()
            .find_map(|p| p.kernel.module().printf_fifo().cloned());
        let generation = planned
            .iter()
            .map(|p| p.kernel.module().generation())
            .max()
            .unwrap_or(0);
        // A module whose constant bank another instance writes (CUDA's `cudaMemcpyToSymbol`): no replay may keep the
        // constant caches.
        let shared_banks = planned.iter().any(|p| p.kernel.module().shares_constants());

        // Chains: u → v when v is u's only successor and u is v's only predecessor.
        let id = NodeId::at;
        let mut next: Vec<Option<usize>> = vec![None; n];
        for (u, next) in next.iter_mut().enumerate() {
            if let [v] = deps.succs(id(u))
                && deps.preds(*v).len() == 1
            {
                *next = Some(v.index());
            }
        }
        let mut prev: Vec<Option<usize>> = vec![None; n];
        for (u, w) in next.iter().enumerate() {
            if let Some(w) = *w {
                prev[w] = Some(u);
            }
        }

        // The work distributor's counters hold 16 bits: a wider fan-in is left to the front end.
        let indeg: Vec<usize> = (0..n).map(|v| deps.preds(id(v)).len()).collect();
        let gpu = self.graph_schedule == GraphSchedule::Gpu
            && self.version == QmdVersion::V04
            && indeg.iter().all(|&d| d <= usize::from(u16::MAX));

        // Layout: each node's QMD and constant bank, the null grids, then the semaphores (the chain ends', or the
        // one completion word).
        let mut offsets = Vec::with_capacity(n);
        let mut at = 0u64;
        for p in &planned {
            offsets.push(at);
            let bank = (DRIVER_BYTES as u64 + u64::from(p.kernel.info().param_cbank_size))
                .next_multiple_of(16);
            at += (QMD_BYTES + bank).next_multiple_of(NODE_ALIGN);
        }
        // A fan-out wider than MAX_SPREAD is sent by the front end once the node has completed; narrower ones are
        // the work distributor's, over null grids beyond two.
        // In topological order: the front end waits for them one after another, so a wide node must never be waited
        // for before one it depends on (explicit edges may point backwards in recording order).
        let wide: Vec<usize> = if gpu {
            deps.order()
                .iter()
                .map(|v| v.index())
                .filter(|&u| deps.succs(id(u)).len() > MAX_SPREAD)
                .collect()
        } else {
            Vec::new()
        };
        let mut signal_of = vec![None; n];
        for (k, &u) in wide.iter().enumerate() {
            signal_of[u] = Some(k);
        }
        // Nodes the front end sends: the only successor of a wide fan-out.
        let host_sent: Vec<bool> = (0..n)
            .map(|v| matches!(deps.preds(id(v)), [p] if signal_of[p.index()].is_some()))
            .collect();
        let mut nulls: Vec<[Option<Target>; 2]> = Vec::new();
        let mut dependents: Vec<[Option<Target>; 2]> = vec![[None, None]; n];
        if gpu {
            for (u, d) in dependents.iter_mut().enumerate() {
                if signal_of[u].is_none() {
                    let succs: Vec<usize> = deps.succs(id(u)).iter().map(|v| v.index()).collect();
                    *d = spread(&succs, &mut nulls);
                }
            }
        }
        let null_base = at;
        let null_bytes = QMD_BYTES.next_multiple_of(NODE_ALIGN);
        at += nulls.len() as u64 * null_bytes;
        let ends: Vec<usize> = if gpu {
            Vec::new()
        } else {
            (0..n).filter(|&v| next[v].is_none()).collect()
        };
        let sem_base = at;
        // Gpu: the completion word, then one word per wide fan-out, 32 bits each.
        let sem_count = if gpu {
            if n > 0 { 1 + wide.len() as u64 } else { 0 }
        } else {
            ends.len() as u64
        };
        let sem_bytes = if gpu {
            (sem_count * 4).next_multiple_of(SEMAPHORE_BYTES)
        } else {
            sem_count * SEMAPHORE_BYTES
        };
        let size = (sem_base + sem_bytes).max(NODE_ALIGN);
        let mem = Memory::alloc(&self.gpu, MemoryDesc::video(size).with_cpu().low())?;
        let base = mem.va();
        let mut semaphore = vec![None; n];
        for (k, &v) in ends.iter().enumerate() {
            semaphore[v] = Some(base + sem_base + k as u64 * SEMAPHORE_BYTES);
        }
        if sem_bytes > 0 {
            mem.fill(sem_base, sem_bytes, 0)?;
        }
        let done = base + sem_base;
        let signal = |k: usize| done + 4 * (k as u64 + 1);
        let target = |t: Target| match t {
            Target::Node(w) if indeg[w] > 1 => (base + offsets[w], DependentAction::Decrement),
            Target::Node(w) => (base + offsets[w], DependentAction::Schedule),
            Target::Null(k) => (
                base + null_base + k as u64 * null_bytes,
                DependentAction::Schedule,
            ),
        };
        // Each node's constant bank 0 as its QMD binds it, for its predecessor to prefetch.
        let banks: Vec<qmd::ConstBuffer> = offsets
            .iter()
            .zip(&planned)
            .map(|(&o, p)| qmd::ConstBuffer {
                va: base + o + QMD_BYTES,
                size: bank0_size(&p.kernel),
            })
            .collect();
        let prefetch = |d: [Option<Target>; 2]| {
            d.map(|t| match t {
                Some(Target::Node(w)) => Some(banks[w]),
                _ => None,
            })
        };
        // A programmatic consumer is scheduled at its producer's pre-exit, before a POST prefetch by the producer
        // could land: it prefetches its own bank 0 instead (PRE), as libcuda's programmatic graph nodes do
        // (apex-trace of examples/pdl_latency, H100, 580.159.04).
        let programmatic_edge =
            |v: usize, w: usize| next[v] == Some(w) && graph.nodes()[w].is_programmatic();
        let form = |v: usize| GraphNodeForm {
            dependents: dependents[v].map(|t| t.map(target)),
            prefetch: prefetch(dependents[v].map(|t| match t {
                Some(Target::Node(w)) if programmatic_edge(v, w) => None,
                t => t,
            })),
            counter: if indeg[v] > 1 { indeg[v] as u16 } else { 0 },
            armed: indeg[v] > 0 && !host_sent[v],
            done: match signal_of[v] {
                Some(k) => Some(signal(k)),
                None => deps.succs(id(v)).is_empty().then_some(done),
            },
        };

        // QMDs and constant banks, written once.
        let action = self.chain_action;
        let qmd_words = self.version.size_bytes() / 4;
        let windows = (self.shared_window(), self.local_window());
        let mut nodes = Vec::with_capacity(n);
        for (v, p) in planned.into_iter().enumerate() {
            let offset = offsets[v];
            let cb_va = base + offset + QMD_BYTES;
            let params = qmd_params(
                &p.kernel,
                &p.cfg,
                p.shape,
                cb_va,
                self.local_per_thread,
                semaphore[v].map(|s| (s, 1)),
            )?;
            let link = if gpu {
                None
            } else {
                next[v].map(|w| (base + offsets[w], action))
            };
            let form = gpu.then(|| form(v));
            // A programmatic edge (a chain link into a node whose kernel waits for its producer itself): the producer
            // arrives at a latch of its own, numbered by node, and lets the consumer be scheduled at pre-exit.
            let arrive = next[v]
                .filter(|&w| graph.nodes()[w].is_programmatic())
                .map(|_| latch_id(v));
            let wait = prev[v]
                .filter(|_| graph.nodes()[v].is_programmatic())
                .map(latch_id);
            let latch = (arrive, wait);
            let mut q = [0u32; QMD_WORDS];
            qmd::build(self.version, &params, &mut q)?;
            finish_node(self.version, &mut q, form.as_ref(), link, latch)?;
            mem.write_words(offset, &q[..qmd_words])?;
            let mut driver = [0u32; DRIVER_WORDS];
            driver_words(
                &mut driver,
                &p.cfg,
                p.shape.1,
                windows,
                (cb_va, p.kernel.info().param_cbank_size),
            );
            mem.write_words(offset + QMD_BYTES, &driver)?;
            let bank = (DRIVER_BYTES + p.params.len()).next_multiple_of(16);
            let params_at = offset + QMD_BYTES + DRIVER_BYTES as u64;
            mem.write(params_at, &p.params)?;
            let pad = (bank - DRIVER_BYTES - p.params.len()) as u64;
            if pad > 0 {
                mem.fill(params_at + p.params.len() as u64, pad, 0)?;
            }
            nodes.push(ExecNode {
                kernel: p.kernel,
                copy: p.copy,
                cfg: p.cfg,
                qmd: params,
                next: link,
                form,
                latch,
                offset,
                semaphore: semaphore[v],
                qmd_shadow: q,
                driver_shadow: driver,
            });
        }
        // Null grids: any node's QMD with no blocks (only its scheduling fields matter).
        for (k, deps_of) in nulls.iter().enumerate() {
            let mut q = [0u32; QMD_WORDS];
            // Any node's parameters but a cluster shape: a null grid is a plain GRID_CTA QMD.
            let p = QmdParams {
                cluster: None,
                ..nodes[0].qmd
            };
            qmd::build(self.version, &p, &mut q)?;
            qmd::set_null_grid(self.version, &mut q)?;
            let f = GraphNodeForm {
                dependents: deps_of.map(|t| t.map(target)),
                prefetch: prefetch(*deps_of),
                counter: 0,
                armed: true,
                done: None,
            };
            qmd::set_graph_node(self.version, &mut q, &f)?;
            qmd::keep_constant_cache(self.version, &mut q)?;
            mem.write_words(null_base + k as u64 * null_bytes, &q[..qmd_words])?;
        }

        let (words, cuts, arm_words, arm_cuts, heads_sent, waits) = if gpu {
            gpu_methods(&GpuPlan {
                deps: &deps,
                indeg: &indeg,
                wide: &wide,
                host_sent: &host_sent,
                qmd_va: &|v| base + offsets[v],
                null_va: &|k| base + null_base + k as u64 * null_bytes,
                nulls: nulls.len(),
                done,
            })?
        } else {
            front_end_methods(&deps, &prev, &ends, &semaphore, |v| base + offsets[v])?
        };
        debug_assert!(
            ends.iter().all(|&e| semaphore[e].is_some()),
            "every chain end has a semaphore"
        );

        let all = words.len() + arm_words.len();
        let (methods_mem, pieces, arm_pieces) = if all == 0 {
            (None, Vec::new(), Vec::new())
        } else {
            let m = Memory::alloc(
                &self.gpu,
                MemoryDesc::video(all as u64 * 4).with_cpu().low(),
            )?;
            m.write_words(0, &words)?;
            m.write_words(words.len() as u64 * 4, &arm_words)?;
            let at = |start: usize, (s, len): (usize, usize)| {
                (m.va() + (start + s) as u64 * 4, len as u64)
            };
            let max = Queue::MAX_PREBUILT_DWORDS as usize;
            let pieces = split(&cuts, max).into_iter().map(|p| at(0, p)).collect();
            let arm_pieces = split(&arm_cuts, max)
                .into_iter()
                .map(|p| at(words.len(), p))
                .collect();
            (Some(m), pieces, arm_pieces)
        };
        let stats = GraphStats {
            nodes: n,
            edges: deps.edges().len(),
            heads: heads_sent,
            links: n - heads_sent,
            waits,
            semaphores: sem_count as usize,
            method_words: words.len(),
            entries: pieces.len(),
            nulls: nulls.len(),
            armed: arm_cuts.len(),
        };
        debug!(?stats, "graph instantiated");
        Ok(GraphExec {
            queue_id: self.id,
            mem,
            _methods_mem: methods_mem,
            methods: words,
            arm_methods: arm_words,
            schedule: if gpu {
                GraphSchedule::Gpu
            } else {
                GraphSchedule::FrontEnd
            },
            completion: (gpu && n > 0).then_some(done),
            pieces,
            arm_pieces,
            armed: false,
            nodes,
            version: self.version,
            limits: self.limits,
            windows,
            generation,
            banks_written: true,
            shared_banks,
            printf,
            last: None,
            timeout: self.timeout,
            scratch: vec![0; MAX_PARAM_BYTES],
            stats,
        })
    }
}

/// Where a node's dependent action goes: another node, or a null grid that spreads it further.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    Node(usize),
    Null(usize),
}

/// The (at most two) dependents that reach every node of `succs`: the nodes themselves when there are at most
/// two, else two balanced halves, each a node or a null grid (appended to `nulls`) spreading it further, so no
/// successor is more than log2(len) null grids away.
fn spread(succs: &[usize], nulls: &mut Vec<[Option<Target>; 2]>) -> [Option<Target>; 2] {
    fn half(part: &[usize], nulls: &mut Vec<[Option<Target>; 2]>) -> Target {
        if let [v] = part {
            return Target::Node(*v);
        }
        let d = spread(part, nulls);
        nulls.push(d);
        Target::Null(nulls.len() - 1)
    }
    match succs {
        [] => [None, None],
        [a] => [Some(Target::Node(*a)), None],
        [a, b] => [Some(Target::Node(*a)), Some(Target::Node(*b))],
        _ => {
            let (l, r) = succs.split_at(succs.len() / 2);
            [Some(half(l, nulls)), Some(half(r, nulls))]
        }
    }
}
