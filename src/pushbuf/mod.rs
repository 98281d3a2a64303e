//! Pushbuffers: method encoding for the host, compute and copy classes, semaphores, a decoder, and the
//! queue that submits them through our channel.

mod armed;
pub mod decode;
mod encode;
mod error;
mod queue;

pub use armed::Armed;
pub use encode::{
    Acquire, END_SEGMENT, Header, MAX_COUNT, MAX_IMMEDIATE, Overflow, Push, Release, Subchannel,
    header, immediate,
};
pub use error::{Error, Result};
pub use queue::{Fence, Queue, QueueConfig, Signal, Submission};
