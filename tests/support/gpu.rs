//! What the GPU tests share: opening GPU 0 on the backend a test asks for. Included with
//! `#[path = "support/gpu.rs"] mod support_gpu;`.

#![allow(dead_code)]

use apex::{Backend, BackendRequest, Gpu};

/// GPU 0 on backend `b`, checked to be what was asked for (the selection says why not, when it is not).
pub fn open(b: Backend) -> Gpu {
    let req = match b {
        Backend::Direct => BackendRequest::Direct,
        Backend::Driver => BackendRequest::Driver,
    };
    let g = Gpu::open_with(0, req).expect("open GPU");
    assert_eq!(g.backend(), b, "{}", g.selection());
    g
}
