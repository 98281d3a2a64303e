//! Several GPUs in one process: peer domains, peer links and peer mappings.
//!
//! A buffer of one GPU can be reached by another only at an address both agree on. APEX gives every buffer a
//! GPU address equal to its CPU address inside a UVM VA space, so the GPUs that share one UVM VA space can
//! map each other's buffers at the same address. GPUs opened for peer work (`GpuCore::open_peer`) join one
//! shared UVM VA space, the process's *peer domain*, the first open of each GPU only; a second open of a GPU
//! already in the domain, and every GPU opened alone, gets a VA space of its own (UVM registers a GPU once per
//! VA space), so it works alone and cannot map peers.
//!
//! NVLink peers are enabled by UVM as soon as both GPUs are registered in the VA space; PCIe peers need
//! `UVM_ENABLE_PEER_ACCESS`, done here on first use. Peer mappings are UVM external mappings of the owner's
//! RM memory on the peer GPU, at the same address (`UVM_MAP_EXTERNAL_ALLOCATION`); they go away with the
//! allocation.

use tracing::debug;

use super::domain::domains;
use super::gpu::GpuCore;
use super::{Error, Result, sys};

/// How two GPUs reach each other's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerLink {
    /// NVLink (directly or through NVSwitch).
    NvLink,
    /// PCIe peer-to-peer.
    Pcie,
    /// Chip-to-chip (Grace Hopper C2C).
    C2c,
    /// The same GPU.
    Same,
}

impl std::fmt::Display for PeerLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PeerLink::NvLink => "NVLink",
            PeerLink::Pcie => "PCIe",
            PeerLink::C2c => "C2C",
            PeerLink::Same => "the same GPU",
        })
    }
}

/// What RM reports about the path between two GPUs (`NV0000_CTRL_CMD_SYSTEM_GET_P2P_CAPS_V2`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCaps {
    /// The link peer accesses take.
    pub link: PeerLink,
    /// Peer reads are supported.
    pub reads: bool,
    /// Peer writes are supported.
    pub writes: bool,
    /// Peer atomics are supported.
    pub atomics: bool,
    /// Copy engines (LCE indices, as a bit mask) RM names optimal for reading the peer's memory.
    pub optimal_read_ces: u32,
    /// Copy engines (LCE indices, as a bit mask) RM names optimal for writing the peer's memory.
    pub optimal_write_ces: u32,
}

// Bits of `p2pCaps` (ctrl0000system.h, NV0000_CTRL_SYSTEM_GET_P2P_CAPS_*).
const CAP_WRITES: u32 = 1 << sys::NV0000_CTRL_SYSTEM_GET_P2P_CAPS_WRITES_SUPPORTED;
const CAP_READS: u32 = 1 << sys::NV0000_CTRL_SYSTEM_GET_P2P_CAPS_READS_SUPPORTED;
const CAP_NVLINK: u32 = 1 << sys::NV0000_CTRL_SYSTEM_GET_P2P_CAPS_NVLINK_SUPPORTED;
const CAP_ATOMICS: u32 = 1 << sys::NV0000_CTRL_SYSTEM_GET_P2P_CAPS_ATOMICS_SUPPORTED;
const CAP_PCI: u32 = 1 << sys::NV0000_CTRL_SYSTEM_GET_P2P_CAPS_PCI_SUPPORTED;
/// NV0000_CTRL_SYSTEM_GET_P2P_CAPS_C2C_SUPPORTED (bit 12).
const CAP_C2C: u32 = 1 << 12;

/// What a `p2pCapsStatus` byte means (NV0000_P2P_CAPS_STATUS_*).
fn caps_status_text(s: u8) -> &'static str {
    match s {
        0 => "supported",
        1 => "not supported by the chipset",
        2 => "not supported by the GPU",
        3 => "not supported by the PCIe topology (IOH)",
        4 => "disabled by a registry key",
        5 => "not supported",
        _ => "not supported (unknown reason)",
    }
}

/// Decodes RM's answer for a pair of GPUs; `Err` holds why they have no peer path.
pub(crate) fn decode_caps(
    caps: u32,
    status: &[u8],
    read_ces: u32,
    write_ces: u32,
) -> std::result::Result<PeerCaps, String> {
    let at = |i: u32| status.get(i as usize).copied().unwrap_or(5);
    let link = if caps & CAP_NVLINK != 0 {
        PeerLink::NvLink
    } else if caps & CAP_C2C != 0 {
        PeerLink::C2c
    } else if caps & CAP_PCI != 0 {
        PeerLink::Pcie
    } else {
        return Err(format!(
            "no NVLink ({}) and no PCIe peer-to-peer ({})",
            caps_status_text(at(sys::NV0000_CTRL_P2P_CAPS_INDEX_NVLINK)),
            caps_status_text(at(sys::NV0000_CTRL_P2P_CAPS_INDEX_PCI))
        ));
    };
    let (reads, writes) = (caps & CAP_READS != 0, caps & CAP_WRITES != 0);
    if !reads && !writes {
        return Err(format!(
            "{link} is present but peer reads are {} and peer writes {}",
            caps_status_text(at(sys::NV0000_CTRL_P2P_CAPS_INDEX_READ)),
            caps_status_text(at(sys::NV0000_CTRL_P2P_CAPS_INDEX_WRITE))
        ));
    }
    Ok(PeerCaps {
        link,
        reads,
        writes,
        atomics: caps & CAP_ATOMICS != 0,
        optimal_read_ces: read_ces,
        optimal_write_ces: write_ces,
    })
}

impl GpuCore {
    /// The peer domain this GPU is in (0: none, as for simulated and attached GPUs).
    pub fn peer_domain(&self) -> u64 {
        self.domain
    }

    /// How this GPU reaches `other`'s memory, as RM reports it; an error saying why when it cannot.
    pub fn peer_caps(&self, other: &GpuCore) -> Result<PeerCaps> {
        if self.gpu_id == other.gpu_id {
            return Ok(PeerCaps {
                link: PeerLink::Same,
                reads: true,
                writes: true,
                atomics: true,
                optimal_read_ces: 0,
                optimal_write_ces: 0,
            });
        }
        // Simulated GPUs answer for each other through their in-process RM (NVLink peers).
        match (self.client.is_in_process(), other.client.is_in_process()) {
            (true, true) | (false, false) => {}
            _ => {
                return Err(Error::NoPeerPath {
                    from: self.info.uuid.clone(),
                    to: other.info.uuid.clone(),
                    why: "one GPU is simulated and the other is not".into(),
                });
            }
        }
        let mut p = Box::<sys::NV0000_CTRL_SYSTEM_GET_P2P_CAPS_V2_PARAMS>::default();
        p.gpuIds[0] = self.gpu_id;
        p.gpuIds[1] = other.gpu_id;
        p.gpuCount = 2;
        self.client.ctrl(self.client.handle(), &mut *p)?;
        decode_caps(
            p.p2pCaps,
            &p.p2pCapsStatus,
            p.p2pOptimalReadCEs,
            p.p2pOptimalWriteCEs,
        )
        .map_err(|why| Error::NoPeerPath {
            from: self.info.uuid.clone(),
            to: other.info.uuid.clone(),
            why,
        })
    }

    /// Lets this GPU and `other` map each other's memory: both must be in the same peer domain and have a peer
    /// link. NVLink peers are enabled by UVM already; PCIe peers are enabled here, once per pair.
    pub fn enable_peer(&self, other: &GpuCore) -> Result<PeerCaps> {
        let caps = self.peer_caps(other)?;
        if caps.link == PeerLink::Same {
            return Ok(caps);
        }
        self.check_same_domain(other)?;
        if caps.link == PeerLink::Pcie {
            let mut reg = domains();
            if !reg.pcie_enabled(self.domain, self.gpu_id, other.gpu_id, false) {
                let mut p = sys::UVM_ENABLE_PEER_ACCESS_PARAMS {
                    gpuUuidA: self.uuid(),
                    gpuUuidB: other.uuid(),
                    rmStatus: 0,
                };
                self.client.uvm_call(
                    sys::UVM_ENABLE_PEER_ACCESS,
                    &mut p,
                    "UVM_ENABLE_PEER_ACCESS",
                    |p| p.rmStatus,
                )?;
                reg.pcie_enabled(self.domain, self.gpu_id, other.gpu_id, true);
                debug!(a = %self.info.uuid, b = %other.info.uuid, "PCIe peer access enabled");
            }
        }
        Ok(caps)
    }

    /// [`Error::NotPeers`] unless both GPUs share a UVM VA space.
    pub(crate) fn check_same_domain(&self, other: &GpuCore) -> Result<()> {
        if self.domain != 0 && self.domain == other.domain {
            return Ok(());
        }
        let why = if self.domain == 0 || other.domain == 0 {
            "one of them is simulated or attached to a CUDA context, whose address space APEX does not share"
        } else {
            "they were opened in different address spaces: a GPU opened a second time in this process gets an \
             address space of its own; map peers between the first opens of each GPU"
        };
        Err(Error::NotPeers {
            a: self.info.uuid.clone(),
            b: other.info.uuid.clone(),
            why,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_decode_links_and_reasons() {
        let nv = decode_caps(
            CAP_NVLINK | CAP_READS | CAP_WRITES | CAP_ATOMICS,
            &[0; 9],
            0x3,
            0xc,
        )
        .expect("nvlink");
        assert_eq!(nv.link, PeerLink::NvLink);
        assert!(nv.reads && nv.writes && nv.atomics);
        assert_eq!((nv.optimal_read_ces, nv.optimal_write_ces), (0x3, 0xc));
        let pci = decode_caps(CAP_PCI | CAP_WRITES, &[0; 9], 0, 0).expect("pcie");
        assert_eq!(pci.link, PeerLink::Pcie);
        assert!(!pci.reads && pci.writes && !pci.atomics);
        let mut st = [0u8; 9];
        st[sys::NV0000_CTRL_P2P_CAPS_INDEX_NVLINK as usize] = 5;
        st[sys::NV0000_CTRL_P2P_CAPS_INDEX_PCI as usize] = 3;
        let none = decode_caps(0, &st, 0, 0).expect_err("no path");
        assert!(none.contains("PCIe topology"), "{none}");
        let no_rw = decode_caps(CAP_NVLINK, &[4; 9], 0, 0).expect_err("no reads or writes");
        assert!(no_rw.contains("registry key"), "{no_rw}");
    }
}
