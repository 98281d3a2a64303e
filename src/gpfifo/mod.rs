//! Our own GPFIFO channel: channel group, context share, GPFIFO ring and USERD, work-submit token, the
//! usermode doorbell, and completion tracking through host-visible semaphores.
//!
//! Submitting is: write a GPFIFO entry, store fence, write GPPut to USERD, store fence, write the token to the
//! doorbell. No ioctl and no allocation on that path.
//!
//! The classes a channel is built with (GPFIFO, compute, copy engine) are the GPU's row of the generation table,
//! [`crate::hw::generation`].

mod channel;
mod entry;
mod error;
mod fault;
mod pushspace;
mod ring;
mod timeline;

pub use channel::{
    Channel, ChannelClasses, ChannelConfig, FaultWatch, MmuFault, prefetch_for_write,
};
pub use entry::GpEntry;
pub use error::{Error, Result};
pub use fault::{ChannelFault, SmError};
pub use pushspace::PushSpace;
pub use ring::RingState;
pub use timeline::{Semaphores, Timeline, wait_until};
