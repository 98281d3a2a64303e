//! The RM client: ioctls on /dev/nvidiactl, /dev/nvidiaN and /dev/nvidia-uvm (NVIDIA open kernel module ABI,
//! branch 580). Root client, device, subdevice, class list, GPU info, memory, CPU and GPU mappings. Every RM
//! object is an RAII handle freed on drop, children before parents.

pub mod attach;
mod client;
mod error;
mod gpu;
mod ioctl;
mod memory;
mod peer;
pub mod sim;
mod status;
// Generated bindings (bindgen, build/rmdefs.rs): NVIDIA's names, documented by NVIDIA's headers.
#[allow(missing_docs)]
pub mod sys;
mod va;

pub use client::{Client, Handle, Object, live_objects};
pub use error::{Error, Result};
pub use gpu::{
    Attachment, GpuCore, GpuInfo, HEADERS_BRANCH, USERMODE_CLASSES, USERMODE_SIZE, format_uuid,
};
pub use memory::{CpuMapping, Memory, MemoryDesc, Placement};
pub use peer::{PeerCaps, PeerLink};
pub use status::NvStatus;
pub use va::VaRegion;
