//! Names of RM escapes, classes, control commands and UVM ioctls, for the records.

use apex::rm::sys;

include!(concat!(env!("OUT_DIR"), "/names.rs"));

fn lookup(table: &'static [(u32, &'static str)], value: u32) -> Option<&'static str> {
    table
        .binary_search_by_key(&value, |&(v, _)| v)
        .ok()
        .map(|i| table[i].1)
}

/// `RM_ALLOC` for escape 43 (`NV_ESC_` stripped).
pub fn escape(nr: u32) -> Option<&'static str> {
    lookup(ESCAPES, nr)
}

/// `NV2080_CTRL_CMD_GR_GET_INFO` for 0x20801201.
pub fn ctrl_cmd(cmd: u32) -> Option<&'static str> {
    lookup(CTRL_CMDS, cmd)
}

/// `UVM_REGISTER_GPU` for its command number.
pub fn uvm_ioctl(cmd: u32) -> Option<&'static str> {
    lookup(UVM_IOCTLS, cmd)
}

/// The classes APEX knows (the `apex::rm::sys` class constants), plus the few CUDA allocates that
/// the bindings do not name.
static CLASSES: &[(u32, &str)] = &[
    (0x0000, "NV01_ROOT"),
    (0x0041, "NV01_ROOT_CLIENT"),
    (sys::NV01_MEMORY_SYSTEM, "NV01_MEMORY_SYSTEM"),
    (sys::NV01_MEMORY_LOCAL_USER, "NV01_MEMORY_LOCAL_USER"),
    (sys::NV01_MEMORY_VIRTUAL, "NV01_MEMORY_VIRTUAL"),
    (
        sys::NV01_MEMORY_SYSTEM_OS_DESCRIPTOR,
        "NV01_MEMORY_SYSTEM_OS_DESCRIPTOR",
    ),
    (0x0079, "NV01_EVENT_OS_EVENT"),
    (sys::NV01_DEVICE_0, "NV01_DEVICE_0"),
    (0x00de, "RM_USER_SHARED_DATA"),
    (sys::NV20_SUBDEVICE_0, "NV20_SUBDEVICE_0"),
    (0x2081, "NV2081_BINAPI"),
    (0x83de, "GT200_DEBUGGER"),
    (sys::FERMI_CONTEXT_SHARE_A, "FERMI_CONTEXT_SHARE_A"),
    (sys::FERMI_VASPACE_A, "FERMI_VASPACE_A"),
    (sys::KEPLER_CHANNEL_GROUP_A, "KEPLER_CHANNEL_GROUP_A"),
    (sys::KEPLER_CHANNEL_GPFIFO_A, "KEPLER_CHANNEL_GPFIFO_A"),
    (sys::VOLTA_USERMODE_A, "VOLTA_USERMODE_A"),
    (sys::VOLTA_CHANNEL_GPFIFO_A, "VOLTA_CHANNEL_GPFIFO_A"),
    (sys::TURING_USERMODE_A, "TURING_USERMODE_A"),
    (sys::TURING_CHANNEL_GPFIFO_A, "TURING_CHANNEL_GPFIFO_A"),
    (sys::AMPERE_USERMODE_A, "AMPERE_USERMODE_A"),
    (sys::AMPERE_CHANNEL_GPFIFO_A, "AMPERE_CHANNEL_GPFIFO_A"),
    (sys::AMPERE_DMA_COPY_A, "AMPERE_DMA_COPY_A"),
    (sys::AMPERE_COMPUTE_A, "AMPERE_COMPUTE_A"),
    (sys::HOPPER_USERMODE_A, "HOPPER_USERMODE_A"),
    (sys::AMPERE_DMA_COPY_B, "AMPERE_DMA_COPY_B"),
    (sys::AMPERE_COMPUTE_B, "AMPERE_COMPUTE_B"),
    (sys::HOPPER_CHANNEL_GPFIFO_A, "HOPPER_CHANNEL_GPFIFO_A"),
    (sys::HOPPER_DMA_COPY_A, "HOPPER_DMA_COPY_A"),
    (sys::BLACKWELL_USERMODE_A, "BLACKWELL_USERMODE_A"),
    (
        sys::BLACKWELL_CHANNEL_GPFIFO_A,
        "BLACKWELL_CHANNEL_GPFIFO_A",
    ),
    (sys::BLACKWELL_DMA_COPY_A, "BLACKWELL_DMA_COPY_A"),
    (sys::ADA_COMPUTE_A, "ADA_COMPUTE_A"),
    (
        sys::BLACKWELL_CHANNEL_GPFIFO_B,
        "BLACKWELL_CHANNEL_GPFIFO_B",
    ),
    (sys::BLACKWELL_DMA_COPY_B, "BLACKWELL_DMA_COPY_B"),
    (0xcb33, "NV_CONFIDENTIAL_COMPUTE"),
    (sys::HOPPER_COMPUTE_A, "HOPPER_COMPUTE_A"),
    (sys::BLACKWELL_COMPUTE_A, "BLACKWELL_COMPUTE_A"),
    (sys::BLACKWELL_COMPUTE_B, "BLACKWELL_COMPUTE_B"),
];

/// `HOPPER_CHANNEL_GPFIFO_A` for 0xc86f.
pub fn class(class: u32) -> Option<&'static str> {
    CLASSES.iter().find(|&&(c, _)| c == class).map(|&(_, n)| n)
}

/// GPFIFO channel classes whose allocation parameters are `NV_CHANNEL_ALLOC_PARAMS`.
pub fn is_gpfifo_class(class: u32) -> bool {
    [
        sys::AMPERE_CHANNEL_GPFIFO_A,
        sys::HOPPER_CHANNEL_GPFIFO_A,
        sys::BLACKWELL_CHANNEL_GPFIFO_A,
        sys::BLACKWELL_CHANNEL_GPFIFO_B,
    ]
    .contains(&class)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_sorted_and_named() {
        for t in [CTRL_CMDS, ESCAPES, UVM_IOCTLS] {
            assert!(t.windows(2).all(|w| w[0].0 < w[1].0));
        }
        assert_eq!(ctrl_cmd(0x2080_1201), Some("NV2080_CTRL_CMD_GR_GET_INFO"));
        assert_eq!(
            ctrl_cmd(0x0080_0292),
            Some("NV0080_CTRL_CMD_GPU_GET_CLASSLIST_V2")
        );
        assert_eq!(uvm_ioctl(sys::UVM_REGISTER_GPU), Some("UVM_REGISTER_GPU"));
        assert_eq!(uvm_ioctl(sys::UVM_INITIALIZE), Some("UVM_INITIALIZE"));
        assert_eq!(
            uvm_ioctl(sys::UVM_MAP_EXTERNAL_ALLOCATION),
            Some("UVM_MAP_EXTERNAL_ALLOCATION")
        );
        assert_eq!(escape(sys::NV_ESC_RM_ALLOC), Some("RM_ALLOC"));
        assert_eq!(escape(sys::NV_ESC_RM_MAP_MEMORY), Some("RM_MAP_MEMORY"));
        assert_eq!(class(0xc86f), Some("HOPPER_CHANNEL_GPFIFO_A"));
        assert!(is_gpfifo_class(0xc86f));
        assert!(!is_gpfifo_class(0xcbc0));
    }
}
