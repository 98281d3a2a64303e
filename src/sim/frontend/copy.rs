//! The copy engine: linear copies between virtual addresses and their one-word completion semaphore.

use super::super::headers::c8b5 as copy;
use super::decode::Method;
use super::{ChannelModel, Flow, mmu, set_lower, set_upper};
use crate::rm::sim::SimView;

use super::super::SimErrorKind;

/// The copy engine's registers (the pitch-linear, virtual-address subset APEX uses).
#[derive(Debug, Default)]
pub(super) struct CopyState {
    offset_in: u64,
    offset_out: u64,
    line_length: u32,
    semaphore: u64,
    payload: u32,
}

impl ChannelModel {
    /// The copy engine: linear copies between virtual addresses, checked against the live allocations this GPU
    /// can reach (its own and those mapped on it from peers), and its one-word completion semaphore.
    pub(super) fn copy_method(
        &mut self,
        m: &Method,
        view: &SimView<'_>,
    ) -> Result<Flow, SimErrorKind> {
        let v = m.value;
        let c = &mut self.copy;
        match m.offset {
            copy::NOP => {}
            copy::OFFSET_IN_UPPER => {
                set_upper(&mut c.offset_in, copy::OFFSET_IN_UPPER_UPPER.unpack(v))
            }
            copy::OFFSET_IN_LOWER => set_lower(&mut c.offset_in, v),
            copy::OFFSET_OUT_UPPER => {
                set_upper(&mut c.offset_out, copy::OFFSET_OUT_UPPER_UPPER.unpack(v))
            }
            copy::OFFSET_OUT_LOWER => set_lower(&mut c.offset_out, v),
            copy::LINE_LENGTH_IN => c.line_length = v,
            copy::SET_SEMAPHORE_A => {
                set_upper(&mut c.semaphore, copy::SET_SEMAPHORE_A_UPPER.unpack(v))
            }
            copy::SET_SEMAPHORE_B => set_lower(&mut c.semaphore, v),
            copy::SET_SEMAPHORE_PAYLOAD => c.payload = v,
            copy::LAUNCH_DMA => {
                let bad = |why| Err(SimErrorKind::BadCopy { why });
                if copy::LAUNCH_DMA_SRC_TYPE.unpack(v) != copy::LAUNCH_DMA_SRC_TYPE_VIRTUAL
                    || copy::LAUNCH_DMA_DST_TYPE.unpack(v) != copy::LAUNCH_DMA_DST_TYPE_VIRTUAL
                {
                    return bad("physical addresses are not modelled");
                }
                if copy::LAUNCH_DMA_SRC_MEMORY_LAYOUT.unpack(v)
                    != copy::LAUNCH_DMA_SRC_MEMORY_LAYOUT_PITCH
                    || copy::LAUNCH_DMA_DST_MEMORY_LAYOUT.unpack(v)
                        != copy::LAUNCH_DMA_DST_MEMORY_LAYOUT_PITCH
                {
                    return bad("block-linear layouts are not modelled");
                }
                if copy::LAUNCH_DMA_MULTI_LINE_ENABLE.unpack(v)
                    != copy::LAUNCH_DMA_MULTI_LINE_ENABLE_FALSE
                {
                    return bad("multi-line copies are not modelled");
                }
                if copy::LAUNCH_DMA_DATA_TRANSFER_TYPE.unpack(v)
                    != copy::LAUNCH_DMA_DATA_TRANSFER_TYPE_NONE
                {
                    let mut bytes = vec![0u8; c.line_length as usize];
                    view.read(c.offset_in, &mut bytes)
                        .map_err(mmu("copy source"))?;
                    view.write(c.offset_out, &bytes)
                        .map_err(mmu("copy destination"))?;
                    self.stats.copies += 1;
                }
                match copy::LAUNCH_DMA_SEMAPHORE_TYPE.unpack(v) {
                    copy::LAUNCH_DMA_SEMAPHORE_TYPE_NONE => {}
                    copy::LAUNCH_DMA_SEMAPHORE_TYPE_RELEASE_ONE_WORD_SEMAPHORE => view
                        .write_u32(c.semaphore, c.payload)
                        .map_err(mmu("copy semaphore"))?,
                    _ => return bad("four-word and conditional semaphores are not modelled"),
                }
            }
            method => {
                return Err(SimErrorKind::UnknownMethod {
                    subchannel: m.subchannel,
                    class: copy::CLASS,
                    method,
                });
            }
        }
        Ok(Flow::Continue)
    }
}
