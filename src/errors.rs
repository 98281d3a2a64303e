//! The errors behind [`Error`](crate::Error): what each layer reports, as [`Error`](crate::Error)'s variants
//! carry them.
//!
//! [`Error::Direct`](crate::Error::Direct) holds a [`LaunchError`] (the direct path: launch checks, modules,
//! the channel and RM), [`Error::Driver`](crate::Error::Driver) a [`DriverError`] (a failed CUDA driver call)
//! and [`Error::NotPeers`](crate::Error::NotPeers) an [`RmError`]. The others are what those wrap. The layers
//! that define them are internal; these names are the documented paths.

pub use crate::driver::Error as DriverError;
pub use crate::gpfifo::ChannelFault;
pub use crate::gpfifo::Error as ChannelError;
pub use crate::hw::UnknownGeneration;
pub use crate::launch::Error as LaunchError;
pub use crate::launch::ParamError;
pub use crate::launch::graph::GraphError;
pub use crate::launch::qmd::QmdError;
pub use crate::module::Error as ModuleError;
pub use crate::module::cache::ModuleCacheAlreadySet;
pub use crate::module::cubin::CubinError;
pub use crate::module::fatbin::FatbinError;
pub use crate::module::image::ImageError;
pub use crate::pushbuf::Error as QueueError;
pub use crate::pushbuf::Overflow;
pub use crate::rm::Error as RmError;
pub use crate::rm::NvStatus;
