//! PTX, and relocatable cubins (`nvcc -rdc=true`), made into an executable cubin for the device's exact
//! architecture by NVIDIA's nvJitLink, which is loaded at run time (it ships with the CUDA toolkit, not the
//! driver), with an on-disk cache so each module is compiled once per compiler version and architecture.
//!
//! The library is looked for, in order: the file `$APEX_NVJITLINK` names (and nothing else when it is set);
//! `lib64/` and `targets/x86_64-linux/lib/` under `$CUDA_PATH`, `$CUDA_HOME` and `/usr/local/cuda`; then the
//! dynamic loader's own search (`LD_LIBRARY_PATH`, `ldconfig`), each as `libnvJitLink.so.13` then
//! `libnvJitLink.so`.
//!
//! The cache is `$APEX_CACHE_DIR` (empty: no cache), else `$XDG_CACHE_HOME/apex`, else `~/.cache/apex`; none
//! under `APEX_CACHE_DISABLE=1` (the [`cache`](super::cache) of decompressed payloads shares the directory). An entry
//! is named by an XXH3-128 hash of the compiler's name and version, the architecture, the input's kind and its
//! bytes; it holds the cubin with its length and hash, is written to a temporary file and renamed into place (so
//! readers never see half of one), and is ignored and rewritten when it does not check out.
//!
//! [`Compiler`] is the seam: [`Jit::new`] takes any implementation (tests give one that needs no CUDA toolkit);
//! [`Jit::system`] uses nvJitLink.

use std::ffi::{CString, OsString, c_char, c_int, c_void};
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use object::LittleEndian;
use object::elf;
use object::read::elf::FileHeader;
use tracing::{debug, warn};

use super::cache::{DIR_ENV, cache_root};

/// Names the nvJitLink library to load, overriding the search.
pub const LIBRARY_ENV: &str = "APEX_NVJITLINK";
/// Names the cache directory (empty: no cache).
pub const CACHE_ENV: &str = DIR_ENV;
/// File names of the library, newest first.
pub const LIBRARY_NAMES: [&str; 2] = ["libnvJitLink.so.13", "libnvJitLink.so"];
/// Most bytes of compiled cubin or log accepted from the library.
const MAX_OUTPUT: usize = 1 << 30;
const CACHE_MAGIC: &[u8; 8] = b"APEXJIT\x01";
/// Magic, cubin length, cubin hash.
const CACHE_HEADER: usize = 8 + 8 + 16;

/// What is given to the compiler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InputKind {
    /// PTX text.
    Ptx,
    /// A relocatable cubin (`ET_REL`).
    RelocatableCubin,
}

impl InputKind {
    /// `nvJitLinkInputType` (nvJitLink.h: `NVJITLINK_INPUT_CUBIN` 1, `NVJITLINK_INPUT_PTX` 2).
    fn raw(self) -> c_int {
        match self {
            InputKind::RelocatableCubin => 1,
            InputKind::Ptx => 2,
        }
    }

    fn tag(self) -> &'static str {
        match self {
            InputKind::Ptx => "ptx",
            InputKind::RelocatableCubin => "rel",
        }
    }
}

impl fmt::Display for InputKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            InputKind::Ptx => "PTX",
            InputKind::RelocatableCubin => "relocatable cubin",
        })
    }
}

/// Why code could not be compiled or linked.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum JitError {
    /// No nvJitLink library could be loaded.
    #[error(
        "{library} (NVIDIA's nvJitLink, which compiles PTX for the direct path) could not be loaded; tried {}. \
         Install the CUDA toolkit (13.x), or set {LIBRARY_ENV} to the library's path",
        tried.join(", ")
    )]
    LibraryNotFound {
        /// The library looked for.
        library: String,
        /// Every path or loader name tried, in order.
        tried: Vec<String>,
    },
    /// The library loaded but lacks a function APEX calls.
    #[error(
        "{path} has no {symbol}: it is not an nvJitLink library APEX can use (CUDA 12.4 or newer is needed)"
    )]
    MissingSymbol {
        /// The library.
        path: String,
        /// The function.
        symbol: String,
    },
    /// The compiler refused the input; its log says why.
    #[error("{compiler} could not compile the {input} for {arch} ({code}):\n{log}")]
    CompileFailed {
        /// The compiler and its version.
        compiler: String,
        /// What was compiled.
        input: InputKind,
        /// The target architecture.
        arch: String,
        /// The error code, by name.
        code: String,
        /// The compiler's error log.
        log: String,
    },
    /// A library call failed outside compilation.
    #[error("{function} failed with {code}")]
    Call {
        /// The function.
        function: &'static str,
        /// The error code, by name.
        code: String,
    },
    /// The compiler returned something that is not an executable cubin.
    #[error("{compiler} returned {size} bytes for {arch} that are not an executable cubin")]
    BadOutput {
        /// The compiler and its version.
        compiler: String,
        /// The target architecture.
        arch: String,
        /// Bytes returned.
        size: usize,
    },
}

/// Compiles PTX, or links a relocatable cubin, into an executable cubin. Implementations must be deterministic
/// for a given [`Compiler::identity`]: results are cached under it.
pub trait Compiler: Send + Sync + fmt::Debug {
    /// The compiler's name and version, part of every cache key (`nvJitLink 13.0`).
    fn identity(&self) -> String;

    /// An executable cubin for `arch` (`sm_90`, `sm_90a`) from `input` alone.
    fn compile(&self, kind: InputKind, input: &[u8], arch: &str) -> Result<Vec<u8>, JitError>;
}

/// Compiles through a [`Compiler`] (found on first need) and a [`Cache`].
pub struct Jit {
    compiler: OnceLock<Result<Arc<dyn Compiler>, JitError>>,
    find: fn() -> Result<Arc<dyn Compiler>, JitError>,
    cache: Cache,
}

impl fmt::Debug for Jit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Jit")
            .field("compiler", &self.compiler.get())
            .field("cache", &self.cache)
            .finish()
    }
}

impl Jit {
    /// nvJitLink (loaded on first use, once per process) and the cache the environment names.
    pub fn system() -> &'static Jit {
        static SYSTEM: OnceLock<Jit> = OnceLock::new();
        SYSTEM.get_or_init(|| {
            Jit::lazy(
                || NvJitLink::load().map(|l| Arc::new(l) as Arc<dyn Compiler>),
                Cache::from_env(),
            )
        })
    }

    /// `compiler` with `cache`.
    pub fn new(compiler: Arc<dyn Compiler>, cache: Cache) -> Jit {
        let cell = OnceLock::new();
        let _ = cell.set(Ok(compiler));
        Jit {
            compiler: cell,
            find: unreachable_compiler,
            cache,
        }
    }

    /// The compiler `find` returns, called on first need (its error, such as a missing library, is kept and
    /// returned on every use), with `cache`.
    pub fn lazy(find: fn() -> Result<Arc<dyn Compiler>, JitError>, cache: Cache) -> Jit {
        Jit {
            compiler: OnceLock::new(),
            find,
            cache,
        }
    }

    /// The compiler, found on first call.
    pub fn compiler(&self) -> Result<&Arc<dyn Compiler>, JitError> {
        self.compiler
            .get_or_init(self.find)
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The cache.
    pub fn cache(&self) -> &Cache {
        &self.cache
    }

    /// An executable cubin for `arch` from `input`: from the cache if it holds a sound one, else compiled and
    /// stored (a cache that cannot be written is logged and skipped).
    pub fn compile(&self, kind: InputKind, input: &[u8], arch: &str) -> Result<Vec<u8>, JitError> {
        let compiler = self.compiler()?;
        let identity = compiler.identity();
        let key = Cache::key(&identity, kind, arch, input);
        if let Some(cubin) = self.cache.load(&key) {
            if is_executable_cubin(&cubin) {
                debug!(key, "JIT cache hit");
                return Ok(cubin);
            }
            warn!(
                key,
                "JIT cache entry is not an executable cubin; compiling again"
            );
        }
        let started = std::time::Instant::now();
        let cubin = compiler.compile(kind, input, arch)?;
        if !is_executable_cubin(&cubin) {
            return Err(JitError::BadOutput {
                compiler: identity,
                arch: arch.to_owned(),
                size: cubin.len(),
            });
        }
        debug!(%identity, %kind, arch, bytes = cubin.len(), elapsed = ?started.elapsed(), "compiled");
        if let Err(e) = self.cache.store(&key, &cubin) {
            warn!(key, error = %e, "JIT cache entry not written");
        }
        Ok(cubin)
    }
}

/// [`Jit::new`] sets the compiler before anything can ask for it.
fn unreachable_compiler() -> Result<Arc<dyn Compiler>, JitError> {
    Err(JitError::Call {
        function: "Jit::compiler",
        code: "no compiler".into(),
    })
}

/// Whether `bytes` are a 64-bit little-endian CUDA ELF of type `ET_EXEC`.
fn is_executable_cubin(bytes: &[u8]) -> bool {
    elf::FileHeader64::<LittleEndian>::parse(bytes)
        .ok()
        .and_then(|h| {
            let endian = h.endian().ok()?;
            Some(h.e_machine(endian) == elf::EM_CUDA && h.e_type(endian) == elf::ET_EXEC)
        })
        .unwrap_or(false)
}

/// Compiled cubins on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cache {
    dir: Option<PathBuf>,
}

impl Cache {
    /// The directory the environment names (see the module's documentation), or no cache.
    pub fn from_env() -> Cache {
        Cache {
            dir: Cache::dir_from(|name| std::env::var_os(name)),
        }
    }

    /// The cache directory given environment variables read through `var`: none under `APEX_CACHE_DISABLE=1`;
    /// `APEX_CACHE_DIR` (empty: none), else `$XDG_CACHE_HOME/apex`, else `$HOME/.cache/apex`. The module cache
    /// lives in `modules/` under the same directory ([`cache_root`]).
    pub fn dir_from(var: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
        cache_root(var)
    }

    /// A cache in `dir` (created when first written).
    pub fn at(dir: impl Into<PathBuf>) -> Cache {
        Cache {
            dir: Some(dir.into()),
        }
    }

    /// No cache: every compile runs the compiler.
    pub fn disabled() -> Cache {
        Cache { dir: None }
    }

    /// The directory, if caching.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The entry name for `input` compiled by `identity` for `arch`.
    pub fn key(identity: &str, kind: InputKind, arch: &str, input: &[u8]) -> String {
        let mut h = twox_hash::XxHash3_128::new();
        // Lengths first, so no two different field splits hash the same bytes.
        for field in [identity.as_bytes(), kind.tag().as_bytes(), arch.as_bytes()] {
            h.write(&(field.len() as u64).to_le_bytes());
            h.write(field);
        }
        h.write(&(input.len() as u64).to_le_bytes());
        h.write(input);
        let arch: String = arch
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        format!("{arch}-{}-{:032x}", kind.tag(), h.finish_128())
    }

    /// Where the entry `key` lives.
    pub fn path(&self, key: &str) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join(format!("{key}.cubin")))
    }

    /// The cubin stored under `key`, if there is one and it checks out (magic, length, hash).
    pub fn load(&self, key: &str) -> Option<Vec<u8>> {
        let path = self.path(key)?;
        let bytes = std::fs::read(&path).ok()?;
        let cubin = unwrap_entry(&bytes);
        if cubin.is_none() {
            warn!(path = %path.display(), "corrupt JIT cache entry ignored");
        }
        cubin.map(<[u8]>::to_vec)
    }

    /// Stores `cubin` under `key`: written to a temporary file in the same directory, then renamed over the entry.
    pub fn store(&self, key: &str, cubin: &[u8]) -> std::io::Result<()> {
        static UNIQUE: AtomicU64 = AtomicU64::new(0);
        let (Some(dir), Some(path)) = (self.dir.as_ref(), self.path(key)) else {
            return Ok(());
        };
        std::fs::create_dir_all(dir)?;
        let tmp = dir.join(format!(
            ".{key}.{}.{}.tmp",
            std::process::id(),
            UNIQUE.fetch_add(1, Ordering::Relaxed)
        ));
        let written = (|| {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(CACHE_MAGIC)?;
            f.write_all(&(cubin.len() as u64).to_le_bytes())?;
            f.write_all(&twox_hash::XxHash3_128::oneshot(cubin).to_le_bytes())?;
            f.write_all(cubin)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        })();
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written
    }
}

/// The cubin in a cache file, if its header matches it.
fn unwrap_entry(bytes: &[u8]) -> Option<&[u8]> {
    let (header, cubin) = bytes.split_at_checked(CACHE_HEADER)?;
    let (magic, rest) = header.split_at(8);
    let (len, hash) = rest.split_at(8);
    let len = u64::from_le_bytes(len.try_into().ok()?);
    let hash = u128::from_le_bytes(hash.try_into().ok()?);
    (magic == CACHE_MAGIC
        && len == cubin.len() as u64
        && hash == twox_hash::XxHash3_128::oneshot(cubin))
    .then_some(cubin)
}

/// Where nvJitLink is looked for, in order, given environment variables read through `var` (see the module's
/// documentation).
pub fn library_candidates(var: impl Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    if let Some(path) = var(LIBRARY_ENV).filter(|v| !v.is_empty()) {
        return vec![PathBuf::from(path)];
    }
    let mut roots: Vec<PathBuf> = ["CUDA_PATH", "CUDA_HOME"]
        .into_iter()
        .filter_map(|name| var(name).filter(|v| !v.is_empty()).map(PathBuf::from))
        .collect();
    roots.push(PathBuf::from("/usr/local/cuda"));
    let mut out = Vec::new();
    for root in roots {
        for dir in ["lib64", "targets/x86_64-linux/lib"] {
            for name in LIBRARY_NAMES {
                let path = root.join(dir).join(name);
                if !out.contains(&path) {
                    out.push(path);
                }
            }
        }
    }
    // Bare names: the dynamic loader searches its own path.
    out.extend(LIBRARY_NAMES.map(PathBuf::from));
    out
}

type Handle = *mut c_void;
type CreateFn = unsafe extern "C" fn(*mut Handle, u32, *const *const c_char) -> c_int;
type DestroyFn = unsafe extern "C" fn(*mut Handle) -> c_int;
type AddDataFn = unsafe extern "C" fn(Handle, c_int, *const c_void, usize, *const c_char) -> c_int;
type CompleteFn = unsafe extern "C" fn(Handle) -> c_int;
type SizeFn = unsafe extern "C" fn(Handle, *mut usize) -> c_int;
type BytesFn = unsafe extern "C" fn(Handle, *mut c_void) -> c_int;
type LogFn = unsafe extern "C" fn(Handle, *mut c_char) -> c_int;
type VersionFn = unsafe extern "C" fn(*mut u32, *mut u32) -> c_int;

/// `nvJitLinkResult` names (nvJitLink.h, CUDA 13.0).
fn result_name(code: c_int) -> String {
    const NAMES: [&str; 19] = [
        "NVJITLINK_SUCCESS",
        "NVJITLINK_ERROR_UNRECOGNIZED_OPTION",
        "NVJITLINK_ERROR_MISSING_ARCH",
        "NVJITLINK_ERROR_INVALID_INPUT",
        "NVJITLINK_ERROR_PTX_COMPILE",
        "NVJITLINK_ERROR_NVVM_COMPILE",
        "NVJITLINK_ERROR_INTERNAL",
        "NVJITLINK_ERROR_THREADPOOL",
        "NVJITLINK_ERROR_UNRECOGNIZED_INPUT",
        "NVJITLINK_ERROR_FINALIZE",
        "NVJITLINK_ERROR_NULL_INPUT",
        "NVJITLINK_ERROR_INCOMPATIBLE_OPTIONS",
        "NVJITLINK_ERROR_INCORRECT_INPUT_TYPE",
        "NVJITLINK_ERROR_ARCH_MISMATCH",
        "NVJITLINK_ERROR_OUTDATED_LIBRARY",
        "NVJITLINK_ERROR_MISSING_FATBIN",
        "NVJITLINK_ERROR_UNRECOGNIZED_ARCH",
        "NVJITLINK_ERROR_UNSUPPORTED_ARCH",
        "NVJITLINK_ERROR_LTO_NOT_ENABLED",
    ];
    usize::try_from(code)
        .ok()
        .and_then(|i| NAMES.get(i))
        .map_or_else(|| format!("nvJitLinkResult {code}"), |n| (*n).to_owned())
}

/// NVIDIA's nvJitLink, loaded at run time. Each compile uses a handle of its own, which nvJitLink allows from
/// any number of threads at once.
#[derive(Debug)]
pub struct NvJitLink {
    path: String,
    version: (u32, u32),
    create: CreateFn,
    destroy: DestroyFn,
    add_data: AddDataFn,
    complete: CompleteFn,
    cubin_size: SizeFn,
    cubin: BytesFn,
    error_log_size: SizeFn,
    error_log: LogFn,
    info_log_size: SizeFn,
    info_log: LogFn,
    /// Kept loaded for as long as the function pointers above are used.
    _library: libloading::Library,
}

impl NvJitLink {
    /// Loads the first library [`library_candidates`] finds.
    pub fn load() -> Result<NvJitLink, JitError> {
        let mut tried = Vec::new();
        for candidate in library_candidates(|name| std::env::var_os(name)) {
            // SAFETY: loading a shared library runs its initializers; nvJitLink's have no preconditions.
            match unsafe { libloading::Library::new(&candidate) } {
                Ok(library) => return NvJitLink::from_library(library, &candidate),
                Err(e) => {
                    debug!(path = %candidate.display(), error = %e, "nvJitLink not loaded");
                    tried.push(candidate.display().to_string());
                }
            }
        }
        Err(JitError::LibraryNotFound {
            library: LIBRARY_NAMES[0].to_owned(),
            tried,
        })
    }

    fn from_library(library: libloading::Library, path: &Path) -> Result<NvJitLink, JitError> {
        let path = path.display().to_string();
        let version_fn: VersionFn = symbol(&library, &path, "nvJitLinkVersion", None)?;
        let (mut major, mut minor) = (0u32, 0u32);
        // SAFETY: two out-pointers to locals.
        let r = unsafe { version_fn(&mut major, &mut minor) };
        if r != 0 {
            return Err(JitError::Call {
                function: "nvJitLinkVersion",
                code: result_name(r),
            });
        }
        let v = Some((major, minor));
        let lib = &library;
        let linker = NvJitLink {
            create: symbol(lib, &path, "nvJitLinkCreate", v)?,
            destroy: symbol(lib, &path, "nvJitLinkDestroy", v)?,
            add_data: symbol(lib, &path, "nvJitLinkAddData", v)?,
            complete: symbol(lib, &path, "nvJitLinkComplete", v)?,
            cubin_size: symbol(lib, &path, "nvJitLinkGetLinkedCubinSize", v)?,
            cubin: symbol(lib, &path, "nvJitLinkGetLinkedCubin", v)?,
            error_log_size: symbol(lib, &path, "nvJitLinkGetErrorLogSize", v)?,
            error_log: symbol(lib, &path, "nvJitLinkGetErrorLog", v)?,
            info_log_size: symbol(lib, &path, "nvJitLinkGetInfoLogSize", v)?,
            info_log: symbol(lib, &path, "nvJitLinkGetInfoLog", v)?,
            path,
            version: (major, minor),
            _library: library,
        };
        debug!(path = %linker.path, major, minor, "nvJitLink loaded");
        Ok(linker)
    }

    /// The library's file.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The library's version (major, minor).
    pub fn version(&self) -> (u32, u32) {
        self.version
    }

    /// A log through its size and text functions; empty if they fail.
    fn log(&self, handle: Handle, size_fn: SizeFn, text_fn: LogFn) -> String {
        let mut size = 0usize;
        // SAFETY: a live handle and an out-pointer to a local.
        if unsafe { size_fn(handle, &mut size) } != 0 || size == 0 || size > MAX_OUTPUT {
            return String::new();
        }
        let mut buf = vec![0u8; size];
        // SAFETY: the buffer holds the `size` bytes (NUL included) the library said the log takes.
        if unsafe { text_fn(handle, buf.as_mut_ptr().cast()) } != 0 {
            return String::new();
        }
        String::from_utf8_lossy(super::select::trim_nuls(&buf))
            .trim_end()
            .to_owned()
    }
}

/// A function of the library: unversioned, then under the versioned names nvJitLink.h maps it to
/// (`__nvJitLinkCreate_13_0`), which older libraries export alone.
fn symbol<T: Copy>(
    library: &libloading::Library,
    path: &str,
    name: &str,
    version: Option<(u32, u32)>,
) -> Result<T, JitError> {
    let mut names = vec![name.to_owned()];
    if let (Some((major, minor)), Some(rest)) = (version, name.strip_prefix("nvJitLink")) {
        names.push(format!("__nvJitLink{rest}_{major}_{minor}"));
        names.push(format!("__nvJitLink{rest}_{major}_0"));
    }
    for n in &names {
        // SAFETY: T is the function's type as nvJitLink.h declares it (the callers name the matching alias); the
        // pointer is used only while `library`, which the caller keeps beside it, stays loaded.
        if let Ok(f) = unsafe { library.get::<T>(n.as_bytes()) } {
            return Ok(*f);
        }
    }
    Err(JitError::MissingSymbol {
        path: path.to_owned(),
        symbol: name.to_owned(),
    })
}

/// Destroys an nvJitLink handle when dropped.
struct HandleGuard<'a> {
    linker: &'a NvJitLink,
    handle: Handle,
}

impl Drop for HandleGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: the handle came from nvJitLinkCreate and is destroyed once.
        let _ = unsafe { (self.linker.destroy)(&mut self.handle) };
    }
}

impl Compiler for NvJitLink {
    fn identity(&self) -> String {
        format!("nvJitLink {}.{}", self.version.0, self.version.1)
    }

    fn compile(&self, kind: InputKind, input: &[u8], arch: &str) -> Result<Vec<u8>, JitError> {
        let call = |function: &'static str, code: c_int| JitError::Call {
            function,
            code: result_name(code),
        };
        let option =
            CString::new(format!("-arch={arch}")).map_err(|_| call("nvJitLinkCreate", 1))?;
        let options = [option.as_ptr()];
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: an out-pointer to a local and one NUL-terminated option, both alive for the call.
        let r = unsafe { (self.create)(&mut handle, 1, options.as_ptr()) };
        if r != 0 {
            return Err(call("nvJitLinkCreate", r));
        }
        let guard = HandleGuard {
            linker: self,
            handle,
        };
        // PTX goes in as a C string.
        let data: Vec<u8> = match kind {
            InputKind::Ptx => [super::select::trim_nuls(input), &[0]].concat(),
            InputKind::RelocatableCubin => input.to_vec(),
        };
        let failed = |r: c_int| JitError::CompileFailed {
            compiler: self.identity(),
            input: kind,
            arch: arch.to_owned(),
            code: result_name(r),
            log: self.log(guard.handle, self.error_log_size, self.error_log),
        };
        // SAFETY: a live handle; `data` and the NUL-terminated name outlive the link (dropped after Complete).
        let r = unsafe {
            (self.add_data)(
                guard.handle,
                kind.raw(),
                data.as_ptr().cast(),
                data.len(),
                c"apex-module".as_ptr(),
            )
        };
        if r != 0 {
            return Err(failed(r));
        }
        // SAFETY: a live handle with its input added.
        let r = unsafe { (self.complete)(guard.handle) };
        if r != 0 {
            return Err(failed(r));
        }
        let info = self.log(guard.handle, self.info_log_size, self.info_log);
        if !info.is_empty() {
            debug!(%info, "nvJitLink info log");
        }
        let mut size = 0usize;
        // SAFETY: a completed handle and an out-pointer to a local.
        let r = unsafe { (self.cubin_size)(guard.handle, &mut size) };
        if r != 0 {
            return Err(call("nvJitLinkGetLinkedCubinSize", r));
        }
        if size > MAX_OUTPUT {
            return Err(JitError::BadOutput {
                compiler: self.identity(),
                arch: arch.to_owned(),
                size,
            });
        }
        let mut cubin = vec![0u8; size];
        // SAFETY: the buffer holds the `size` bytes the library said the cubin takes.
        let r = unsafe { (self.cubin)(guard.handle, cubin.as_mut_ptr().cast()) };
        if r != 0 {
            return Err(call("nvJitLinkGetLinkedCubin", r));
        }
        drop(data);
        Ok(cubin)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
        move |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| OsString::from(v))
        }
    }

    #[test]
    fn library_search_order() {
        let paths = |vars: &[(&str, &str)]| -> Vec<String> {
            library_candidates(env(vars))
                .iter()
                .map(|p| p.display().to_string())
                .collect()
        };
        assert_eq!(
            paths(&[
                (LIBRARY_ENV, "/opt/x/libnvJitLink.so.13"),
                ("CUDA_PATH", "/c")
            ]),
            ["/opt/x/libnvJitLink.so.13"],
            "the override is the only candidate"
        );
        let default = paths(&[]);
        assert_eq!(
            default,
            [
                "/usr/local/cuda/lib64/libnvJitLink.so.13",
                "/usr/local/cuda/lib64/libnvJitLink.so",
                "/usr/local/cuda/targets/x86_64-linux/lib/libnvJitLink.so.13",
                "/usr/local/cuda/targets/x86_64-linux/lib/libnvJitLink.so",
                "libnvJitLink.so.13",
                "libnvJitLink.so",
            ]
        );
        let with_roots = paths(&[("CUDA_PATH", "/c"), ("CUDA_HOME", "/h"), (LIBRARY_ENV, "")]);
        assert_eq!(with_roots[0], "/c/lib64/libnvJitLink.so.13");
        assert_eq!(with_roots[3], "/c/targets/x86_64-linux/lib/libnvJitLink.so");
        assert_eq!(with_roots[4], "/h/lib64/libnvJitLink.so.13");
        assert_eq!(&with_roots[8..], &default[..]);
    }

    #[test]
    fn cache_dir_from_env() {
        let dir = |vars: &[(&str, &str)]| Cache::dir_from(env(vars));
        assert_eq!(
            dir(&[
                (CACHE_ENV, "/tmp/c"),
                ("XDG_CACHE_HOME", "/x"),
                ("HOME", "/h")
            ]),
            Some("/tmp/c".into())
        );
        assert_eq!(dir(&[(CACHE_ENV, ""), ("HOME", "/h")]), None, "empty: off");
        assert_eq!(
            dir(&[(CACHE_ENV, "/tmp/c"), ("APEX_CACHE_DISABLE", "1")]),
            None
        );
        assert_eq!(
            dir(&[("XDG_CACHE_HOME", "/x"), ("HOME", "/h")]),
            Some("/x/apex".into())
        );
        assert_eq!(
            dir(&[("XDG_CACHE_HOME", ""), ("HOME", "/h")]),
            Some("/h/.cache/apex".into())
        );
        assert_eq!(dir(&[]), None);
    }

    #[test]
    fn keys_separate_every_input() {
        let k = |id: &str, kind, arch: &str, input: &[u8]| Cache::key(id, kind, arch, input);
        let base = k("nvJitLink 13.0", InputKind::Ptx, "sm_90", b"ptx");
        assert!(base.starts_with("sm_90-ptx-"), "{base}");
        assert_eq!(base.len(), "sm_90-ptx-".len() + 32);
        assert_eq!(base, k("nvJitLink 13.0", InputKind::Ptx, "sm_90", b"ptx"));
        for other in [
            k("nvJitLink 13.1", InputKind::Ptx, "sm_90", b"ptx"),
            k(
                "nvJitLink 13.0",
                InputKind::RelocatableCubin,
                "sm_90",
                b"ptx",
            ),
            k("nvJitLink 13.0", InputKind::Ptx, "sm_90a", b"ptx"),
            k("nvJitLink 13.0", InputKind::Ptx, "sm_90", b"ptx "),
            k("nvJitLink 13.", InputKind::Ptx, "0sm_90", b"ptx"),
        ] {
            assert_ne!(base, other);
        }
        assert!(!k("x", InputKind::Ptx, "../../etc", b"").contains('/'));
    }

    #[test]
    fn entries_check_out() {
        let dir = std::env::temp_dir().join(format!("apex-jit-unit-{}", std::process::id()));
        let cache = Cache::at(&dir);
        assert_eq!(cache.load("k"), None);
        cache.store("k", b"cubin bytes").unwrap();
        assert_eq!(cache.load("k").as_deref(), Some(&b"cubin bytes"[..]));
        let path = cache.path("k").unwrap();
        let good = std::fs::read(&path).unwrap();
        for bad in [
            good[..good.len() - 1].to_vec(),
            [&good[..], b"x"].concat(),
            good[..CACHE_HEADER - 1].to_vec(),
            {
                let mut b = good.clone();
                *b.last_mut().unwrap() ^= 1;
                b
            },
            {
                let mut b = good.clone();
                b[0] ^= 1;
                b
            },
        ] {
            std::fs::write(&path, bad).unwrap();
            assert_eq!(cache.load("k"), None);
        }
        assert!(Cache::disabled().store("k", b"x").is_ok());
        assert_eq!(Cache::disabled().load("k"), None);
        // No temporary files are left behind.
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, [OsString::from("k.cubin")]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn result_names() {
        assert_eq!(result_name(0), "NVJITLINK_SUCCESS");
        assert_eq!(result_name(4), "NVJITLINK_ERROR_PTX_COMPILE");
        assert_eq!(result_name(18), "NVJITLINK_ERROR_LTO_NOT_ENABLED");
        assert_eq!(result_name(99), "nvJitLinkResult 99");
        assert_eq!(result_name(-1), "nvJitLinkResult -1");
    }

    #[test]
    fn missing_library_names_what_was_tried() {
        let e = JitError::LibraryNotFound {
            library: LIBRARY_NAMES[0].into(),
            tried: vec!["/a/libnvJitLink.so.13".into(), "libnvJitLink.so".into()],
        };
        let m = e.to_string();
        for part in [
            "libnvJitLink.so.13",
            "/a/libnvJitLink.so.13",
            "CUDA toolkit",
            LIBRARY_ENV,
        ] {
            assert!(m.contains(part), "{m}");
        }
    }
}
