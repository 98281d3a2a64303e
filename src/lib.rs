//! APEX: launch work on NVIDIA GPUs by talking to the kernel driver directly.
//!
//! Layers, lowest first: [`rm`] (RM client over ioctls) → [`gpfifo`] (our own channel, ring and doorbell)
//! → [`pushbuf`] (method encoding and decoding) → [`launch`] (cubins, QMDs, kernel launches).
//! [`hw`] holds the class tables generated from NVIDIA's headers; it is data, not a layer.

mod api;
pub mod bench;
pub mod driver;
pub mod gpfifo;
pub mod hw;
pub mod launch;
pub mod pushbuf;
mod report;
pub mod rm;
pub mod sim;

pub use api::{
    Backend, BackendRequest, Buffer, DeviceInfo, Error, FallbackReason, Fence, Global, Gpu,
    HostBuffer, Kernel, Module, Queue, Result, Selection, StreamWatch, choose,
};
pub use launch::{Arg, LaunchConfig};
pub use report::error_report;
