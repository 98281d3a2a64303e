//! Several GPUs: counting and opening them, peer access, copies between GPUs, and queues of one GPU waiting for
//! another's, on both backends.
//!
//! On the direct path GPUs opened together with [`Gpu::open_peers`] share one address space (the peer
//! domain): a buffer keeps its address on every GPU it is mapped on, and a queue waits for another GPU's fence
//! by acquiring that queue's semaphore. A copy between GPUs runs on the source GPU's copy engines (the ones RM
//! names optimal for writing the destination), pushing into the destination's memory mapped on the source, split
//! across the engines and ordered with the queue's other work on the GPUs. On the driver backend the same calls
//! use `cuCtxEnablePeerAccess`, `cuMemcpyPeerAsync` and events.

use std::sync::Arc;

use super::backend::Backed;
use super::peer::peer_error;
use super::{Backend, BackendRequest, Buffer, Error, Fence, Gpu, Queue, Result};
use crate::driver;
use crate::rm::{self, GpuCore, PeerLink};

/// How two GPUs reach each other's memory, as [`Gpu::peer_access`] reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PeerAccess {
    /// The link: NVLink, PCIe, C2C, or the same GPU. `None` on the CUDA driver backend, which does not say.
    pub link: Option<PeerLink>,
    /// Whether atomics on the peer's memory are supported.
    pub atomics: bool,
}

impl Gpu {
    /// How many NVIDIA GPUs this process can open: RM's list when the direct path can run (and
    /// `APEX_BACKEND` does not ask for the driver), otherwise CUDA's (after `CUDA_VISIBLE_DEVICES`).
    pub fn count() -> Result<usize> {
        if BackendRequest::from_env()? != BackendRequest::Driver
            && let Ok(n) = GpuCore::count()
        {
            return Ok(n);
        }
        Ok(driver::device_count()?)
    }

    /// Opens the GPUs `indices` so that they can map each other's memory ([`Gpu::map_peer`]) and wait for each
    /// other's fences, with the backend `request` asks for. On the direct path they share one address space (the
    /// process's peer domain); [`Gpu::open`] keeps each GPU in an address space of its own.
    ///
    /// ```no_run
    /// # fn main() -> apex::Result<()> {
    /// use apex::{BackendRequest, Gpu};
    /// let gpus = Gpu::open_peers(&[0, 1], BackendRequest::Auto)?;
    /// let buf = gpus[0].alloc(1 << 20)?;
    /// gpus[1].map_peer(&buf)?; // GPU 1's kernels now reach buf.device_ptr() over the peer link
    /// # Ok(())
    /// # }
    /// ```
    pub fn open_peers(indices: &[usize], request: BackendRequest) -> Result<Vec<Gpu>> {
        indices
            .iter()
            .map(|&i| Gpu::open_in(i, request, true))
            .collect()
    }

    /// Opens the GPU whose UUID is `uuid`, as `nvidia-smi -L` prints it (`GPU-8f1d...`; the `GPU-` prefix and
    /// the dashes are optional), with the backend `APEX_BACKEND` asks for. Indices can differ between RM's
    /// order and CUDA's; a UUID names the same GPU on both backends.
    pub fn open_uuid(uuid: &str) -> Result<Gpu> {
        let want = parse_uuid(uuid)?;
        let request = BackendRequest::from_env()?;
        if request != BackendRequest::Driver
            && let Some(i) = GpuCore::uuids()
                .ok()
                .and_then(|u| u.iter().position(|u| *u == want))
        {
            let gpu = Gpu::open_with(i, request)?;
            if gpu.backend() == Backend::Direct || gpu.uuid_bytes()? == want {
                return Ok(gpu);
            }
            // Fell back to the driver, whose index `i` names another GPU: open it by CUDA's order below.
        }
        if request == BackendRequest::Direct {
            return Err(Error::InvalidArgument(format!(
                "no GPU with UUID {uuid} (`nvidia-smi -L` lists the GPUs)"
            )));
        }
        let ordinal = driver::device_uuids()?
            .iter()
            .position(|u| *u == want)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "no GPU with UUID {uuid} (`nvidia-smi -L` lists the GPUs)"
                ))
            })?;
        Gpu::open_with(ordinal, BackendRequest::Driver)
    }

    /// The GPU's UUID, as `nvidia-smi -L` prints it (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`).
    pub fn uuid(&self) -> Result<String> {
        Ok(rm::format_uuid(&self.uuid_bytes()?))
    }

    fn uuid_bytes(&self) -> Result<[u8; 16]> {
        match &self.inner {
            Backed::Direct(c) => Ok(c.info().uuid_bytes),
            Backed::Driver(ctx) => Ok(ctx.uuid()?),
        }
    }

    /// How this GPU reaches `other`'s memory; an error saying why when it cannot (no peer link, or GPUs opened
    /// in different address spaces, or different backends).
    pub fn peer_access(&self, other: &Gpu) -> Result<PeerAccess> {
        match (&self.inner, &other.inner) {
            (Backed::Direct(a), Backed::Direct(b)) => {
                let caps = a.peer_caps(b)?;
                if caps.link != PeerLink::Same {
                    a.check_same_domain(b)?;
                }
                Ok(PeerAccess {
                    link: Some(caps.link),
                    atomics: caps.atomics,
                })
            }
            (Backed::Driver(a), Backed::Driver(b)) => {
                if !a.can_access_peer(b)? {
                    return Err(Error::InvalidArgument(format!(
                        "{} cannot access the memory of {}: CUDA reports no peer access between them \
                         (cuDeviceCanAccessPeer); copy through host memory instead",
                        self.uuid()?,
                        other.uuid()?
                    )));
                }
                Ok(PeerAccess {
                    link: None,
                    atomics: true,
                })
            }
            _ => Err(Error::Mismatch),
        }
    }

    /// Makes `buffer`, memory of another GPU, addressable by this GPU's kernels and copies at its
    /// [`device_ptr`](Buffer::device_ptr): a kernel on this GPU then reads and writes it over the peer link.
    /// Mapping twice is a no-op; the mapping lasts as long as the buffer. On the driver backend this enables
    /// peer access from this GPU's context to the buffer's (`cuCtxEnablePeerAccess`), which covers all of it.
    pub fn map_peer(&self, buffer: &Buffer) -> Result<()> {
        match (&self.inner, &*buffer.inner) {
            (Backed::Direct(g), Backed::Direct(m)) => m.map_on(g).map_err(peer_error),
            (Backed::Driver(g), Backed::Driver(m)) => Ok(g.enable_peer_access(m.context())?),
            _ => Err(Error::Mismatch),
        }
    }
}

impl Buffer {
    /// Whether `gpu`'s kernels and copies can address this buffer: it is `gpu`'s own, or mapped on it with
    /// [`Gpu::map_peer`] (on the driver backend: whether peer access is possible, as CUDA maps all or nothing).
    pub fn is_accessible_from(&self, gpu: &Gpu) -> bool {
        match (&gpu.inner, &*self.inner) {
            (Backed::Direct(g), Backed::Direct(m)) => m.is_mapped_on(g),
            (Backed::Driver(g), Backed::Driver(m)) => {
                Arc::ptr_eq(g, m.context()) || g.can_access_peer(m.context()).unwrap_or(false)
            }
            _ => false,
        }
    }
}

impl Queue {
    /// Makes this queue's later launches and copies wait, on the GPU, until `fence` completes. `fence` may come
    /// from any queue: of this GPU, or of another GPU of the process (no CPU in between: the queue acquires the
    /// other queue's semaphore; on the driver backend, an event). Returns once the wait is queued.
    pub fn wait_for(&mut self, fence: &Fence) -> Result<()> {
        self.join(fence).map(drop)
    }

    /// As [`Queue::wait_for`], returning this queue's fence at the wait: it completes once `fence` has and all of
    /// this queue's earlier work is done, so it stands for both (as a CUDA event recorded on a stream right after a
    /// `cuStreamWaitEvent` does). On the driver backend a fence completes with its whole stream, so it may also wait
    /// for work queued after the join.
    ///
    /// ```no_run
    /// # fn main() -> apex::Result<()> {
    /// # let gpu = apex::Gpu::open(0)?;
    /// let module = gpu.load_module_file("kernels.cubin")?;
    /// let produce = module.kernel("produce")?;
    /// let (mut a, mut b) = (gpu.queue()?, gpu.queue()?);
    /// // SAFETY: `produce` takes no arguments.
    /// let produced = unsafe { a.launch(&produce, &apex::LaunchConfig::linear(1, 32), &[]) }?;
    /// // b's later work waits for a's; `both` completes after a's launch and b's earlier work.
    /// let both = b.join(&produced)?;
    /// both.wait(std::time::Duration::from_secs(1))?;
    /// # Ok(()) }
    /// ```
    pub fn join(&mut self, fence: &Fence) -> Result<Fence> {
        self.other_work();
        match (&mut self.inner, fence.direct(), fence.driver_part()) {
            (Backed::Direct(q), Some(f), _) => {
                let joined = q.wait_fence(f)?;
                Ok(Fence::from_direct(joined, q))
            }
            (Backed::Driver(q), _, Some(f)) => {
                q.wait_for(f)?;
                Ok(Fence::from_driver(q.fence()))
            }
            _ => Err(Error::Mismatch),
        }
    }
}

/// A UUID as `nvidia-smi -L` prints it, or the 32 hex digits alone.
fn parse_uuid(s: &str) -> Result<[u8; 16]> {
    let hex: String = s
        .trim()
        .trim_start_matches("GPU-")
        .chars()
        .filter(|c| *c != '-')
        .collect();
    let bad = || {
        Error::InvalidArgument(format!(
            "{s:?} is not a GPU UUID: expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx as `nvidia-smi -L` prints it"
        ))
    };
    if hex.len() != 32 || !hex.is_ascii() {
        return Err(bad());
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::parse_uuid;

    #[test]
    fn uuids_parse_as_nvidia_smi_prints_them() {
        let u = parse_uuid("GPU-8f1d3c2a-0b1e-4c5d-9e8f-0123456789ab").expect("uuid");
        assert_eq!(u[0], 0x8f);
        assert_eq!(u[15], 0xab);
        assert_eq!(
            parse_uuid("8f1d3c2a0b1e4c5d9e8f0123456789ab").expect("bare hex"),
            u
        );
        assert_eq!(
            crate::rm::format_uuid(&u),
            "GPU-8f1d3c2a-0b1e-4c5d-9e8f-0123456789ab"
        );
        for bad in [
            "",
            "GPU-xyz",
            "GPU-8f1d3c2a-0b1e-4c5d-9e8f-0123456789",
            "é".repeat(32).as_str(),
        ] {
            assert!(parse_uuid(bad).is_err(), "{bad:?}");
        }
    }
}
