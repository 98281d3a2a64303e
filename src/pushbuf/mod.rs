//! Pushbuffers: method encoding for the host, compute and copy classes, semaphores, a decoder, and the
//! queue that submits them through our channel.

mod armed;
pub mod decode;
mod encode;
mod queue;

pub use armed::Armed;
pub use encode::{
    Acquire, END_SEGMENT, Header, MAX_COUNT, MAX_IMMEDIATE, Overflow, Push, Release, Subchannel,
    header, immediate,
};
pub use queue::{Error, Fence, Queue, QueueConfig, Result, Signal, Submission};
