//! GPU-visible memory: RM allocations in video or system memory, mapped for the GPU in our VA space through
//! UVM external ranges and, when asked, for the CPU at the same address.

use std::ptr::NonNull;
use std::sync::Arc;

use tracing::{debug, warn};

use super::client::Object;
use super::gpu::GpuCore;
use super::sys::defs;
use super::transport::CpuMapRequest;
use super::va::VaRegion;
use super::{Error, Result, sys};

/// Where the memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Video memory (HBM on the H200). CPU mappings go through BAR1, write-combined.
    Video,
    /// System memory, pinned by RM, GPU access over PCIe, CPU-cached and not cached by the GPU (host buffers,
    /// staging, anything the CPU writes).
    SystemCached,
    /// System memory for semaphores the GPU releases and acquires and the CPU polls: CPU-cached and
    /// GPU-cacheable, as libcuda allocates its semaphore page, so the front end's acquire polls hit the GPU's L2.
    /// Not for data the CPU writes while the GPU may hold it in its cache.
    Semaphores,
    /// System memory mapped write-combined for the CPU (for data the CPU only writes, like pushbuffers).
    SystemWriteCombined,
}

/// How a buffer is to be allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryDesc {
    /// Bytes asked for (rounded up to the page size at allocation).
    pub size: u64,
    /// Where the memory lives.
    pub placement: Placement,
    /// Map for the CPU at the buffer's GPU address.
    pub cpu_mapped: bool,
    /// Allocate the GPU address below 1 TiB (what the front end addresses with 40 bits).
    pub low: bool,
    /// Ask RM for physically contiguous video memory (off by default: RM may scatter the pages).
    pub contiguous: bool,
}

impl MemoryDesc {
    /// `size` bytes of video memory, not CPU-mapped, anywhere in the high region.
    pub fn video(size: u64) -> MemoryDesc {
        MemoryDesc {
            size,
            placement: Placement::Video,
            cpu_mapped: false,
            low: false,
            contiguous: false,
        }
    }
    /// Also maps the memory for the CPU, at its GPU address.
    pub fn with_cpu(mut self) -> MemoryDesc {
        self.cpu_mapped = true;
        self
    }
    /// Places the memory below 1 TiB, where the front end's 40-bit addresses reach (rings, pushbuffers, QMDs).
    pub fn low(mut self) -> MemoryDesc {
        self.low = true;
        self
    }
    /// Puts the memory in `p` instead of video memory.
    pub fn placement(mut self, p: Placement) -> MemoryDesc {
        self.placement = p;
        self
    }
}

/// A GPU-visible buffer: an RM allocation, its GPU virtual address (equal to its CPU address when CPU-mapped),
/// freed on drop (GPU mapping, CPU mapping, RM memory, address range).
#[derive(Debug)]
pub struct Memory {
    core: Arc<GpuCore>,
    object: Option<Object>,
    va: u64,
    size: u64,
    desc: MemoryDesc,
    cpu: Option<NonNull<u8>>,
    /// Backed by the transport itself (an in-process GPU: see [`InProcessGpu`](super::transport::InProcessGpu)).
    in_process: bool,
    /// Other GPUs this memory is mapped on ([`Memory::map_on`]), by RM GPU id.
    peers: std::sync::Mutex<Vec<(u32, std::sync::Weak<GpuCore>)>>,
}

// SAFETY: the CPU pointer is only dereferenced through bounds-checked methods copying plain bytes; the RM
// handles are plain integers used through thread-safe ioctls.
unsafe impl Send for Memory {}
// SAFETY: as above; concurrent access to the bytes is like concurrent DMA, which the caller orders.
unsafe impl Sync for Memory {}

const HUGE_PAGE: u64 = 2 << 20;

impl Memory {
    /// Allocates memory as `desc` asks, maps it for the GPU at a VA of its own (and for the CPU at the same
    /// address when asked). Video buffers of 8 MiB or more use 2 MiB pages. Freed on drop.
    pub fn alloc(core: &Arc<GpuCore>, desc: MemoryDesc) -> Result<Memory> {
        if desc.size == 0 {
            return Err(Error::InvalidArgument("a buffer of 0 bytes".into()));
        }
        // 2 MiB pages for large video buffers (fewer TLB misses), 4 KiB otherwise.
        let page = if desc.placement == Placement::Video && desc.size >= 8 << 20 {
            HUGE_PAGE
        } else {
            0x1000
        };
        let size = desc
            .size
            .checked_next_multiple_of(page)
            .ok_or(Error::OutOfVa {
                size: desc.size,
                align: page,
            })?;
        let mut p = alloc_params(&desc, size, page, core.client.handle());
        let class = match desc.placement {
            Placement::Video => sys::NV01_MEMORY_LOCAL_USER,
            _ => sys::NV01_MEMORY_SYSTEM,
        };
        let what = if class == sys::NV01_MEMORY_SYSTEM {
            "NV01_MEMORY_SYSTEM"
        } else {
            "NV01_MEMORY_LOCAL_USER"
        };
        let object = Object::alloc(&core.client, Some(&core.device), class, Some(&mut p), what)?;
        let region = if desc.low { &core.low } else { &core.high };
        // Align to 2 MiB where we can, so the GPU can use big pages for the mapping.
        let align = if size >= HUGE_PAGE { HUGE_PAGE } else { page };
        let va = region.alloc(size, align)?;
        let mut mem = Memory {
            core: core.clone(),
            object: Some(object),
            va,
            size,
            desc,
            cpu: None,
            in_process: false,
            peers: std::sync::Mutex::new(Vec::new()),
        };

        if let Some(gpu) = core.client.in_process_gpu() {
            // An in-process GPU backs the buffer at its VA itself (what UVM's GPU mapping is on hardware); the CPU
            // sees it there only if asked to.
            gpu.back(mem.handle(), va, size)?;
            mem.in_process = true;
            if desc.cpu_mapped {
                mem.cpu = NonNull::new(va as *mut u8);
            }
            return Ok(mem);
        }

        if desc.cpu_mapped {
            let caching = match desc.placement {
                Placement::SystemCached | Placement::Semaphores => {
                    sys::NVOS33_FLAGS_CACHING_TYPE_CACHED
                }
                _ => sys::NVOS33_FLAGS_CACHING_TYPE_WRITECOMBINED,
            };
            let flags = defs::NVOS33_FLAGS_CACHING_TYPE.val(caching);
            let map = core.client.map_cpu(&CpuMapRequest {
                device: core.device.handle(),
                object: mem.handle(),
                system: class == sys::NV01_MEMORY_SYSTEM,
                minor: core.info.minor,
                len: size as usize,
                flags,
                fixed: Some(va),
            })?;
            mem.cpu = Some(map.into_raw().0);
        }

        let mut cr = sys::UVM_CREATE_EXTERNAL_RANGE_PARAMS {
            base: va,
            length: size,
            rmStatus: 0,
        };
        core.client.uvm_call(
            sys::UVM_CREATE_EXTERNAL_RANGE,
            &mut cr,
            "UVM_CREATE_EXTERNAL_RANGE",
            |p| p.rmStatus,
        )?;
        let mut mp = Box::new(sys::UVM_MAP_EXTERNAL_ALLOCATION_PARAMS {
            base: va,
            length: size,
            gpuAttributesCount: 1,
            rmCtrlFd: core.client.ctl_raw_fd(),
            hClient: core.client.handle(),
            hMemory: mem
                .object
                .as_ref()
                .expect("object is set until drop")
                .handle(),
            ..Default::default()
        });
        mp.perGpuAttributes[0].gpuUuid = core.uuid();
        mp.perGpuAttributes[0].gpuMappingType = UVM_MAPPING_READ_WRITE_ATOMIC;
        if let Err(e) = core.client.uvm_call(
            sys::UVM_MAP_EXTERNAL_ALLOCATION,
            &mut *mp,
            "UVM_MAP_EXTERNAL_ALLOCATION",
            |p| p.rmStatus,
        ) {
            mem.free_range();
            return Err(e);
        }
        debug!(va = format_args!("{va:#x}"), size = format_args!("{size:#x}"), ?desc.placement, cpu = desc.cpu_mapped, "allocated");
        Ok(mem)
    }

    /// Maps this memory into `gpu`'s address space at the same address, so that `gpu`'s kernels and copy
    /// engines reach it (video memory over the peer link, system memory over the GPU's own bus). Both GPUs
    /// must be in one peer domain (see [`GpuCore::enable_peer`]); mapping twice is a no-op; the mapping lasts
    /// as long as the memory.
    pub fn map_on(&self, gpu: &Arc<GpuCore>) -> Result<()> {
        if Arc::ptr_eq(&self.core, gpu) {
            return Ok(());
        }
        gpu.check_same_domain(&self.core)?;
        let mut peers = self.peers.lock().unwrap_or_else(|p| p.into_inner());
        if peers.iter().any(|(id, _)| *id == gpu.gpu_id) {
            return Ok(());
        }
        if self.desc.placement == Placement::Video {
            gpu.enable_peer(&self.core)?;
        }
        if let Some(peer) = gpu.client.in_process_gpu() {
            // An in-process peer reaches the range through its own registry.
            peer.reach(self.va, self.size);
        } else {
            let mut mp = Box::new(sys::UVM_MAP_EXTERNAL_ALLOCATION_PARAMS {
                base: self.va,
                length: self.size,
                gpuAttributesCount: 1,
                rmCtrlFd: self.core.client.ctl_raw_fd(),
                hClient: self.core.client.handle(),
                hMemory: self.handle(),
                ..Default::default()
            });
            mp.perGpuAttributes[0].gpuUuid = gpu.uuid();
            mp.perGpuAttributes[0].gpuMappingType = UVM_MAPPING_DEFAULT;
            if self.desc.placement != Placement::Video {
                // The peer polls semaphores here that the owner's front end releases: read memory, not a line the
                // peer's L2 kept.
                mp.perGpuAttributes[0].gpuCachingType = UVM_CACHING_FORCE_UNCACHED;
            }
            self.core.client.uvm_call(
                sys::UVM_MAP_EXTERNAL_ALLOCATION,
                &mut *mp,
                "UVM_MAP_EXTERNAL_ALLOCATION (peer)",
                |p| p.rmStatus,
            )?;
        }
        debug!(va = format_args!("{:#x}", self.va), size = format_args!("{:#x}", self.size),
            owner = %self.core.info.uuid, peer = %gpu.info.uuid, "mapped on a peer GPU");
        peers.push((gpu.gpu_id, Arc::downgrade(gpu)));
        Ok(())
    }

    /// Whether `gpu` can address this memory: it is the owner's, or the memory is mapped on it.
    pub fn is_mapped_on(&self, gpu: &GpuCore) -> bool {
        std::ptr::eq(&*self.core, gpu)
            || (gpu.domain != 0
                && gpu.domain == self.core.domain
                && self
                    .peers
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .iter()
                    .any(|(id, _)| *id == gpu.gpu_id))
    }

    /// GPU virtual address (and CPU address, when CPU-mapped).
    pub fn va(&self) -> u64 {
        self.va
    }

    /// Size in bytes (rounded up to the page size).
    pub fn size(&self) -> u64 {
        self.size
    }

    /// How the memory was asked for.
    pub fn desc(&self) -> &MemoryDesc {
        &self.desc
    }

    /// The RM memory object's handle (0 once freed).
    pub fn handle(&self) -> u32 {
        self.object.as_ref().map_or(0, Object::handle)
    }

    /// The GPU that owns the memory.
    pub fn gpu(&self) -> &Arc<GpuCore> {
        &self.core
    }

    /// The CPU address, when the buffer is CPU-mapped.
    pub fn cpu_ptr(&self) -> Option<NonNull<u8>> {
        self.cpu
    }

    fn check(&self, offset: u64, len: u64) -> Result<NonNull<u8>> {
        let cpu = self.cpu.ok_or(Error::NotCpuMapped { size: self.size })?;
        if offset.checked_add(len).is_none_or(|end| end > self.size) {
            return Err(Error::OutOfBounds {
                offset,
                len,
                size: self.size,
            });
        }
        Ok(cpu)
    }

    /// Copies `data` into the buffer at `offset` through the CPU mapping.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        let cpu = self.check(offset, data.len() as u64)?;
        // SAFETY: bounds checked above; the mapping is live for `self`'s lifetime and `data` cannot
        // overlap it (it is a Rust slice, the mapping is device memory handed out only as raw pointers).
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                cpu.as_ptr().add(offset as usize),
                data.len(),
            )
        };
        Ok(())
    }

    /// Copies 32-bit words into the buffer at `offset` (4-byte aligned) through the CPU mapping.
    pub fn write_words(&self, offset: u64, words: &[u32]) -> Result<()> {
        let cpu = self.check(offset, words.len() as u64 * 4)?;
        if !offset.is_multiple_of(4) {
            return Err(Error::InvalidArgument(format!(
                "unaligned word write at {offset:#x}"
            )));
        }
        // SAFETY: bounds and alignment checked above; as in `write`, no overlap with `words`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                words.as_ptr(),
                cpu.as_ptr().add(offset as usize).cast::<u32>(),
                words.len(),
            )
        };
        Ok(())
    }

    /// Copies bytes out of the buffer at `offset` through the CPU mapping.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let cpu = self.check(offset, out.len() as u64)?;
        // SAFETY: as in `write`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                cpu.as_ptr().add(offset as usize),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    /// Fills `[offset, offset + len)` with `byte`.
    pub fn fill(&self, offset: u64, len: u64, byte: u8) -> Result<()> {
        let cpu = self.check(offset, len)?;
        // SAFETY: bounds checked above.
        unsafe { std::ptr::write_bytes(cpu.as_ptr().add(offset as usize), byte, len as usize) };
        Ok(())
    }

    /// A volatile 64-bit load (for semaphores the GPU writes).
    pub fn read_u64_volatile(&self, offset: u64) -> Result<u64> {
        let cpu = self.check(offset, 8)?;
        if !offset.is_multiple_of(8) {
            return Err(Error::InvalidArgument(format!(
                "unaligned 64-bit read at {offset:#x}"
            )));
        }
        // SAFETY: in bounds and 8-byte aligned (the mapping is page-aligned).
        Ok(unsafe {
            cpu.as_ptr()
                .add(offset as usize)
                .cast::<u64>()
                .read_volatile()
        })
    }

    /// A volatile 32-bit load.
    pub fn read_u32_volatile(&self, offset: u64) -> Result<u32> {
        let cpu = self.check(offset, 4)?;
        if !offset.is_multiple_of(4) {
            return Err(Error::InvalidArgument(format!(
                "unaligned 32-bit read at {offset:#x}"
            )));
        }
        // SAFETY: in bounds and 4-byte aligned.
        Ok(unsafe {
            cpu.as_ptr()
                .add(offset as usize)
                .cast::<u32>()
                .read_volatile()
        })
    }

    /// A volatile 64-bit store.
    pub fn write_u64_volatile(&self, offset: u64, value: u64) -> Result<()> {
        let cpu = self.check(offset, 8)?;
        if !offset.is_multiple_of(8) {
            return Err(Error::InvalidArgument(format!(
                "unaligned 64-bit write at {offset:#x}"
            )));
        }
        // SAFETY: in bounds and 8-byte aligned.
        unsafe {
            cpu.as_ptr()
                .add(offset as usize)
                .cast::<u64>()
                .write_volatile(value)
        };
        Ok(())
    }

    fn free_range(&mut self) {
        let peers = std::mem::take(self.peers.get_mut().unwrap_or_else(|p| p.into_inner()));
        for (_, peer) in peers {
            if let Some(g) = peer.upgrade()
                && let Some(peer) = g.client.in_process_gpu()
            {
                peer.forget(self.va);
            }
        }
        if let Some(gpu) = self.core.client.in_process_gpu() {
            // Forgotten first: once this returns the in-process GPU can no longer touch the range.
            gpu.forget(self.va);
        }
        if self.cpu.take().is_some() || std::mem::take(&mut self.in_process) {
            let region = if self.desc.low {
                &self.core.low
            } else {
                &self.core.high
            };
            if let Err(e) = region.unmap(self.va, self.size) {
                warn!(error = %e, "re-reserving a freed buffer's range failed");
            }
        }
        self.object = None;
        let region: &VaRegion = if self.desc.low {
            &self.core.low
        } else {
            &self.core.high
        };
        region.free(self.va, self.size);
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        let mut p = sys::UVM_FREE_PARAMS {
            base: self.va,
            length: self.size,
            rmStatus: 0,
        };
        if let Err(e) = self
            .core
            .client
            .uvm_call(sys::UVM_FREE, &mut p, "UVM_FREE", |p| p.rmStatus)
        {
            warn!(error = %e, va = format_args!("{:#x}", self.va), "UVM_FREE failed");
        }
        self.free_range();
    }
}

/// UvmGpuMappingTypeReadWriteAtomic (nv_uvm_user_types.h).
const UVM_MAPPING_READ_WRITE_ATOMIC: u32 = 1;
/// UvmGpuMappingTypeDefault: read-write, atomic where the link allows.
const UVM_MAPPING_DEFAULT: u32 = 0;
/// UvmGpuCachingTypeForceUncached.
const UVM_CACHING_FORCE_UNCACHED: u32 = 1;

fn alloc_params(
    desc: &MemoryDesc,
    size: u64,
    page: u64,
    owner: u32,
) -> sys::NV_MEMORY_ALLOCATION_PARAMS {
    use defs::*;
    let physicality = if desc.contiguous {
        sys::NVOS32_ATTR_PHYSICALITY_CONTIGUOUS
    } else {
        sys::NVOS32_ATTR_PHYSICALITY_ALLOW_NONCONTIGUOUS
    };
    let (attr, attr2, kind, flags) = match desc.placement {
        Placement::Video => {
            let huge = page == HUGE_PAGE;
            (
                NVOS32_ATTR_PHYSICALITY.val(physicality)
                    | if huge {
                        NVOS32_ATTR_PAGE_SIZE.val(sys::NVOS32_ATTR_PAGE_SIZE_HUGE)
                    } else {
                        0
                    },
                NVOS32_ATTR2_ZBC.val(sys::NVOS32_ATTR2_ZBC_PREFER_NO_ZBC)
                    | NVOS32_ATTR2_GPU_CACHEABLE.val(sys::NVOS32_ATTR2_GPU_CACHEABLE_YES)
                    | if huge {
                        NVOS32_ATTR2_PAGE_SIZE_HUGE.val(sys::NVOS32_ATTR2_PAGE_SIZE_HUGE_2MB)
                    } else {
                        0
                    },
                sys::NVOS32_TYPE_IMAGE,
                sys::NVOS32_ALLOC_FLAGS_PERSISTENT_VIDMEM,
            )
        }
        Placement::SystemCached | Placement::Semaphores | Placement::SystemWriteCombined => {
            // The GPU must not keep system memory in its L2: the CPU writes it behind the GPU's back (staging
            // buffers, semaphores), and a cached copy would be read stale (seen on the H200 with a reused
            // staging buffer).
            let (coherency, gpu_cacheable) = if desc.placement == Placement::SystemCached {
                (
                    sys::NVOS32_ATTR_COHERENCY_CACHED,
                    sys::NVOS32_ATTR2_GPU_CACHEABLE_NO,
                )
            } else if desc.placement == Placement::Semaphores {
                (
                    sys::NVOS32_ATTR_COHERENCY_CACHED,
                    sys::NVOS32_ATTR2_GPU_CACHEABLE_YES,
                )
            } else {
                (
                    sys::NVOS32_ATTR_COHERENCY_WRITE_COMBINE,
                    sys::NVOS32_ATTR2_GPU_CACHEABLE_NO,
                )
            };
            (
                NVOS32_ATTR_COHERENCY.val(coherency)
                    | NVOS32_ATTR_PHYSICALITY.val(sys::NVOS32_ATTR_PHYSICALITY_NONCONTIGUOUS)
                    | NVOS32_ATTR_LOCATION.val(sys::NVOS32_ATTR_LOCATION_PCI)
                    | NVOS32_ATTR_PAGE_SIZE.val(sys::NVOS32_ATTR_PAGE_SIZE_4KB),
                NVOS32_ATTR2_ZBC.val(sys::NVOS32_ATTR2_ZBC_PREFER_NO_ZBC)
                    | NVOS32_ATTR2_GPU_CACHEABLE.val(gpu_cacheable),
                sys::NVOS32_TYPE_NOTIFIER,
                0,
            )
        }
    };
    sys::NV_MEMORY_ALLOCATION_PARAMS {
        owner,
        type_: kind,
        flags: flags
            | sys::NVOS32_ALLOC_FLAGS_ALIGNMENT_FORCE
            | sys::NVOS32_ALLOC_FLAGS_MAP_NOT_REQUIRED
            | sys::NVOS32_ALLOC_FLAGS_IGNORE_BANK_PLACEMENT
            | sys::NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED,
        attr,
        attr2,
        format: 6,
        size,
        alignment: page,
        limit: size - 1,
        ..Default::default()
    }
}

impl super::gpu::NotifierWords for Memory {
    fn read_u32_volatile(&self, offset: u64) -> Result<u32> {
        Memory::read_u32_volatile(self, offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_memory_attributes_match_what_libcuda_sends() {
        // libcuda's semaphore buffer: attr 0x2a800000 (cached, non-contiguous, PCI, 4 KiB); attr2 9, not 5 as
        // libcuda has it: APEX's host memory is also CPU-written staging, which the GPU must not cache.
        let cached = alloc_params(
            &MemoryDesc::video(0x1000).placement(Placement::SystemCached),
            0x1000,
            0x1000,
            1,
        );
        assert_eq!((cached.attr, cached.attr2), (0x2a80_0000, 9));
        // The semaphore page is exactly libcuda's: attr2 5 (GPU-cacheable).
        let sems = alloc_params(
            &MemoryDesc::video(0x1000).placement(Placement::Semaphores),
            0x1000,
            0x1000,
            1,
        );
        assert_eq!((sems.attr, sems.attr2), (0x2a80_0000, 5));
        // libcuda's pushbuffer: attr 0x4a800000 (write-combined), attr2 9 (not GPU-cacheable).
        let wc = alloc_params(
            &MemoryDesc::video(0x1000).placement(Placement::SystemWriteCombined),
            0x1000,
            0x1000,
            1,
        );
        assert_eq!((wc.attr, wc.attr2), (0x4a80_0000, 9));
    }

    #[test]
    fn video_memory_uses_huge_pages_when_large() {
        let p = alloc_params(&MemoryDesc::video(16 << 20), 16 << 20, HUGE_PAGE, 1);
        assert_eq!(
            p.attr & defs::NVOS32_ATTR_PAGE_SIZE.val(3),
            defs::NVOS32_ATTR_PAGE_SIZE.val(sys::NVOS32_ATTR_PAGE_SIZE_HUGE)
        );
        assert_ne!(p.attr2 & defs::NVOS32_ATTR2_PAGE_SIZE_HUGE.val(3), 0);
        assert_eq!(p.limit, (16 << 20) - 1);
    }
}
