//! The host (PBDMA) methods: SET_OBJECT, NOP, interrupts, memory operations, and host semaphores (release,
//! acquire, timestamps).

use super::super::headers::{c56f, c86f as host};
use super::decode::Method;
use super::{ChannelModel, Flow, mmu};
use crate::rm::sim::SimView;

use super::super::SimErrorKind;

#[derive(Debug, Default)]
pub(super) struct Semaphore {
    addr_lo: u32,
    addr_hi: u32,
    payload_lo: u32,
    payload_hi: u32,
}

impl ChannelModel {
    pub(super) fn host_method(
        &mut self,
        m: &Method,
        view: &SimView<'_>,
        now: &dyn Fn() -> u64,
    ) -> Result<Flow, SimErrorKind> {
        let v = m.value;
        match m.offset {
            host::SET_OBJECT => {
                let class = c56f::SET_OBJECT_NVCLASS.unpack(v);
                let ok = if m.subchannel == 0 {
                    class == self.ch.class
                } else {
                    view.channel_has_class(self.ch.handle, class)
                };
                if !ok {
                    return Err(SimErrorKind::ClassNotOnChannel {
                        subchannel: m.subchannel,
                        class,
                    });
                }
                self.bound[usize::from(m.subchannel)] = Some(class);
            }
            c56f::NOP => {}
            c56f::NON_STALL_INTERRUPT => self.stats.non_stall_interrupts += 1,
            host::MEM_OP_A | host::MEM_OP_B | host::MEM_OP_C => {}
            host::MEM_OP_D => {
                if host::MEM_OP_D_OPERATION.unpack(v) == host::MEM_OP_D_OPERATION_MEMBAR {
                    self.stats.membars += 1;
                }
            }
            host::SEM_ADDR_LO => self.sem.addr_lo = v,
            host::SEM_ADDR_HI => self.sem.addr_hi = v,
            host::SEM_PAYLOAD_LO => self.sem.payload_lo = v,
            host::SEM_PAYLOAD_HI => self.sem.payload_hi = v,
            host::SEM_EXECUTE => return self.sem_execute(v, view, now),
            host::WFI => self.stats.wfis += 1,
            method => {
                return Err(SimErrorKind::UnknownMethod {
                    subchannel: m.subchannel,
                    class: self.ch.class,
                    method,
                });
            }
        }
        Ok(Flow::Continue)
    }

    fn sem_execute(
        &mut self,
        exec: u32,
        view: &SimView<'_>,
        now: &dyn Fn() -> u64,
    ) -> Result<Flow, SimErrorKind> {
        let s = &self.sem;
        let va = (u64::from(host::SEM_ADDR_HI_OFFSET.unpack(s.addr_hi)) << 32)
            | u64::from(host::SEM_ADDR_LO_OFFSET.unpack(s.addr_lo) << 2);
        let wide =
            host::SEM_EXECUTE_PAYLOAD_SIZE.unpack(exec) == c56f::SEM_EXECUTE_PAYLOAD_SIZE_64BIT;
        let payload = if wide {
            u64::from(s.payload_lo) | (u64::from(s.payload_hi) << 32)
        } else {
            u64::from(s.payload_lo)
        };
        let op = host::SEM_EXECUTE_OPERATION.unpack(exec);
        let timestamp = host::SEM_EXECUTE_RELEASE_TIMESTAMP.unpack(exec)
            == host::SEM_EXECUTE_RELEASE_TIMESTAMP_EN
            && op == host::SEM_EXECUTE_OPERATION_RELEASE;
        let align = if wide || timestamp { 8 } else { 4 };
        if !va.is_multiple_of(align) {
            return Err(SimErrorKind::BadSemaphore {
                va,
                why: "address not aligned to the payload (and timestamp)",
            });
        }
        let read = |view: &SimView<'_>| -> Result<u64, SimErrorKind> {
            if wide {
                view.read_u64(va).map_err(mmu("semaphore"))
            } else {
                view.read_u32(va).map(u64::from).map_err(mmu("semaphore"))
            }
        };
        let satisfied = match op {
            host::SEM_EXECUTE_OPERATION_RELEASE => {
                if wide {
                    view.write_u64(va, payload).map_err(mmu("semaphore"))?;
                } else {
                    view.write_u32(va, payload as u32)
                        .map_err(mmu("semaphore"))?;
                }
                if timestamp {
                    view.write_u64(va + 8, now())
                        .map_err(mmu("semaphore timestamp"))?;
                }
                self.stats.releases += 1;
                if host::SEM_EXECUTE_RELEASE_WFI.unpack(exec) == c56f::SEM_EXECUTE_RELEASE_WFI_EN {
                    self.stats.wfis += 1;
                }
                true
            }
            host::SEM_EXECUTE_OPERATION_ACQUIRE => read(view)? == payload,
            c56f::SEM_EXECUTE_OPERATION_ACQ_STRICT_GEQ => read(view)? >= payload,
            host::SEM_EXECUTE_OPERATION_ACQ_CIRC_GEQ => {
                let cur = read(view)?;
                if wide {
                    cur.wrapping_sub(payload) as i64 >= 0
                } else {
                    (cur as u32).wrapping_sub(payload as u32) as i32 >= 0
                }
            }
            _ => {
                return Err(SimErrorKind::BadSemaphore {
                    va,
                    why: "semaphore operation not modelled (AND, NOR, reductions)",
                });
            }
        };
        if !satisfied {
            return Ok(Flow::Blocked);
        }
        if op != host::SEM_EXECUTE_OPERATION_RELEASE {
            self.stats.acquires += 1;
        }
        Ok(Flow::Continue)
    }
}
