//! What the program loaded: module and library images by handle, and the name and owner of every function and
//! kernel handle it took from them.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// A module image's bytes.
#[derive(Debug)]
pub enum ImageBytes {
    /// Inside a loaded executable or shared library (nvcc's `.nv_fatbin`), which stays mapped: not copied.
    Mapped(&'static [u8]),
    /// Copied at load time (the program may free its buffer after `cuModuleLoadData` returns).
    Owned(Box<[u8]>),
}

impl ImageBytes {
    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        match self {
            ImageBytes::Mapped(b) => b,
            ImageBytes::Owned(b) => b,
        }
    }
}

/// A handle the program loaded code through: a `CUmodule` or a `CUlibrary`.
pub type Owner = usize;

/// A function or kernel handle's origin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Origin {
    /// The module or library it came from (a library's module resolves to the library).
    pub owner: Owner,
    /// The kernel's name as the program asked for it.
    pub name: String,
}

/// Module and function handles, as the program's loads and lookups made them.
#[derive(Debug, Default)]
pub struct Registry {
    images: HashMap<Owner, Arc<ImageBytes>>,
    /// `CUmodule`s of libraries (`cuLibraryGetModule`) → the library.
    aliases: HashMap<usize, Owner>,
    functions: HashMap<usize, Origin>,
    /// Owners one of whose globals' address the program took, with the names (`None`: a managed variable, or a
    /// name that could not be read).
    escaped: HashMap<Owner, Vec<Option<String>>>,
    /// Owners that are `CUlibrary`s (the rest are `CUmodule`s).
    libraries: HashSet<Owner>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Registry {
        Registry::default()
    }

    /// A module (or, with `library`, a library) was loaded from `image`.
    pub fn loaded(&mut self, owner: Owner, image: ImageBytes, library: bool) {
        self.images.insert(owner, Arc::new(image));
        self.escaped.remove(&owner);
        if library {
            self.libraries.insert(owner);
        } else {
            self.libraries.remove(&owner);
        }
    }

    /// Whether `owner` is a `CUlibrary`.
    pub fn is_library(&self, owner: Owner) -> bool {
        self.libraries.contains(&owner)
    }

    /// The owner a module or library handle stands for (a library's `CUmodule` stands for the library).
    pub fn owner(&self, handle: usize) -> Option<Owner> {
        if self.images.contains_key(&handle) {
            return Some(handle);
        }
        self.aliases.get(&handle).copied()
    }

    /// The image of an owner.
    pub fn image(&self, owner: Owner) -> Option<Arc<ImageBytes>> {
        self.images.get(&owner).cloned()
    }

    /// `cuLibraryGetModule`: `module` is `library`'s.
    pub fn library_module(&mut self, module: usize, library: usize) {
        if let Some(owner) = self.owner(library) {
            self.aliases.insert(module, owner);
        }
    }

    /// `cuModuleGetFunction` / `cuLibraryGetKernel`: `function` is `name` of module or library `handle`. Ignored
    /// when `handle` was not seen loaded.
    pub fn function(&mut self, function: usize, handle: usize, name: &str) {
        if let Some(owner) = self.owner(handle) {
            self.functions.insert(
                function,
                Origin {
                    owner,
                    name: name.to_string(),
                },
            );
        }
    }

    /// `cuKernelGetFunction`: `function` is the same kernel as `kernel`.
    pub fn same_function(&mut self, function: usize, kernel: usize) {
        // The CUDA runtime asks again on every `cudaGetFuncBySymbol`: an answer already recorded costs two lookups
        // and no allocation.
        let Some(o) = self.functions.get(&kernel) else {
            return;
        };
        if self.functions.get(&function) == Some(o) {
            return;
        }
        let o = o.clone();
        self.functions.insert(function, o);
    }

    /// Where a function or kernel handle came from.
    pub fn origin(&self, function: usize) -> Option<&Origin> {
        self.functions.get(&function)
    }

    /// The program took the address of global `name` of module or library `handle`.
    pub fn escape(&mut self, handle: usize, name: Option<String>) {
        if let Some(owner) = self.owner(handle) {
            self.escaped.entry(owner).or_default().push(name);
        }
    }

    /// The globals of the owner whose address the program took (empty: none).
    pub fn escaped(&self, owner: Owner) -> &[Option<String>] {
        self.escaped.get(&owner).map_or(&[], Vec::as_slice)
    }

    /// A module or library was unloaded: forgets it, its aliases and its functions (their handles may be reused).
    /// Returns the owner it was, if known.
    pub fn unloaded(&mut self, handle: usize) -> Option<Owner> {
        let owner = self.owner(handle)?;
        self.images.remove(&owner);
        self.escaped.remove(&owner);
        self.libraries.remove(&owner);
        self.aliases.retain(|_, o| *o != owner);
        self.functions.retain(|_, o| o.owner != owner);
        Some(owner)
    }

    /// Modules and libraries known now.
    pub fn len(&self) -> usize {
        self.images.len()
    }

    /// Whether none is known.
    pub fn is_empty(&self) -> bool {
        self.images.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image() -> ImageBytes {
        ImageBytes::Owned(vec![1, 2, 3].into_boxed_slice())
    }

    #[test]
    fn functions_resolve_to_their_module() {
        let mut r = Registry::new();
        r.loaded(0x10, image(), false);
        r.function(0x100, 0x10, "k");
        assert_eq!(
            r.origin(0x100),
            Some(&Origin {
                owner: 0x10,
                name: "k".into()
            })
        );
        assert_eq!(r.image(0x10).unwrap().bytes(), &[1, 2, 3]);
        // A handle from a module never seen loaded is not recorded.
        r.function(0x200, 0x99, "other");
        assert_eq!(r.origin(0x200), None);
    }

    #[test]
    fn library_kernels_modules_and_functions_are_one_owner() {
        let mut r = Registry::new();
        r.loaded(0x20, image(), true);
        r.function(0x300, 0x20, "lib_kernel"); // cuLibraryGetKernel
        r.same_function(0x301, 0x300); // cuKernelGetFunction
        r.library_module(0x21, 0x20); // cuLibraryGetModule
        r.function(0x302, 0x21, "other_kernel"); // cuModuleGetFunction on the library's module
        assert_eq!(r.origin(0x301).unwrap().owner, 0x20);
        assert_eq!(r.origin(0x301).unwrap().name, "lib_kernel");
        assert_eq!(r.origin(0x302).unwrap().owner, 0x20);
        assert_eq!(r.owner(0x21), Some(0x20));
    }

    #[test]
    fn unload_forgets_everything_of_the_owner_and_escapes_are_per_owner() {
        let mut r = Registry::new();
        r.loaded(0x10, image(), false);
        r.loaded(0x20, image(), true);
        r.library_module(0x21, 0x20);
        r.function(0x100, 0x10, "a");
        r.function(0x200, 0x21, "b");
        r.escape(0x21, Some("counter".into()));
        assert_eq!(r.escaped(0x20), [Some("counter".to_string())]);
        assert!(r.escaped(0x10).is_empty());
        assert!(r.is_library(0x20) && !r.is_library(0x10));
        assert_eq!(r.unloaded(0x20), Some(0x20));
        assert_eq!(r.origin(0x200), None);
        assert_eq!(r.owner(0x21), None);
        assert!(r.escaped(0x20).is_empty() && !r.is_library(0x20));
        assert_eq!(r.origin(0x100).unwrap().name, "a");
        assert_eq!(r.len(), 1);
        assert_eq!(r.unloaded(0x77), None);
    }
}
