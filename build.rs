//! Build script: generates the class field tables from the vendored NVIDIA class headers (always), and, with
//! the `bindgen` feature, regenerates the committed RM/UVM bindings in `src/rm/sys/nvrm.rs`.

#[path = "build/classes.rs"]
mod classes;

#[path = "build/rmdefs.rs"]
mod rmdefs;

#[cfg(feature = "bindgen")]
#[path = "build/bindings.rs"]
mod bindings;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=build");
    println!("cargo:rerun-if-changed=open-gpu-headers");
    let root =
        std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    rmdefs::generate(&root, &out_dir);
    classes::generate();
    #[cfg(feature = "bindgen")]
    bindings::generate();
}
