//! The simulated RM's RM_CONTROL: the controls APEX issues, answered as RM answers them.

use super::objects::{
    NV_ERR_INVALID_ARGUMENT, NV_ERR_INVALID_CHANNEL, NV_ERR_INVALID_OBJECT_HANDLE,
    NV_ERR_INVALID_STATE, NV_ERR_NOT_SUPPORTED, Obj, SimShared, State, is_copy_class,
    is_gpfifo_class, params,
};
use super::{is_sim_gpu_id, sim_gpu_id};
use crate::rm::transport::Handle;
use crate::rm::{NvStatus, lce_of_engine_type, sys};

impl SimShared {
    /// RM_CONTROL `cmd` on `object`, answering the controls APEX issues.
    pub(super) fn answer_control(
        &self,
        object: Handle,
        cmd: u32,
        ptr: *mut u8,
        size: usize,
    ) -> std::result::Result<(), NvStatus> {
        let mut st = self.lock();
        let obj = *st
            .objects
            .get(&object)
            .ok_or(NV_ERR_INVALID_OBJECT_HANDLE)?;
        let c = &self.config;
        // SAFETY (every `params` below): `ptr`/`size` are the parameter struct of `cmd`, lent by the caller.
        match cmd {
            sys::NV0080_CTRL_CMD_GPU_GET_CLASSLIST_V2 => {
                let p =
                    unsafe { params::<sys::NV0080_CTRL_GPU_GET_CLASSLIST_V2_PARAMS>(ptr, size)? };
                let n = self.classes.len().min(p.classList.len());
                p.classList[..n].copy_from_slice(&self.classes[..n]);
                p.numClasses = n as u32;
            }
            sys::NV2080_CTRL_CMD_GPU_GET_NAME_STRING => {
                let p =
                    unsafe { params::<sys::NV2080_CTRL_GPU_GET_NAME_STRING_PARAMS>(ptr, size)? };
                let mut ascii = [0u8; 64];
                let n = c.name.len().min(ascii.len() - 1);
                ascii[..n].copy_from_slice(&c.name.as_bytes()[..n]);
                p.gpuNameString.ascii = ascii;
            }
            sys::NV2080_CTRL_CMD_GPU_GET_GID_INFO => {
                let p = unsafe { params::<sys::NV2080_CTRL_GPU_GET_GID_INFO_PARAMS>(ptr, size)? };
                p.data[..16].copy_from_slice(&c.uuid);
                p.length = 16;
            }
            sys::NV2080_CTRL_CMD_GPU_GET_ENGINES_V2 => {
                let p = unsafe { params::<sys::NV2080_CTRL_GPU_GET_ENGINES_V2_PARAMS>(ptr, size)? };
                // The graphics engine and the present LCEs.
                let mut n = 0;
                p.engineList[n] = sys::NV2080_ENGINE_TYPE_GRAPHICS;
                n += 1;
                for lce in (0..32u32).filter(|l| c.copy_engines & (1 << l) != 0) {
                    if let Some(t) = crate::rm::engine::copy_engine_type(lce)
                        && n < p.engineList.len()
                    {
                        p.engineList[n] = t;
                        n += 1;
                    }
                }
                p.engineCount = n as u32;
            }
            crate::rm::control::NV2080_CTRL_CMD_CE_GET_CE_PCE_MASK => {
                let p = unsafe { params::<crate::rm::control::CePceMaskParams>(ptr, size)? };
                // One PCE for each present LCE (the PCE of the same index): equal shares of a split copy.
                let lce = crate::rm::engine::lce_of_engine_type(p.ce_engine_type)
                    .filter(|l| *l < 32 && c.copy_engines & (1 << l) != 0)
                    .ok_or(NV_ERR_INVALID_ARGUMENT)?;
                p.pce_mask = 1 << lce;
            }
            sys::NV2080_CTRL_CMD_GR_GET_INFO => {
                let p = unsafe { params::<sys::NV2080_CTRL_GR_GET_INFO_PARAMS>(ptr, size)? };
                let n = p.grInfoListSize as usize;
                let list = p.grInfoList.cast::<sys::NV2080_CTRL_GR_INFO>();
                if list.is_null() || n > 256 || !list.is_aligned() {
                    return Err(NV_ERR_INVALID_ARGUMENT);
                }
                // SAFETY: as RM requires, grInfoList points to grInfoListSize entries the caller owns.
                let list = unsafe { std::slice::from_raw_parts_mut(list, n) };
                for e in list {
                    e.data = match e.index {
                        // RM's 0xMMmm encoding.
                        sys::NV2080_CTRL_GR_INFO_INDEX_SM_VERSION => {
                            ((c.sm_version / 10) << 8) | (c.sm_version % 10)
                        }
                        sys::NV2080_CTRL_GR_INFO_INDEX_MAX_WARPS_PER_SM => c.max_warps_per_sm,
                        sys::NV2080_CTRL_GR_INFO_INDEX_LITTER_NUM_TPC_PER_GPC => {
                            c.tpcs_per_gpc.iter().copied().max().unwrap_or(0)
                        }
                        sys::NV2080_CTRL_GR_INFO_INDEX_LITTER_NUM_SM_PER_TPC => c.sms_per_tpc,
                        _ => return Err(NV_ERR_NOT_SUPPORTED),
                    };
                }
            }
            sys::NV2080_CTRL_CMD_GR_GET_GPC_MASK => {
                let p = unsafe { params::<sys::NV2080_CTRL_GR_GET_GPC_MASK_PARAMS>(ptr, size)? };
                p.gpcMask = mask(c.tpcs_per_gpc.len() as u32);
            }
            sys::NV2080_CTRL_CMD_GR_GET_TPC_MASK => {
                let p = unsafe { params::<sys::NV2080_CTRL_GR_GET_TPC_MASK_PARAMS>(ptr, size)? };
                let tpcs = c
                    .tpcs_per_gpc
                    .get(p.gpcId as usize)
                    .ok_or(NV_ERR_INVALID_ARGUMENT)?;
                p.tpcMask = mask(*tpcs);
            }
            sys::NV2080_CTRL_CMD_FB_GET_INFO_V2 => {
                let p = unsafe { params::<sys::NV2080_CTRL_FB_GET_INFO_V2_PARAMS>(ptr, size)? };
                let n = (p.fbInfoListSize as usize).min(p.fbInfoList.len());
                for e in &mut p.fbInfoList[..n] {
                    e.data = match e.index {
                        sys::NV2080_CTRL_FB_INFO_INDEX_TOTAL_RAM_SIZE => (c.memory_bytes >> 10)
                            .try_into()
                            .map_err(|_| NV_ERR_INVALID_ARGUMENT)?,
                        _ => return Err(NV_ERR_NOT_SUPPORTED),
                    };
                }
            }
            sys::NVC36F_CTRL_CMD_GPFIFO_GET_WORK_SUBMIT_TOKEN => {
                let ch = st
                    .channels
                    .get(&object)
                    .ok_or(NV_ERR_INVALID_OBJECT_HANDLE)?;
                let p = unsafe {
                    params::<sys::NVC36F_CTRL_CMD_GPFIFO_GET_WORK_SUBMIT_TOKEN_PARAMS>(ptr, size)?
                };
                p.workSubmitToken = ch.token;
            }
            sys::NVA06F_CTRL_CMD_GPFIFO_SCHEDULE => {
                // A channel scheduled by itself: one that joined a group already scheduled.
                if !is_gpfifo_class(obj.class) {
                    return Err(NV_ERR_INVALID_OBJECT_HANDLE);
                }
                let p = unsafe { params::<sys::NVA06F_CTRL_GPFIFO_SCHEDULE_PARAMS>(ptr, size)? };
                let group = *st
                    .objects
                    .get(&obj.parent)
                    .ok_or(NV_ERR_INVALID_OBJECT_HANDLE)?;
                if p.bEnable != 0 && group.class == sys::KEPLER_CHANNEL_GROUP_A {
                    self.check_schedulable(&st, obj.parent, group)?;
                }
            }
            sys::NVA06C_CTRL_CMD_GPFIFO_SCHEDULE => {
                if obj.class != sys::KEPLER_CHANNEL_GROUP_A {
                    return Err(NV_ERR_INVALID_OBJECT_HANDLE);
                }
                let p = unsafe { params::<sys::NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS>(ptr, size)? };
                if p.bEnable != 0 {
                    self.check_schedulable(&st, object, obj)?;
                }
            }
            sys::NV2080_CTRL_CMD_GR_SET_CTXSW_PREEMPTION_MODE => {
                if obj.class != sys::NV20_SUBDEVICE_0 {
                    return Err(NV_ERR_INVALID_OBJECT_HANDLE);
                }
                let p = unsafe {
                    params::<sys::NV2080_CTRL_GR_SET_CTXSW_PREEMPTION_MODE_PARAMS>(ptr, size)?
                };
                // RM sets the modes of a graphics-engine group, each within its range.
                let target = st
                    .objects
                    .get(&p.hChannel)
                    .ok_or(NV_ERR_INVALID_OBJECT_HANDLE)?;
                if target.class != sys::KEPLER_CHANNEL_GROUP_A
                    || target.engine != Some(sys::NV2080_ENGINE_TYPE_GRAPHICS)
                {
                    return Err(NV_ERR_INVALID_CHANNEL);
                }
                let cilp = p.flags & 1 != 0;
                let gfxp = p.flags & 2 != 0;
                if (cilp
                    && p.cilpPreemptMode > sys::NV2080_CTRL_SET_CTXSW_PREEMPTION_MODE_COMPUTE_CILP)
                    || (gfxp
                        && p.gfxpPreemptMode
                            > sys::NV2080_CTRL_SET_CTXSW_PREEMPTION_MODE_GFX_GFXP_POOL)
                {
                    return Err(NV_ERR_INVALID_ARGUMENT);
                }
                if cilp {
                    st.compute_preemption.insert(p.hChannel, p.cilpPreemptMode);
                }
            }
            sys::NV2080_CTRL_CMD_PERF_BOOST => {
                if obj.class != sys::NV20_SUBDEVICE_0 {
                    return Err(NV_ERR_INVALID_OBJECT_HANDLE);
                }
                let p = unsafe { params::<sys::NV2080_CTRL_PERF_BOOST_PARAMS>(ptr, size)? };
                // RM's checks: a command it knows (bits 1:0), a duration up to an hour or "until cleared".
                let known_cmd = p.flags & 0x3 <= sys::NV2080_CTRL_PERF_BOOST_FLAGS_CMD_BOOST_TO_MAX;
                let duration_ok = p.duration <= sys::NV2080_CTRL_PERF_BOOST_DURATION_MAX
                    || p.duration == sys::NV2080_CTRL_PERF_BOOST_DURATION_INFINITE;
                if !known_cmd || !duration_ok {
                    return Err(NV_ERR_INVALID_ARGUMENT);
                }
                st.perf_boost = Some((p.flags, p.duration));
            }
            sys::NV0000_CTRL_CMD_SYSTEM_GET_P2P_CAPS_V2 => {
                if obj.class != sys::NV01_ROOT_CLIENT {
                    return Err(NV_ERR_INVALID_OBJECT_HANDLE);
                }
                let p =
                    unsafe { params::<sys::NV0000_CTRL_SYSTEM_GET_P2P_CAPS_V2_PARAMS>(ptr, size)? };
                self.answer_p2p_caps(p)?;
            }
            _ => return Err(NV_ERR_NOT_SUPPORTED),
        }
        Ok(())
    }

    /// What RM checks before it schedules channel group `group`: a copy-engine group runs on a copy engine's own
    /// runlist (not one it shares with the graphics engine), and every copy object of its channels is bound to
    /// the group's engine (otherwise RM finds the channels on two runlists: `NV_ERR_INVALID_STATE`).
    fn check_schedulable(
        &self,
        st: &State,
        group: Handle,
        obj: Obj,
    ) -> std::result::Result<(), NvStatus> {
        let Some(engine) = obj.engine else {
            return Err(NV_ERR_INVALID_STATE);
        };
        let Some(lce) = lce_of_engine_type(engine) else {
            return Ok(());
        };
        if lce >= 32 || self.config.graphics_copy_engines & (1 << lce) != 0 {
            return Err(NV_ERR_INVALID_STATE);
        }
        let channels: Vec<Handle> = st
            .objects
            .iter()
            .filter(|(_, o)| o.parent == group && is_gpfifo_class(o.class))
            .map(|(&h, _)| h)
            .collect();
        let mismatch = st.objects.values().any(|o| {
            channels.contains(&o.parent) && is_copy_class(o.class) && o.engine != Some(engine)
        });
        if mismatch {
            return Err(NV_ERR_INVALID_STATE);
        }
        Ok(())
    }

    /// NV0000_CTRL_CMD_SYSTEM_GET_P2P_CAPS_V2 for two simulated GPUs: NVLink peers with reads, writes and
    /// atomics, and this GPU's optimal copy engines; any other pair has no peer path.
    fn answer_p2p_caps(
        &self,
        p: &mut sys::NV0000_CTRL_SYSTEM_GET_P2P_CAPS_V2_PARAMS,
    ) -> std::result::Result<(), NvStatus> {
        if p.gpuCount != 2 {
            return Err(NV_ERR_INVALID_ARGUMENT);
        }
        let (a, b) = (p.gpuIds[0], p.gpuIds[1]);
        if a != sim_gpu_id(self.id) {
            return Err(NV_ERR_INVALID_ARGUMENT);
        }
        if is_sim_gpu_id(b) && self.config.peer {
            p.p2pCaps = [
                sys::NV0000_CTRL_SYSTEM_GET_P2P_CAPS_NVLINK_SUPPORTED,
                sys::NV0000_CTRL_SYSTEM_GET_P2P_CAPS_READS_SUPPORTED,
                sys::NV0000_CTRL_SYSTEM_GET_P2P_CAPS_WRITES_SUPPORTED,
                sys::NV0000_CTRL_SYSTEM_GET_P2P_CAPS_ATOMICS_SUPPORTED,
            ]
            .iter()
            .fold(0, |caps, bit| caps | (1 << bit));
            p.p2pCapsStatus.fill(0);
            p.p2pOptimalReadCEs = self.config.peer_read_ces;
            p.p2pOptimalWriteCEs = self.config.peer_write_ces;
        } else {
            p.p2pCaps = 0;
            // NV0000_P2P_CAPS_STATUS_NOT_SUPPORTED
            p.p2pCapsStatus.fill(5);
            p.p2pOptimalReadCEs = 0;
            p.p2pOptimalWriteCEs = 0;
        }
        Ok(())
    }
}

fn mask(bits: u32) -> u32 {
    if bits >= 32 {
        u32::MAX
    } else {
        (1 << bits) - 1
    }
}
