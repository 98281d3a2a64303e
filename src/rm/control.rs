//! RM controls (`NV_ESC_RM_CONTROL`) as types: each parameter struct APEX sends is bound once, in the table at the
//! bottom of this file, to its command number and its name, as drm-ffi binds its ioctls. Callers then write
//! `subdevice.ctrl(&mut params)` ([`Object::ctrl`](super::Object::ctrl), [`Client::ctrl`](super::Client::ctrl))
//! and cannot pair a struct with another command, or a command with a name that is not its own.
//!
//! The transports below ([`super::transport::Transport::control`]) still see a command number, a pointer and a
//! size: the kernel driver and the simulator dispatch on the number, as before.

use super::sys;
use super::transport::Handle;

/// The parameter struct of one RM control: the command it is sent with and that command's name, bound once.
///
/// # Safety
/// `Self` is the parameter struct RM expects for [`CMD`](Self::CMD): its layout (`#[repr(C)]` or
/// `#[repr(transparent)]` over such a struct) and its size are RM's, so RM reads and writes only memory inside it
/// (and the buffers its pointer fields, set by the caller, point to).
pub unsafe trait RmControl {
    /// The `NV*_CTRL_CMD_*` command number.
    const CMD: u32;
    /// The command's name as NVIDIA's headers spell it (`NV2080_CTRL_CMD_GPU_GET_ID`): what errors name.
    const NAME: &'static str;
}

/// The last segment of a path as `stringify!` spells it (`sys::NV2080_CTRL_CMD_GPU_GET_ID` gives
/// `NV2080_CTRL_CMD_GPU_GET_ID`), at compile time.
const fn last_segment(path: &'static str) -> &'static str {
    let bytes = path.as_bytes();
    let mut start = bytes.len();
    while start > 0 && bytes[start - 1] != b':' {
        start -= 1;
    }
    let (_, tail) = bytes.split_at(start);
    match std::str::from_utf8(tail) {
        Ok(s) => s.trim_ascii(),
        Err(_) => panic!("a path is UTF-8"),
    }
}

/// One row of the table, for the tests: what the table bound, by name.
#[cfg(test)]
#[derive(Debug)]
struct Binding {
    /// `RmControl::NAME`.
    name: &'static str,
    /// `RmControl::CMD`.
    cmd: u32,
    /// The parameter struct as NVIDIA's headers name it (its `*_MESSAGE_ID` names the command's).
    params: &'static str,
    /// `size_of` the parameter type.
    size: usize,
}

/// Binds parameter types to commands: `Params => path::COMMAND` (the parameter struct's header name is the
/// type's last segment) or `Params as HEADER_NAME => path::COMMAND` (a newtype over a struct another command
/// also takes). The name is the command constant's own, so it cannot drift from the number.
macro_rules! rm_controls {
    (@header $params:ty, $header:ident) => { stringify!($header) };
    (@header $params:ty) => { last_segment(stringify!($params)) };
    ($($params:ty $(as $header:ident)? => $cmd:path),* $(,)?) => {
        $(
            // SAFETY: each row pairs a command with the parameter struct NVIDIA's headers give it (checked against
            // the vendored headers by `tests::bindings_match_nvidias_headers`); bindgen's and this module's
            // structs are `#[repr(C)]`, newtypes `#[repr(transparent)]`.
            unsafe impl RmControl for $params {
                const CMD: u32 = $cmd;
                const NAME: &'static str = last_segment(stringify!($cmd));
            }
        )*

        /// Every row of the table.
        #[cfg(test)]
        const BINDINGS: &[Binding] = &[$(Binding {
            name: <$params as RmControl>::NAME,
            cmd: <$params as RmControl>::CMD,
            params: rm_controls!(@header $params $(, $header)?),
            size: size_of::<$params>(),
        }),*];
    };
}

rm_controls! {
    // The root client (NV01_ROOT_CLIENT).
    sys::NV0000_CTRL_GPU_GET_ID_INFO_V2_PARAMS => sys::NV0000_CTRL_CMD_GPU_GET_ID_INFO_V2,
    sys::NV0000_CTRL_GPU_GET_UUID_FROM_GPU_ID_PARAMS => sys::NV0000_CTRL_CMD_GPU_GET_UUID_FROM_GPU_ID,
    sys::NV0000_CTRL_SYSTEM_GET_P2P_CAPS_V2_PARAMS => sys::NV0000_CTRL_CMD_SYSTEM_GET_P2P_CAPS_V2,
    ClientGetHandleInfo => NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO,
    ClientGetAccessRights => NV0000_CTRL_CMD_CLIENT_GET_ACCESS_RIGHTS,
    ClientGetChildHandle => NV0000_CTRL_CMD_CLIENT_GET_CHILD_HANDLE,
    // The device (NV01_DEVICE_0).
    sys::NV0080_CTRL_GPU_GET_CLASSLIST_V2_PARAMS => sys::NV0080_CTRL_CMD_GPU_GET_CLASSLIST_V2,
    // The subdevice (NV20_SUBDEVICE_0).
    sys::NV2080_CTRL_GPU_GET_ID_PARAMS => sys::NV2080_CTRL_CMD_GPU_GET_ID,
    sys::NV2080_CTRL_GPU_GET_NAME_STRING_PARAMS => sys::NV2080_CTRL_CMD_GPU_GET_NAME_STRING,
    sys::NV2080_CTRL_GPU_GET_GID_INFO_PARAMS => sys::NV2080_CTRL_CMD_GPU_GET_GID_INFO,
    sys::NV2080_CTRL_GPU_GET_ENGINES_V2_PARAMS => sys::NV2080_CTRL_CMD_GPU_GET_ENGINES_V2,
    sys::NV2080_CTRL_GR_GET_INFO_PARAMS => sys::NV2080_CTRL_CMD_GR_GET_INFO,
    sys::NV2080_CTRL_GR_GET_GPC_MASK_PARAMS => sys::NV2080_CTRL_CMD_GR_GET_GPC_MASK,
    sys::NV2080_CTRL_GR_GET_TPC_MASK_PARAMS => sys::NV2080_CTRL_CMD_GR_GET_TPC_MASK,
    sys::NV2080_CTRL_GR_SET_CTXSW_PREEMPTION_MODE_PARAMS =>
        sys::NV2080_CTRL_CMD_GR_SET_CTXSW_PREEMPTION_MODE,
    sys::NV2080_CTRL_FB_GET_INFO_V2_PARAMS => sys::NV2080_CTRL_CMD_FB_GET_INFO_V2,
    sys::NV2080_CTRL_PERF_BOOST_PARAMS => sys::NV2080_CTRL_CMD_PERF_BOOST,
    CePceMaskParams => NV2080_CTRL_CMD_CE_GET_CE_PCE_MASK,
    // Channel groups (KEPLER_CHANNEL_GROUP_A) and channels (*_CHANNEL_GPFIFO_*).
    ChannelGroupSchedule as NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS => sys::NVA06C_CTRL_CMD_GPFIFO_SCHEDULE,
    sys::NVA06F_CTRL_GPFIFO_SCHEDULE_PARAMS => sys::NVA06F_CTRL_CMD_GPFIFO_SCHEDULE,
    sys::NVC36F_CTRL_CMD_GPFIFO_GET_WORK_SUBMIT_TOKEN_PARAMS =>
        sys::NVC36F_CTRL_CMD_GPFIFO_GET_WORK_SUBMIT_TOKEN,
    sys::NV906F_CTRL_GET_MMU_FAULT_INFO_PARAMS => sys::NV906F_CTRL_CMD_GET_MMU_FAULT_INFO,
    // The debugger (GT200_DEBUGGER).
    sys::NV83DE_CTRL_DEBUG_READ_ALL_SM_ERROR_STATES_PARAMS =>
        sys::NV83DE_CTRL_CMD_DEBUG_READ_ALL_SM_ERROR_STATES,
}

/// `NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS`: schedules (or unschedules) a channel group. NVIDIA's headers make it the
/// channel's `NVA06F_CTRL_GPFIFO_SCHEDULE_PARAMS` under another name; the newtype lets each command bind its own.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ChannelGroupSchedule(pub sys::NVA06C_CTRL_GPFIFO_SCHEDULE_PARAMS);

// Controls not among the vendored headers: numbers and structs from NVIDIA's open-gpu-kernel-modules.

/// `NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO` (ctrl0000client.h).
pub(crate) const NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO: u32 = 0xd02;
/// `NV0000_CTRL_CMD_CLIENT_GET_ACCESS_RIGHTS` (ctrl0000client.h).
pub(crate) const NV0000_CTRL_CMD_CLIENT_GET_ACCESS_RIGHTS: u32 = 0xd03;
/// `NV0000_CTRL_CMD_CLIENT_GET_CHILD_HANDLE` (ctrl0000client.h).
pub(crate) const NV0000_CTRL_CMD_CLIENT_GET_CHILD_HANDLE: u32 = 0xd05;
/// `NV2080_CTRL_CMD_CE_GET_CE_PCE_MASK` (ctrl2080ce.h): which physical copy engines (PCEs) back a logical one.
pub(crate) const NV2080_CTRL_CMD_CE_GET_CE_PCE_MASK: u32 = 0x2080_2a02;

/// `NV0000_CTRL_CLIENT_GET_HANDLE_INFO_PARAMS`: the parent or the class of one handle of the client.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ClientGetHandleInfo {
    /// In: the handle asked about.
    pub(crate) h_object: Handle,
    /// In: `NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO_INDEX_*`.
    pub(crate) index: u32,
    /// Out: `hResult` (parent) or `iResult` (class), a union aligned to 8.
    pub(crate) result: u64,
}

/// `NV0000_CTRL_CLIENT_GET_ACCESS_RIGHTS_PARAMS`: the rights a client has on an object.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ClientGetAccessRights {
    /// In: the object.
    pub(crate) h_object: Handle,
    /// In: the client it belongs to.
    pub(crate) h_client: Handle,
    /// Out: `RS_ACCESS_*` bits.
    pub(crate) mask: u32,
}

/// `NV0000_CTRL_CMD_CLIENT_GET_CHILD_HANDLE_PARAMS`: the first child of a parent, by RM's internal class id.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ClientGetChildHandle {
    /// In: the parent.
    pub(crate) h_parent: Handle,
    /// In: the child's NVOC class id.
    pub(crate) class_id: u32,
    /// Out: the child.
    pub(crate) h_object: Handle,
}

/// `NV2080_CTRL_CE_GET_CE_PCE_MASK_PARAMS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CePceMaskParams {
    /// In: `NV2080_ENGINE_TYPE_COPY(n)`.
    pub(crate) ce_engine_type: u32,
    /// Out: the PCEs assigned to it, a bit each.
    pub(crate) pce_mask: u32,
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};
    use std::path::Path;

    use super::*;

    /// Where the vendored control headers live.
    const SDK: &str = "open-gpu-headers/open-gpu-kernel-modules/src/common/sdk/nvidia/inc";

    /// Every `#define` of the vendored SDK headers: name to the rest of its line.
    fn header_defines() -> HashMap<String, String> {
        fn walk(dir: &Path, out: &mut HashMap<String, String>) {
            for entry in std::fs::read_dir(dir).unwrap().flatten() {
                let path = entry.path();
                if path.is_dir() {
                    walk(&path, out);
                } else if path.extension().is_some_and(|e| e == "h") {
                    for line in std::fs::read_to_string(&path).unwrap().lines() {
                        if let Some(rest) = line.trim_start().strip_prefix("#define ")
                            && let Some((name, value)) = rest.split_once(char::is_whitespace)
                        {
                            out.insert(name.to_string(), value.trim().to_string());
                        }
                    }
                }
            }
        }
        let mut out = HashMap::new();
        walk(&Path::new(env!("CARGO_MANIFEST_DIR")).join(SDK), &mut out);
        out
    }

    /// The number at the start of a define's value: `(0x20800142U) /* ... */` gives 0x20800142.
    fn leading_number(value: &str) -> u32 {
        let n = value.trim_start_matches('(');
        let n = n.split([')', ' ']).next().unwrap().trim_end_matches('U');
        u32::from_str_radix(n.strip_prefix("0x").unwrap(), 16).unwrap()
    }

    #[test]
    fn every_command_is_bound_once_to_one_type() {
        let mut cmds = HashSet::new();
        let mut names = HashSet::new();
        for b in BINDINGS {
            assert!(cmds.insert(b.cmd), "{} bound twice", b.name);
            assert!(names.insert(b.name), "{} bound twice", b.name);
            assert!(b.name.contains("_CTRL_CMD_"), "{b:?}");
        }
        // A newtype keeps the name of the command, not of its path.
        assert_eq!(
            <ChannelGroupSchedule as RmControl>::NAME,
            "NVA06C_CTRL_CMD_GPFIFO_SCHEDULE"
        );
        assert_eq!(
            <sys::NV2080_CTRL_GPU_GET_ID_PARAMS as RmControl>::CMD,
            0x2080_0142
        );
    }

    /// Each vendored control's number is the one NVIDIA's header defines under its name, and the header derives
    /// it from the message id of the parameter struct the table binds (finn's "Evaluated from" note).
    #[test]
    fn bindings_match_nvidias_headers() {
        let defines = header_defines();
        // Not among the vendored headers: their numbers and sizes as ctrl0000client.h and ctrl2080ce.h give them.
        let elsewhere: HashMap<&str, (u32, usize)> = HashMap::from([
            ("NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO", (0xd02, 16)),
            ("NV0000_CTRL_CMD_CLIENT_GET_ACCESS_RIGHTS", (0xd03, 12)),
            ("NV0000_CTRL_CMD_CLIENT_GET_CHILD_HANDLE", (0xd05, 12)),
            ("NV2080_CTRL_CMD_CE_GET_CE_PCE_MASK", (0x2080_2a02, 8)),
        ]);
        let mut seen_elsewhere = 0;
        for b in BINDINGS {
            if let Some(&(cmd, size)) = elsewhere.get(b.name) {
                assert!(!defines.contains_key(b.name), "{} is vendored now", b.name);
                assert_eq!((b.cmd, b.size), (cmd, size), "{}", b.name);
                seen_elsewhere += 1;
                continue;
            }
            let value = defines
                .get(b.name)
                .unwrap_or_else(|| panic!("{} is not in the vendored headers", b.name));
            assert_eq!(leading_number(value), b.cmd, "{}", b.name);
            let message_id = format!("{}_MESSAGE_ID", b.params);
            assert!(
                value.contains(&format!("| {message_id}\"")),
                "{} does not take {}: {value}",
                b.name,
                b.params
            );
            let id = defines
                .get(&message_id)
                .unwrap_or_else(|| panic!("no {message_id}"));
            assert_eq!(leading_number(id), b.cmd & 0xff, "{message_id}");
            assert!(b.size > 0, "{}", b.name);
        }
        assert_eq!(seen_elsewhere, elsewhere.len());
    }

    #[test]
    fn names_are_the_last_path_segment() {
        assert_eq!(
            last_segment("sys::NV2080_CTRL_CMD_GPU_GET_ID"),
            "NV2080_CTRL_CMD_GPU_GET_ID"
        );
        assert_eq!(
            last_segment("sys :: NVA06C_CTRL_CMD_X"),
            "NVA06C_CTRL_CMD_X"
        );
        assert_eq!(last_segment("LOCAL"), "LOCAL");
    }
}
