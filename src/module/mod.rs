//! Module loading: a module's bytes (cubin, fatbin, host binary, PTX) to the best code for the GPU, parsed, linked
//! (with APEX's `printf`/`assert` runtime when the module calls it) and uploaded into GPU memory; its kernels and
//! variables looked up by name.
//!
//! This layer sits on [`rm`](crate::rm) (GPU memory for images and the printf FIFO) and nothing else of APEX; the
//! launch layer ([`launch`](crate::launch)) uses it. Inside, lowest first (`a -> b`: a uses b):
//!
//! ```text
//! payload       -> (nothing)           (a module's code bytes: owned, or a mapped cache entry)
//! cache         -> payload             (decompressed payloads on disk)
//! cubin         -> payload
//! fatbin        -> cache
//! select        -> cubin, fatbin
//! jit           -> select, cache
//! image         -> cubin, fatbin, select, jit
//! printf        -> cubin
//! loaded        -> cubin, image, jit, printf  (Module, Kernel, Global)
//! ```

pub mod cache;
pub mod cubin;
pub mod fatbin;
pub mod image;
pub mod jit;
mod loaded;
pub mod payload;
pub mod printf;
pub mod select;

pub(crate) use loaded::newest_generation;
pub use loaded::{Global, Kernel, Module, VariableHome};

/// Errors of loading a module and looking up its kernels and variables.
#[derive(thiserror::Error, Debug)]
#[non_exhaustive]
pub enum Error {
    /// RM failed (allocating or writing the module's image or the printf FIFO). Through
    /// [`launch::Error`](crate::launch::Error) it reads as [`launch::Error::Queue`](crate::launch::Error::Queue), as
    /// every RM error of the launch layer does.
    #[error(transparent)]
    Rm(#[from] crate::rm::Error),
    /// The cubin could not be parsed or loaded.
    #[error(transparent)]
    Cubin(#[from] cubin::CubinError),
    /// The fatbin could not be parsed.
    #[error(transparent)]
    Fatbin(#[from] fatbin::FatbinError),
    /// No cubin for the device could be had from a module's bytes (nothing fits, PTX did not compile, ...).
    /// Boxed: compiler logs make it the largest error.
    #[error(transparent)]
    Image(Box<image::ImageError>),
    /// The kernel calls an external device function the direct path does not provide (`malloc`, dynamic
    /// parallelism); the module's other kernels run.
    #[error("kernel `{kernel}` cannot run on the direct path: {reason}")]
    KernelRefused {
        /// The kernel.
        kernel: String,
        /// What it calls.
        reason: cubin::CubinError,
    },
    /// [`Module::kernel`] found no kernel of that name.
    #[error(
        "no kernel `{name}` in the module (it has: {}); use one of those names (mangled or demangled)",
        available.join(", ")
    )]
    NoSuchKernel {
        /// The name asked for.
        name: String,
        /// The module's kernels.
        available: Vec<String>,
    },
    /// [`Module::global`] found no variable of that name.
    #[error(
        "no global variable `{name}` in the module ({})",
        globals_list(available)
    )]
    NoSuchGlobal {
        /// The name asked for.
        name: String,
        /// The module's `__device__` and `__constant__` variables.
        available: Vec<String>,
    },
    /// A home was given for a variable whose name more than one of the module's variables have (module-local
    /// variables of the objects it was linked from): a name cannot say which of them the home is for.
    #[error(
        "the module has {count} variables named `{name}` (module-local variables of the objects it was linked \
         from): a home given by name cannot say which of them it is for; give none for that name"
    )]
    AmbiguousGlobal {
        /// The name.
        name: String,
        /// How many of the module's variables have it.
        count: usize,
    },
    /// A copy to or from a module variable outside it.
    #[error(
        "{bytes} bytes at offset {offset} of the global `{name}`, which has {size} bytes: the copy would leave the variable"
    )]
    GlobalRange {
        /// The variable.
        name: String,
        /// Its size.
        size: u64,
        /// Where the copy starts inside it.
        offset: u64,
        /// Bytes copied.
        bytes: u64,
    },
}

/// The variable list of [`Error::NoSuchGlobal`].
fn globals_list(available: &[String]) -> String {
    if available.is_empty() {
        "it has no `__device__` or `__constant__` variables".into()
    } else {
        format!("it has: {}", available.join(", "))
    }
}

impl From<image::ImageError> for Error {
    fn from(e: image::ImageError) -> Error {
        Error::Image(Box::new(e))
    }
}

/// The module layer's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
