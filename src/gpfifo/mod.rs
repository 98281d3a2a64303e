//! Our own GPFIFO channel: channel group, context share, GPFIFO ring and USERD, work-submit token, the
//! usermode doorbell, and completion tracking through host-visible semaphores.
//!
//! Submitting is: write a GPFIFO entry, write GPPut to USERD, store fence, write the token to the doorbell.
//! No ioctl and no allocation on that path.

mod channel;
mod entry;
mod error;
mod pushspace;
mod ring;
mod timeline;

pub use channel::{
    Channel, ChannelClasses, ChannelConfig, ChannelFault, FaultWatch, MmuFault, SmError,
    prefetch_for_write,
};
pub use entry::GpEntry;
pub use error::{Error, Result};
pub use pushspace::PushSpace;
pub use ring::RingState;
pub use timeline::{Semaphores, Timeline, wait_until};

/// GPFIFO (host) classes, newest first: Blackwell B, Blackwell, Hopper, Ampere (also Ada).
pub const GPFIFO_CLASSES: &[u32] = &[0xca6f, 0xc96f, 0xc86f, 0xc56f];
/// Compute classes, newest first: Blackwell B, Blackwell, Hopper, Ada, Ampere B, Ampere.
pub const COMPUTE_CLASSES: &[u32] = &[0xcec0, 0xcdc0, 0xcbc0, 0xc9c0, 0xc7c0, 0xc6c0];
/// Copy-engine classes, newest first.
pub const COPY_CLASSES: &[u32] = &[0xcab5, 0xc9b5, 0xc8b5, 0xc7b5, 0xc6b5];
