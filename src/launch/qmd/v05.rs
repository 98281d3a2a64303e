//! The V05 QMD layout (Blackwell, sm_100 and sm_120: compute classes cdc0 and cec0): its builder only, following
//! the V04 recipe where the fields have the same names (unverified on Blackwell). None of the V04 editors; a
//! launch in it is rebuilt rather than patched.

use super::{Common, QmdError, QmdLayout, QmdParams, Writer, sync_domain};
use crate::hw::qmd::v05;

/// The V05 layout (Blackwell).
pub(super) struct V05;

/// Its `build`; every editor is the trait's default, "not supported".
impl QmdLayout for V05 {
    #[inline]
    fn build(p: &QmdParams, c: &Common, w: &mut Writer<'_>) -> Result<(), QmdError> {
        let Common {
            sass,
            grid,
            min_cfg,
            target_cfg,
            max_cfg,
        } = *c;
        set!(w, v05::QMD_GROUP_ID, 0x3f);
        set!(w, v05::QMD_TYPE, v05::QMD_TYPE_GRID_CTA);
        if let Some(c) = p.cluster {
            // The V04 recipe: the fields have the same names and meaning in V05 (unverified on Blackwell).
            set!(w, v05::QMD_TYPE, v05::QMD_TYPE_GRID_GPC_CGA);
            set!(w, v05::GPC_CGA_WIDTH, c[0]);
            set!(w, v05::GPC_CGA_HEIGHT, c[1]);
            set!(w, v05::GPC_CGA_DEPTH, c[2]);
            set!(
                w,
                v05::CGA_CTA_DISTRIBUTION_MODE,
                if p.cluster_load_balancing {
                    v05::CGA_CTA_DISTRIBUTION_MODE_LOAD_BALANCING
                } else {
                    v05::CGA_CTA_DISTRIBUTION_MODE_MULTI_CAST
                }
            );
        }
        // libcuda writes the domain after its map (apex-trace of probes/launch_attrs.cu, H100, driver 580:
        // NCCL's "remote" domain is SYNC_DOMAIN_ID 1, the default domain leaves the field 0).
        set!(w, v05::SYNC_DOMAIN_ID, sync_domain(p)?);
        set!(w, v05::QMD_MAJOR_VERSION, 5);
        set!(w, v05::QMD_MINOR_VERSION, 0);
        set!(w, v05::SASS_VERSION, sass);
        set!(
            w,
            v05::API_VISIBLE_CALL_LIMIT,
            v05::API_VISIBLE_CALL_LIMIT_NO_CHECK
        );
        set!(w, v05::SAMPLER_INDEX, v05::SAMPLER_INDEX_VIA_HEADER_INDEX);
        set!(w, v05::INVALIDATE_TEXTURE_HEADER_CACHE, 1);
        set!(w, v05::INVALIDATE_TEXTURE_SAMPLER_CACHE, 1);
        set!(w, v05::INVALIDATE_TEXTURE_DATA_CACHE, 1);
        set!(w, v05::INVALIDATE_SHADER_DATA_CACHE, 1);
        set!(w, v05::INVALIDATE_SHADER_CONSTANT_CACHE, 1);
        set!(w, v05::CWD_MEMBAR_TYPE, v05::CWD_MEMBAR_TYPE_L1_SYSMEMBAR);
        set!(
            w,
            v05::SHARED_MEMORY_SIZE_SHIFTED7,
            p.shared_bytes.div_ceil(128)
        );
        set!(w, v05::MIN_SM_CONFIG_SHARED_MEM_SIZE, min_cfg);
        set!(w, v05::TARGET_SM_CONFIG_SHARED_MEM_SIZE, target_cfg);
        set!(w, v05::MAX_SM_CONFIG_SHARED_MEM_SIZE, max_cfg);
        set!(
            w,
            v05::SHADER_LOCAL_MEMORY_HIGH_SIZE_SHIFTED4,
            p.local_bytes_per_thread.div_ceil(16)
        );
        set!(w, v05::GRID_WIDTH, grid[0]);
        set!(w, v05::GRID_HEIGHT, grid[1]);
        set!(w, v05::GRID_DEPTH, grid[2]);
        set!(w, v05::CTA_THREAD_DIMENSION0, p.block[0]);
        set!(w, v05::CTA_THREAD_DIMENSION1, p.block[1]);
        set!(w, v05::CTA_THREAD_DIMENSION2, p.block[2]);
        set!(w, v05::REGISTER_COUNT, p.registers);
        set!(w, v05::BARRIER_COUNT, p.barriers);
        set!(
            w,
            v05::PROGRAM_ADDRESS_LOWER_SHIFTED4,
            (p.program_va >> 4) & 0xffff_ffff
        );
        set!(w, v05::PROGRAM_ADDRESS_UPPER_SHIFTED4, p.program_va >> 36);
        for (i, cb) in p.const_buffers.iter().enumerate() {
            if let Some(cb) = cb {
                set!(w, v05::CONSTANT_BUFFER_VALID(i), 1);
                set!(
                    w,
                    v05::CONSTANT_BUFFER_ADDR_LOWER_SHIFTED6(i),
                    (cb.va >> 6) & 0xffff_ffff
                );
                set!(w, v05::CONSTANT_BUFFER_ADDR_UPPER_SHIFTED6(i), cb.va >> 38);
                set!(
                    w,
                    v05::CONSTANT_BUFFER_SIZE_SHIFTED4(i),
                    cb.size.div_ceil(16)
                );
            }
        }
        if let Some((va, payload)) = p.release {
            set!(w, v05::RELEASE_ENABLE(0), 1);
            set!(
                w,
                v05::RELEASE_STRUCTURE_SIZE(0),
                v05::RELEASE_STRUCTURE_SIZE_SEMAPHORE_FOUR_WORDS
            );
            set!(w, v05::RELEASE_PAYLOAD64B(0), 1);
            set!(w, v05::RELEASE_SEMAPHORE0_ADDR_LOWER, va & 0xffff_ffff);
            set!(w, v05::RELEASE_SEMAPHORE0_ADDR_UPPER, va >> 32);
            set!(
                w,
                v05::RELEASE_SEMAPHORE0_PAYLOAD_LOWER,
                payload & 0xffff_ffff
            );
            set!(w, v05::RELEASE_SEMAPHORE0_PAYLOAD_UPPER, payload >> 32);
        }
        Ok(())
    }
}
