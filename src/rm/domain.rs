//! Peer domains: which UVM VA space each GPU of the process is registered in. GPUs opened for peer work share
//! one (the process's peer domain), so each can map the others' buffers at the same address; every other GPU
//! gets one of its own. See [`super::peer`] for what sharing allows.

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use super::client::Client;

/// The peer domain of every simulated GPU of the process (they share the process's memory, as UVM's peers do).
pub(crate) const SIMULATED_DOMAIN: u64 = u64::MAX;

/// Which UVM VA space a GPU being opened joins.
#[derive(Debug)]
pub(crate) enum DomainChoice {
    /// The first GPU of a new shared domain: a new UVM VA space.
    NewShared(u64),
    /// The shared domain `0`, through a duplicate of a member's UVM descriptor.
    Join(u64, OwnedFd),
    /// The GPU is already in the shared domain: a private UVM VA space.
    Private(u64),
}

impl DomainChoice {
    /// The domain id.
    pub(crate) fn id(&self) -> u64 {
        match self {
            DomainChoice::NewShared(d) | DomainChoice::Join(d, _) | DomainChoice::Private(d) => *d,
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct Domains {
    next: u64,
    shared: Option<Shared>,
}

#[derive(Debug)]
struct Shared {
    id: u64,
    /// RM GPU id of each member, with the client whose UVM descriptor it uses.
    members: Vec<(u32, Weak<Client>)>,
    /// PCIe peer pairs enabled with UVM_ENABLE_PEER_ACCESS (RM GPU ids, smaller first).
    pcie_enabled: Vec<(u32, u32)>,
}

static DOMAINS: Mutex<Domains> = Mutex::new(Domains {
    next: 0,
    shared: None,
});

/// The registry, locked for a whole open so that two threads never register one GPU in the domain twice.
pub(crate) fn domains() -> MutexGuard<'static, Domains> {
    DOMAINS.lock().unwrap_or_else(|p| p.into_inner())
}

impl Domains {
    fn new_id(&mut self) -> u64 {
        // Domain 0 means "none" (simulated and attached GPUs).
        self.next += 1;
        self.next
    }

    fn prune(&mut self) {
        if let Some(s) = &mut self.shared {
            s.members.retain(|(_, c)| c.strong_count() > 0);
            if s.members.is_empty() {
                self.shared = None;
            }
        }
    }

    /// A private VA space (a GPU opened alone).
    pub(crate) fn private(&mut self) -> DomainChoice {
        DomainChoice::Private(self.new_id())
    }

    /// Where the GPU RM calls `gpu_id` goes: see [`DomainChoice`].
    pub(crate) fn choose(&mut self, gpu_id: u32) -> DomainChoice {
        self.prune();
        let Some(s) = &self.shared else {
            return DomainChoice::NewShared(self.new_id());
        };
        if s.members.iter().any(|(g, _)| *g == gpu_id) {
            return DomainChoice::Private(self.new_id());
        }
        let id = s.id;
        let fd = s
            .members
            .iter()
            .filter_map(|(_, c)| c.upgrade())
            .find_map(|c| c.uvm_fd().and_then(|fd| fd.try_clone_to_owned().ok()));
        match fd {
            Some(fd) => DomainChoice::Join(id, fd),
            // No member's descriptor could be duplicated (out of descriptors?): work alone.
            None => DomainChoice::Private(self.new_id()),
        }
    }

    /// Records a GPU opened in domain `id`: the first of a new shared domain, or one joining it (a private
    /// domain is not recorded).
    pub(crate) fn admit(&mut self, id: u64, gpu_id: u32, client: &Arc<Client>) {
        match &mut self.shared {
            None => {
                self.shared = Some(Shared {
                    id,
                    members: vec![(gpu_id, Arc::downgrade(client))],
                    pcie_enabled: Vec::new(),
                });
            }
            Some(s) if s.id == id => s.members.push((gpu_id, Arc::downgrade(client))),
            Some(_) => {}
        }
    }

    /// Whether `a` and `b` were enabled as PCIe peers in domain `id`; marks them so when `mark`.
    pub(crate) fn pcie_enabled(&mut self, id: u64, a: u32, b: u32, mark: bool) -> bool {
        let pair = (a.min(b), a.max(b));
        let Some(s) = self.shared.as_mut().filter(|s| s.id == id) else {
            return false;
        };
        let known = s.pcie_enabled.contains(&pair);
        if mark && !known {
            s.pcie_enabled.push(pair);
        }
        known
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::c_void;
    use std::os::fd::BorrowedFd;

    use super::*;
    use crate::rm::mapping::CpuMapping;
    use crate::rm::transport::{CpuMapRequest, Handle, Transport};
    use crate::rm::{Error, Result};

    /// A transport that answers RM with nothing and has no UVM descriptor.
    #[derive(Debug)]
    struct NoUvm;

    impl Transport for NoUvm {
        fn alloc_root(&self) -> Result<Handle> {
            Ok(1)
        }
        unsafe fn alloc(
            &self,
            _: Handle,
            _: Handle,
            _: u32,
            _: *mut c_void,
            _: usize,
            _: &'static str,
        ) -> Result<Handle> {
            Ok(2)
        }
        unsafe fn control(
            &self,
            _: Handle,
            _: Handle,
            _: u32,
            _: *mut c_void,
            _: usize,
            _: &'static str,
        ) -> Result<()> {
            Ok(())
        }
        fn free(&self, _: Handle, _: Handle, _: Handle) -> Result<()> {
            Ok(())
        }
        fn dup(
            &self,
            _: Handle,
            _: Handle,
            _: Handle,
            _: Handle,
            _: &'static str,
        ) -> Result<Handle> {
            Ok(3)
        }
        unsafe fn uvm(&self, _: u32, _: *mut c_void, _: &'static str) -> Result<()> {
            Ok(())
        }
        fn map_cpu(&self, _: Handle, _: &CpuMapRequest) -> Result<CpuMapping> {
            Err(Error::Simulated {
                what: "CPU mappings",
            })
        }
        fn ctl(&self) -> Result<&OwnedFd> {
            Err(Error::Simulated {
                what: "/dev/nvidiactl",
            })
        }
        fn uvm_fd(&self) -> Option<BorrowedFd<'_>> {
            None
        }
    }

    #[test]
    fn first_open_of_each_gpu_shares_a_domain_and_repeats_are_private() {
        let mut d = Domains::default();
        let a = d.choose(1);
        let DomainChoice::NewShared(id) = a else {
            panic!("{a:?}")
        };
        // A live client stand-in, only for membership: it has no UVM descriptor to share.
        let client = Arc::new(Client::over(Arc::new(NoUvm)).expect("stand-in client"));
        d.admit(id, 1, &client);
        // GPU 1 again: private. GPU 2: would join, but the stand-in has no descriptor, so it works alone.
        assert!(matches!(d.choose(1), DomainChoice::Private(p) if p != id));
        assert!(matches!(d.choose(2), DomainChoice::Private(_)));
        // Once every member is gone the next open starts a new shared domain.
        drop(client);
        assert!(matches!(d.choose(1), DomainChoice::NewShared(n) if n != id));
        assert!(!d.pcie_enabled(id, 1, 2, true));
    }
}
