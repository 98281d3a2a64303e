//! `cuLaunchKernelEx`'s configuration: which attributes the preload honours on an APEX queue and which send the
//! launch to libcuda.

use std::ffi::{c_uint, c_void};

use crate::Refusal;

/// `CUlaunchConfig`, as the driver API lays it out.
#[repr(C)]
#[derive(Debug)]
pub struct LaunchConfig {
    /// Grid, in blocks.
    pub grid: [c_uint; 3],
    /// Block, in threads.
    pub block: [c_uint; 3],
    /// Dynamic shared memory, bytes.
    pub shared: c_uint,
    /// The stream.
    pub stream: *mut c_void,
    /// `CUlaunchAttribute[num_attrs]`.
    pub attrs: *const LaunchAttribute,
    /// How many attributes.
    pub num_attrs: c_uint,
}

/// `CUlaunchAttribute`: an id and a 64-byte value union.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LaunchAttribute {
    /// `CUlaunchAttributeID` (kept as a number: the program may pass ids newer than this library).
    pub id: u32,
    /// Padding before the value.
    pub pad: [u8; 4],
    /// `CUlaunchAttributeValue`, 64 bytes.
    pub value: [u8; 64],
}

impl LaunchAttribute {
    /// An attribute with `id` and the first words of its value.
    pub fn new(id: u32, words: &[u32]) -> LaunchAttribute {
        let mut value = [0u8; 64];
        for (i, w) in words.iter().enumerate().take(16) {
            value[i * 4..i * 4 + 4].copy_from_slice(&w.to_le_bytes());
        }
        LaunchAttribute {
            id,
            pad: [0; 4],
            value,
        }
    }

    fn word(&self, i: usize) -> u32 {
        let mut w = [0u8; 4];
        w.copy_from_slice(&self.value[i * 4..i * 4 + 4]);
        u32::from_le_bytes(w)
    }
}

/// What a `cuLaunchKernelEx` asks beyond `cuLaunchKernel` that an APEX queue does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Extras {
    /// A run-time thread block cluster shape (`CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION`).
    pub cluster: Option<[u32; 3]>,
    /// `CU_LAUNCH_ATTRIBUTE_COOPERATIVE` set: the grid synchronizes itself.
    pub cooperative: bool,
    /// `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION` set: the launch may start before the stream's
    /// previous kernel completes (it waits for it itself with `griddepcontrol.wait`). Running it in plain stream
    /// order is always correct, so a queue that cannot start it early runs it as an ordinary launch.
    pub programmatic: bool,
    /// The memory sync domain the kernel runs in, after the launch's domain map
    /// (`CU_LAUNCH_ATTRIBUTE_MEM_SYNC_DOMAIN` and `..._MAP`; NCCL's kernels ask for "remote", domain 1).
    pub sync_domain: u8,
    /// `CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE`.
    pub cluster_policy: apex::ClusterPolicy,
}

const IGNORE: u32 = 0;
const ACCESS_POLICY_WINDOW: u32 = 1;
const COOPERATIVE: u32 = 2;
const SYNCHRONIZATION_POLICY: u32 = 3;
const CLUSTER_DIMENSION: u32 = 4;
const CLUSTER_SCHEDULING_POLICY_PREFERENCE: u32 = 5;
const PROGRAMMATIC_STREAM_SERIALIZATION: u32 = 6;
const PROGRAMMATIC_EVENT: u32 = 7;
const PRIORITY: u32 = 8;
const MEM_SYNC_DOMAIN_MAP: u32 = 9;
const MEM_SYNC_DOMAIN: u32 = 10;
const PREFERRED_CLUSTER_DIMENSION: u32 = 11;
const LAUNCH_COMPLETION_EVENT: u32 = 12;
const DEVICE_UPDATABLE_KERNEL_NODE: u32 = 13;
const PREFERRED_SHARED_MEMORY_CARVEOUT: u32 = 14;

fn name(id: u32) -> &'static str {
    match id {
        ACCESS_POLICY_WINDOW => "access policy window",
        SYNCHRONIZATION_POLICY => "synchronization policy",
        CLUSTER_SCHEDULING_POLICY_PREFERENCE => "cluster scheduling policy",
        PROGRAMMATIC_STREAM_SERIALIZATION => "programmatic stream serialization",
        PROGRAMMATIC_EVENT => "programmatic event",
        PRIORITY => "priority",
        MEM_SYNC_DOMAIN_MAP => "memory sync domain map",
        MEM_SYNC_DOMAIN => "memory sync domain",
        PREFERRED_CLUSTER_DIMENSION => "preferred cluster dimension",
        LAUNCH_COMPLETION_EVENT => "launch completion event",
        DEVICE_UPDATABLE_KERNEL_NODE => "device-updatable kernel node",
        PREFERRED_SHARED_MEMORY_CARVEOUT => "preferred shared memory carveout",
        _ => "unknown to the preload",
    }
}

/// The attributes of one `cuLaunchKernelEx`, or why an APEX queue cannot run it. Honoured: a cluster shape, the
/// cooperative flag, programmatic stream serialization, the cluster scheduling policy, the memory sync domain and
/// its map (written into the QMD as libcuda writes them), and a carveout preference left at its default.
/// Everything else — programmatic events, priorities, access policy windows, launch completion events, ids this
/// library does not know — is refused: the launch runs on libcuda, which honours them.
pub fn extras(attrs: &[LaunchAttribute]) -> Result<Extras, Refusal> {
    let mut out = Extras::default();
    let mut refused: Option<Refusal> = None;
    // CUDA's default map (measured: "remote" launches carry SYNC_DOMAIN_ID 1, default ones 0).
    let mut map: [u8; 2] = [0, 1];
    let mut domain = 0usize;
    for a in attrs {
        match a.id {
            IGNORE => {}
            COOPERATIVE => out.cooperative = a.word(0) != 0,
            PROGRAMMATIC_STREAM_SERIALIZATION => out.programmatic = a.word(0) != 0,
            CLUSTER_DIMENSION => {
                let shape = [a.word(0), a.word(1), a.word(2)];
                // A 1x1x1 cluster is a plain launch.
                out.cluster = (shape != [1, 1, 1]).then_some(shape);
            }
            CLUSTER_SCHEDULING_POLICY_PREFERENCE if a.word(0) <= 2 => {
                out.cluster_policy = match a.word(0) {
                    0 => apex::ClusterPolicy::Default,
                    1 => apex::ClusterPolicy::Spread,
                    _ => apex::ClusterPolicy::LoadBalancing,
                };
            }
            MEM_SYNC_DOMAIN if a.word(0) <= 1 => domain = a.word(0) as usize,
            // `CUlaunchMemSyncDomainMap`: two bytes, the domain of "default" and of "remote" launches.
            MEM_SYNC_DOMAIN_MAP if a.value[0] < 4 && a.value[1] < 4 => {
                map = [a.value[0], a.value[1]];
            }
            PREFERRED_SHARED_MEMORY_CARVEOUT if a.word(0) == 0 => {}
            id => match &mut refused {
                // The first is named; the others are listed, so that one run shows everything a program's
                // launches ask for.
                Some(Refusal::LaunchAttribute { others, .. }) => *others |= 1u64 << id.min(63),
                _ => {
                    refused = Some(Refusal::LaunchAttribute {
                        id,
                        name: name(id),
                        value: a.word(0),
                        others: 0,
                    })
                }
            },
        }
    }
    if let Some(r) = refused {
        return Err(r);
    }
    out.sync_domain = map[domain];
    if out.cooperative && out.cluster.is_some() {
        return Err(Refusal::LaunchAttribute {
            id: COOPERATIVE,
            name: "cooperative with a cluster shape",
            value: 1,
            others: 0,
        });
    }
    Ok(out)
}

/// The attributes of a `CUlaunchConfig`.
///
/// # Safety
/// `config.attrs` must point at `config.num_attrs` attributes (or `num_attrs` be 0).
pub unsafe fn attributes(config: &LaunchConfig) -> &[LaunchAttribute] {
    if config.attrs.is_null() || config.num_attrs == 0 {
        return &[];
    }
    // SAFETY: per the contract.
    unsafe { std::slice::from_raw_parts(config.attrs, config.num_attrs as usize) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_driver_api() {
        assert_eq!(size_of::<LaunchAttribute>(), 72);
        assert_eq!(std::mem::offset_of!(LaunchConfig, stream), 32);
        assert_eq!(std::mem::offset_of!(LaunchConfig, attrs), 40);
        assert_eq!(std::mem::offset_of!(LaunchConfig, num_attrs), 48);
    }

    #[test]
    fn no_attributes_is_a_plain_launch() {
        assert_eq!(extras(&[]), Ok(Extras::default()));
        assert_eq!(
            extras(&[LaunchAttribute::new(IGNORE, &[7])]),
            Ok(Extras::default())
        );
    }

    #[test]
    fn cluster_shapes_and_cooperative_launches_are_honoured() {
        let c = extras(&[LaunchAttribute::new(CLUSTER_DIMENSION, &[2, 1, 1])]).unwrap();
        assert_eq!(c.cluster, Some([2, 1, 1]));
        let one = extras(&[LaunchAttribute::new(CLUSTER_DIMENSION, &[1, 1, 1])]).unwrap();
        assert_eq!(one.cluster, None);
        let coop = extras(&[LaunchAttribute::new(COOPERATIVE, &[1])]).unwrap();
        assert!(coop.cooperative);
        assert!(
            !extras(&[LaunchAttribute::new(COOPERATIVE, &[0])])
                .unwrap()
                .cooperative
        );
    }

    #[test]
    fn defaults_pass_and_everything_else_is_refused_by_id() {
        for id in [
            CLUSTER_SCHEDULING_POLICY_PREFERENCE,
            PROGRAMMATIC_STREAM_SERIALIZATION,
            PREFERRED_SHARED_MEMORY_CARVEOUT,
        ] {
            assert_eq!(
                extras(&[LaunchAttribute::new(id, &[0])]),
                Ok(Extras::default()),
                "{id}"
            );
        }
        let pdl = extras(&[LaunchAttribute::new(
            PROGRAMMATIC_STREAM_SERIALIZATION,
            &[1],
        )]);
        assert_eq!(
            pdl,
            Ok(Extras {
                programmatic: true,
                ..Extras::default()
            })
        );
        for id in [
            ACCESS_POLICY_WINDOW,
            PROGRAMMATIC_EVENT,
            PRIORITY,
            LAUNCH_COMPLETION_EVENT,
            99,
        ] {
            let e = extras(&[LaunchAttribute::new(id, &[1])]).unwrap_err();
            assert!(
                matches!(e, Refusal::LaunchAttribute { id: i, .. } if i == id),
                "{id}: {e}"
            );
        }
        // Every attribute that cannot be honoured is named: the first with its value, the others by id.
        let many = extras(&[
            LaunchAttribute::new(ACCESS_POLICY_WINDOW, &[1]),
            LaunchAttribute::new(CLUSTER_DIMENSION, &[2, 1, 1]),
            LaunchAttribute::new(PRIORITY, &[3]),
            LaunchAttribute::new(LAUNCH_COMPLETION_EVENT, &[9]),
        ])
        .unwrap_err();
        assert_eq!(
            many,
            Refusal::LaunchAttribute {
                id: ACCESS_POLICY_WINDOW,
                name: "access policy window",
                value: 1,
                others: (1 << PRIORITY) | (1 << LAUNCH_COMPLETION_EVENT),
            }
        );
        assert_eq!(
            many.to_string(),
            "launch attribute 1 (access policy window) = 1 cannot be honoured (also refused in this launch: 8, 12)"
        );
        let both = extras(&[
            LaunchAttribute::new(COOPERATIVE, &[1]),
            LaunchAttribute::new(CLUSTER_DIMENSION, &[2, 1, 1]),
        ]);
        assert!(both.is_err());
    }

    /// NCCL's launches: a cluster with the "spread" policy, in the "remote" memory sync domain. The domain goes
    /// through the launch's domain map (CUDA's default: default 0, remote 1), as libcuda writes it.
    #[test]
    fn sync_domains_and_cluster_policies_are_honoured() {
        let nccl = extras(&[
            LaunchAttribute::new(CLUSTER_DIMENSION, &[4, 1, 1]),
            LaunchAttribute::new(CLUSTER_SCHEDULING_POLICY_PREFERENCE, &[1]),
            LaunchAttribute::new(MEM_SYNC_DOMAIN, &[1]),
        ])
        .unwrap();
        assert_eq!(nccl.cluster, Some([4, 1, 1]));
        assert_eq!(nccl.cluster_policy, apex::ClusterPolicy::Spread);
        assert_eq!(nccl.sync_domain, 1);
        let balanced = extras(&[LaunchAttribute::new(
            CLUSTER_SCHEDULING_POLICY_PREFERENCE,
            &[2],
        )])
        .unwrap();
        assert_eq!(balanced.cluster_policy, apex::ClusterPolicy::LoadBalancing);
        // A map that swaps the domains, given before or after the domain.
        let swapped = LaunchAttribute::new(MEM_SYNC_DOMAIN_MAP, &[0x0001]);
        assert_eq!(swapped.value[..2], [1, 0]);
        let remote = LaunchAttribute::new(MEM_SYNC_DOMAIN, &[1]);
        let default = LaunchAttribute::new(MEM_SYNC_DOMAIN, &[0]);
        assert_eq!(extras(&[swapped, remote]).unwrap().sync_domain, 0);
        assert_eq!(extras(&[default, swapped]).unwrap().sync_domain, 1);
        assert_eq!(
            extras(&[remote, default]).unwrap().sync_domain,
            0,
            "the last one counts"
        );
        // Values CUDA does not define are refused with their value.
        for (id, v) in [
            (MEM_SYNC_DOMAIN, 2),
            (CLUSTER_SCHEDULING_POLICY_PREFERENCE, 3),
            (MEM_SYNC_DOMAIN_MAP, 0x0004),
        ] {
            let e = extras(&[LaunchAttribute::new(id, &[v])]).unwrap_err();
            assert!(
                matches!(e, Refusal::LaunchAttribute { id: i, value, .. } if i == id && value == v),
                "{id}: {e}"
            );
        }
    }

    #[test]
    fn attributes_reads_the_configs_array() {
        let list = [
            LaunchAttribute::new(CLUSTER_DIMENSION, &[4, 1, 1]),
            LaunchAttribute::new(PRIORITY, &[1]),
        ];
        let cfg = LaunchConfig {
            grid: [8, 1, 1],
            block: [32, 1, 1],
            shared: 0,
            stream: std::ptr::null_mut(),
            attrs: list.as_ptr(),
            num_attrs: 2,
        };
        // SAFETY: two live attributes.
        let got = unsafe { attributes(&cfg) };
        assert_eq!(got.len(), 2);
        assert_eq!(got[1].id, PRIORITY);
        let empty = LaunchConfig {
            attrs: std::ptr::null(),
            num_attrs: 3,
            ..cfg
        };
        // SAFETY: null is checked.
        assert!(unsafe { attributes(&empty) }.is_empty());
    }
}
