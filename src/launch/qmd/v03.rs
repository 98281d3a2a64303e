//! The V03 QMD layout (Ampere and Ada, sm_80 to sm_89: compute classes c6c0, c7c0 and c9c0): its builder only.
//! It has no memory sync domains and no clusters, and none of the V04 editors; a launch in it is rebuilt rather
//! than patched.

use super::{Common, QmdError, QmdLayout, QmdParams, Writer};
use crate::hw::qmd::v03;

/// The V03 layout (Ampere and Ada).
pub(super) struct V03;

/// Its `build`; every editor is the trait's default, "not supported".
impl QmdLayout for V03 {
    #[inline]
    fn build(p: &QmdParams, c: &Common, w: &mut Writer<'_>) -> Result<(), QmdError> {
        let Common {
            sass,
            // V03 counts the grid in blocks (it has no clusters): `p.grid`.
            grid: _,
            min_cfg,
            target_cfg,
            max_cfg,
        } = *c;
        if p.sync_domain != 0 {
            return Err(QmdError {
                field: "SYNC_DOMAIN_ID (V03 QMDs, for GPUs before sm_90, have no memory sync domains)",
                value: u64::from(p.sync_domain),
            });
        }
        if let Some(c) = p.cluster {
            // Ampere and Ada have no thread block clusters.
            return Err(QmdError {
                field: "cluster (V03 QMDs, for GPUs before sm_90, have none)",
                value: u64::from(c[0]) * u64::from(c[1]) * u64::from(c[2]),
            });
        }
        set!(w, v03::QMD_GROUP_ID, 0x3f);
        set!(w, v03::QMD_MAJOR_VERSION, 3);
        set!(w, v03::SASS_VERSION, sass);
        set!(w, v03::SM_GLOBAL_CACHING_ENABLE, 1);
        set!(
            w,
            v03::API_VISIBLE_CALL_LIMIT,
            v03::API_VISIBLE_CALL_LIMIT_NO_CHECK
        );
        set!(w, v03::SAMPLER_INDEX, v03::SAMPLER_INDEX_VIA_HEADER_INDEX);
        set!(w, v03::INVALIDATE_TEXTURE_HEADER_CACHE, 1);
        set!(w, v03::INVALIDATE_TEXTURE_SAMPLER_CACHE, 1);
        set!(w, v03::INVALIDATE_TEXTURE_DATA_CACHE, 1);
        set!(w, v03::INVALIDATE_SHADER_DATA_CACHE, 1);
        set!(w, v03::INVALIDATE_SHADER_CONSTANT_CACHE, 1);
        set!(w, v03::CWD_MEMBAR_TYPE, v03::CWD_MEMBAR_TYPE_L1_SYSMEMBAR);
        set!(w, v03::SHARED_MEMORY_SIZE, p.shared_bytes);
        set!(w, v03::MIN_SM_CONFIG_SHARED_MEM_SIZE, min_cfg);
        set!(w, v03::TARGET_SM_CONFIG_SHARED_MEM_SIZE, target_cfg);
        set!(w, v03::MAX_SM_CONFIG_SHARED_MEM_SIZE, max_cfg);
        set!(
            w,
            v03::SHADER_LOCAL_MEMORY_HIGH_SIZE,
            p.local_bytes_per_thread
        );
        set!(w, v03::CTA_RASTER_WIDTH, p.grid[0]);
        set!(w, v03::CTA_RASTER_HEIGHT, p.grid[1]);
        set!(w, v03::CTA_RASTER_DEPTH, p.grid[2]);
        set!(w, v03::CTA_THREAD_DIMENSION0, p.block[0]);
        set!(w, v03::CTA_THREAD_DIMENSION1, p.block[1]);
        set!(w, v03::CTA_THREAD_DIMENSION2, p.block[2]);
        set!(w, v03::REGISTER_COUNT_V, p.registers);
        set!(w, v03::BARRIER_COUNT, p.barriers);
        set!(w, v03::PROGRAM_ADDRESS_LOWER, p.program_va & 0xffff_ffff);
        set!(w, v03::PROGRAM_ADDRESS_UPPER, p.program_va >> 32);
        for (i, cb) in p.const_buffers.iter().enumerate() {
            if let Some(cb) = cb {
                set!(w, v03::CONSTANT_BUFFER_VALID(i), 1);
                set!(w, v03::CONSTANT_BUFFER_ADDR_LOWER(i), cb.va & 0xffff_ffff);
                set!(w, v03::CONSTANT_BUFFER_ADDR_UPPER(i), cb.va >> 32);
                set!(
                    w,
                    v03::CONSTANT_BUFFER_SIZE_SHIFTED4(i),
                    cb.size.div_ceil(16)
                );
            }
        }
        if let Some((va, payload)) = p.release {
            set!(w, v03::RELEASE0_ENABLE, 1);
            set!(
                w,
                v03::RELEASE0_STRUCTURE_SIZE,
                v03::RELEASE0_STRUCTURE_SIZE_SEMAPHORE_FOUR_WORDS
            );
            set!(w, v03::RELEASE0_PAYLOAD64B, 1);
            set!(w, v03::RELEASE0_ADDRESS_LOWER, va & 0xffff_ffff);
            set!(w, v03::RELEASE0_ADDRESS_UPPER, va >> 32);
            set!(w, v03::RELEASE0_PAYLOAD_LOWER, payload & 0xffff_ffff);
            set!(w, v03::RELEASE0_PAYLOAD_UPPER, payload >> 32);
        }
        Ok(())
    }
}
