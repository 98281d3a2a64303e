//! A node's QMD and constant bank 0 as the graph needs them: the graph fields, chain link and latches added to a
//! built QMD, the driver words, and [`GraphExec::update_launch`], which rewrites them in place.

use crate::launch::cbank::{
    CLUSTER_WORDS, CLUSTER_WORDS_START, DRIVER_BYTES, PARAM_BLOCK_START, PARAM_BLOCK_WORDS,
    param_block_words, write_cluster_words, write_driver_words,
};
use crate::launch::graph::{GraphError, NodeId};
use crate::launch::params::{Arg, pack};
use crate::launch::qmd::{self, ChainAction, QMD_WORDS, QmdVersion};
use crate::launch::{Error, Result};

use super::super::slots::write_changed;
use super::super::{QMD_BYTES, cluster_shape, validate};
use super::{DRIVER_WORDS, GraphExec, LaunchConfig};

impl GraphExec {
    /// Gives launch `node` new arguments and a new shape (grid, block, dynamic shared memory) for later replays,
    /// checked as a launch is: the arguments against the kernel's parameter table, the shape against the device
    /// limits. Refused: a copy node, a different cluster shape. Waits for the previous replay to complete, then
    /// rewrites only this node's QMD words that change, its driver words and its parameters; nothing allocates.
    /// Chain links use the queue's [`ChainAction`] of instantiation time: the default fetches each linked QMD
    /// afresh; `ChainAction::Schedule` is meant for QMDs that never change, so instantiate a graph whose nodes will
    /// be updated with the default.
    pub fn update_launch(
        &mut self,
        node: NodeId,
        cfg: &LaunchConfig,
        args: &[Arg<'_>],
    ) -> Result<()> {
        let len = self.nodes.len();
        let n = self
            .nodes
            .get_mut(node.index())
            .ok_or(Error::Graph(GraphError::NoSuchNode {
                node: node.index(),
                len,
            }))?;
        if n.copy {
            return Err(Error::GraphUpdate {
                node: node.index(),
                why: "it is a copy; only kernel launches take new arguments (record a new graph to change a copy)"
                    .into(),
            });
        }
        let k = n.kernel.info();
        if *cfg == n.cfg {
            // Same shape: the QMD and driver words stay as they are; only the parameter block changes.
            let bytes = pack(k, args, &mut self.scratch)?;
            if let Some(f) = &self.last
                && !f.is_done()
            {
                // The GPU may still be reading this node's constant bank.
                f.wait(self.timeout)?;
            }
            self.mem.write(
                n.offset + QMD_BYTES + DRIVER_BYTES as u64,
                &self.scratch[..bytes],
            )?;
            self.banks_written = true;
            return Ok(());
        }
        let shared = validate(k, cfg, &self.limits)?;
        let cluster = cluster_shape(k, cfg, &self.limits)?;
        if cluster != n.qmd.cluster {
            return Err(Error::GraphUpdate {
                node: node.index(),
                why: format!(
                    "its cluster shape would change from {:?} to {cluster:?}; the cluster shape is fixed when the \
                     graph is instantiated (record a new graph to change it)",
                    n.qmd.cluster
                ),
            });
        }
        let bytes = pack(k, args, &mut self.scratch)?;
        if let Some(f) = &self.last
            && !f.is_done()
        {
            // The GPU may still be reading this node's QMD and constant bank.
            f.wait(self.timeout)?;
        }
        let mut p = n.qmd;
        p.grid = cfg.grid;
        p.block = cfg.block;
        p.shared_bytes = shared.max(1024).next_multiple_of(256);
        let mut q = [0u32; QMD_WORDS];
        qmd::build(self.version, &p, &mut q)?;
        finish_node(self.version, &mut q, n.form.as_ref(), n.next, n.latch)?;
        if n.form.is_some() {
            // The work distributor may hold the old QMD: the next replay arms every node again, which
            // invalidates it.
            self.armed = false;
        }
        let qmd_words = self.version.size_bytes() / 4;
        write_changed(
            &self.mem,
            n.offset,
            &mut n.qmd_shadow[..qmd_words],
            &q[..qmd_words],
        )?;
        let mut driver = n.driver_shadow;
        let bank_va = self.mem.va() + n.offset + QMD_BYTES;
        driver_words(
            &mut driver,
            cfg,
            cluster,
            self.windows,
            (bank_va, k.param_cbank_size),
        );
        write_changed(
            &self.mem,
            n.offset + QMD_BYTES,
            &mut n.driver_shadow,
            &driver,
        )?;
        self.mem.write(
            n.offset + QMD_BYTES + DRIVER_BYTES as u64,
            &self.scratch[..bytes],
        )?;
        n.qmd = p;
        n.cfg = *cfg;
        self.banks_written = true;
        Ok(())
    }
}

/// The driver words of a node's constant bank 0 (at `bank_va`, its kernel taking `param_bytes` of parameters):
/// launch shape, windows, stack, the cluster words and the parameter block's address range.
pub(super) fn driver_words(
    out: &mut [u32; DRIVER_WORDS],
    cfg: &LaunchConfig,
    cluster: Option<[u32; 3]>,
    (shared, local): (u64, u64),
    (bank_va, param_bytes): (u64, u32),
) {
    write_driver_words(out, cfg.block, cfg.grid, shared, local);
    write_cluster_words(
        &mut out[CLUSTER_WORDS_START / 4..][..CLUSTER_WORDS],
        cfg.grid,
        cluster,
    );
    out[PARAM_BLOCK_START / 4..][..PARAM_BLOCK_WORDS]
        .copy_from_slice(&param_block_words(bank_va, param_bytes));
}

/// The latch a programmatic producer arrives at: one per producing node, so every edge of a graph has its own;
/// replays run one after another on the queue, so reusing them across replays is safe (as libcuda's graphs do).
pub(super) fn latch_id(node: usize) -> u32 {
    // libcuda numbers its latches from small values upwards; these stay in the 24 bits a latch id keeps.
    (node as u32 & 0x00ff_ffff) + 1
}

/// Makes a node's QMD, built by [`qmd::build`], what the graph needs: its dependents, counter and completion
/// (`form`, GPU-resolved) or its chain link (`link`, front-end schedule), the constant cache kept, its programmatic
/// edges (`latch`: a consumer also prefetches its own bank 0, since it starts at its producer's pre-exit, before a
/// POST prefetch by the producer would land, as libcuda's programmatic nodes do). Used when a graph is instantiated
/// and when a node is updated.
pub(super) fn finish_node(
    version: QmdVersion,
    q: &mut [u32; QMD_WORDS],
    form: Option<&qmd::GraphNodeForm>,
    link: Option<(u64, ChainAction)>,
    latch: (Option<u32>, Option<u32>),
) -> Result<()> {
    if let Some(f) = form {
        qmd::set_graph_node(version, q, f)?;
        if latch.1.is_some() {
            qmd::prefetch_own_bank0(version, q)?;
        }
    } else if link.is_some() {
        qmd::set_chain_link(version, q, link)?;
    }
    qmd::keep_constant_cache(version, q)?;
    set_latches(version, q, latch)?;
    Ok(())
}

/// Applies a node's programmatic edges to its QMD.
fn set_latches(
    version: QmdVersion,
    q: &mut [u32; QMD_WORDS],
    (arrive, wait): (Option<u32>, Option<u32>),
) -> Result<()> {
    if let Some(l) = arrive {
        qmd::set_latch_arrive(version, q, l)?;
    }
    if let Some(l) = wait {
        qmd::set_latch_wait(version, q, l)?;
    }
    Ok(())
}
