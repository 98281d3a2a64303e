//! The RM client: root client, device, subdevice, class list, GPU info, memory, CPU and GPU mappings, peers.
//! Every RM object is an RAII handle freed on drop, children before parents.
//!
//! The client makes its RM and UVM calls through a transport: the kernel driver's ioctls on /dev/nvidiactl,
//! /dev/nvidiaN and /dev/nvidia-uvm (NVIDIA open kernel module ABI, branch 580), or the in-process RM of
//! [`sim`], which CI runs without a GPU.

pub mod attach;
mod client;
mod control;
mod domain;
mod engine;
mod error;
mod gpu;
mod hardware;
mod ioctl;
mod mapping;
mod memory;
mod peer;
pub mod sim;
mod status;
mod transport;
// Generated bindings (bindgen, build/rmdefs.rs): NVIDIA's names, documented by NVIDIA's headers.
#[allow(missing_docs)]
pub mod sys;
mod va;

pub use client::{Client, Handle, Object, live_objects};
pub use control::{ChannelGroupSchedule, RmControl};
pub use engine::{
    COPY_ALLOC_VERSION_ENGINE_TYPE, COPY_ALLOC_VERSION_INSTANCE, CopyAllocParams, MAX_LCES,
    copy_engine_type, lce_of_engine_type,
};
pub use error::{Error, Result};
pub(crate) use gpu::NotifierWords;
pub use gpu::{
    Attachment, GpuCore, GpuInfo, HEADERS_BRANCH, USERMODE_CLASSES, USERMODE_SIZE, format_uuid,
};
pub use mapping::CpuMapping;
pub use memory::{Memory, MemoryDesc, Placement};
pub use peer::{PeerCaps, PeerLink};
pub use status::NvStatus;
pub use va::VaRegion;
