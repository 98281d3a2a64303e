//! Modules: a cubin's image linked and uploaded into GPU memory, its kernels looked up by name.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tracing::debug;

use crate::rm::{GpuCore, Memory, MemoryDesc};

use super::cubin::{Cubin, KernelInfo};
use super::{Error, Result, fatbin};

/// Bytes of zeroed, mapped memory after the code: the SM prefetches instructions past a kernel's end.
const PREFETCH_PADDING: u64 = 0x1000;

/// Every module load bumps this; a queue that has not invalidated its instruction caches since the newest
/// load does so before its next launch.
static GENERATION: AtomicU64 = AtomicU64::new(1);

/// A loaded cubin.
#[derive(Debug)]
pub struct Module {
    cubin: Cubin,
    image: Memory,
    generation: u64,
}

impl Module {
    /// Loads a cubin, or the cubin for this GPU's SM version out of a fatbin.
    pub fn load(gpu: &Arc<GpuCore>, bytes: &[u8]) -> Result<Arc<Module>> {
        let sm = gpu.info().sm_version;
        let owned;
        let cubin_bytes = if fatbin::is_fatbin(bytes) {
            owned = fatbin::select_cubin(bytes, sm)?;
            &owned[..]
        } else {
            bytes
        };
        let cubin = Cubin::parse(cubin_bytes)?;
        cubin.check_arch(sm)?;
        let size = cubin.image_size().max(4) + PREFETCH_PADDING;
        let image = Memory::alloc(gpu, MemoryDesc::video(size).with_cpu().low())?;
        let mut linked = vec![0u8; image.size() as usize];
        cubin.link(image.va(), &mut linked)?;
        image.write(0, &linked)?;
        let generation = GENERATION.fetch_add(1, Ordering::Relaxed) + 1;
        debug!(
            va = format_args!("{:#x}", image.va()),
            size,
            kernels = cubin.kernels().len(),
            "module loaded"
        );
        Ok(Arc::new(Module {
            cubin,
            image,
            generation,
        }))
    }

    pub fn cubin(&self) -> &Cubin {
        &self.cubin
    }

    /// GPU address of the linked image.
    pub fn base_va(&self) -> u64 {
        self.image.va()
    }

    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// The kernel called `name`.
    pub fn kernel(self: &Arc<Self>, name: &str) -> Result<Kernel> {
        let index = self
            .cubin
            .kernels()
            .iter()
            .position(|k| k.name == name)
            .ok_or_else(|| Error::NoSuchKernel {
                name: name.to_string(),
                available: self.kernel_names(),
            })?;
        Ok(Kernel {
            module: self.clone(),
            index,
        })
    }

    pub fn kernel_names(&self) -> Vec<String> {
        self.cubin
            .kernels()
            .iter()
            .map(|k| k.name.clone())
            .collect()
    }
}

/// The newest module generation (see [`Module`]).
pub(crate) fn newest_generation() -> u64 {
    GENERATION.load(Ordering::Relaxed)
}

/// A kernel of a loaded module.
#[derive(Clone, Debug)]
pub struct Kernel {
    module: Arc<Module>,
    index: usize,
}

impl Kernel {
    pub fn info(&self) -> &KernelInfo {
        &self.module.cubin.kernels()[self.index]
    }

    pub fn name(&self) -> &str {
        &self.info().name
    }

    pub fn module(&self) -> &Arc<Module> {
        &self.module
    }

    /// GPU address of the kernel's first instruction.
    pub fn program_va(&self) -> u64 {
        self.module.base_va() + self.info().code_offset
    }
}
