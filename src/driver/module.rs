//! Modules loaded by the driver (cubin, fatbin or PTX) and their kernels ([`Function`]) with their parameter
//! tables.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use super::{Context, Error, Result, check, cu};

/// A module loaded by the driver (cubin, fatbin or PTX).
#[derive(Debug)]
pub struct Module {
    pub(super) ctx: Arc<Context>,
    module: cu::CUmodule,
}

// SAFETY: module handles are usable from any thread with the context current.
unsafe impl Send for Module {}
// SAFETY: as above.
unsafe impl Sync for Module {}

impl Module {
    /// Loads a cubin, fatbin or PTX image into `ctx` (`cuModuleLoadData`); PTX is compiled by libcuda.
    pub fn load(ctx: &Arc<Context>, image: &[u8]) -> Result<Arc<Module>> {
        ctx.bind()?;
        // PTX must be NUL-terminated text; cubins and fatbins are binary and are passed as they are.
        let owned;
        let data =
            if image.first().is_some_and(|&b| b != 0x7f && b != 0x50) && !image.ends_with(&[0]) {
                owned = [image, &[0]].concat();
                owned.as_ptr()
            } else {
                image.as_ptr()
            };
        let mut module = std::ptr::null_mut();
        // SAFETY: `data` points to the image for the duration of the call.
        check("cuModuleLoadData", unsafe {
            cu::cuModuleLoadData(&mut module, data.cast())
        })?;
        Ok(Arc::new(Module {
            ctx: ctx.clone(),
            module,
        }))
    }

    /// The kernel `name` (its symbol, mangled), with its parameter layout (`cuFuncGetParamInfo`).
    pub fn function(self: &Arc<Self>, name: &str) -> Result<Function> {
        self.ctx.bind()?;
        let cname = std::ffi::CString::new(name)
            .map_err(|_| Error::InvalidArgument(format!("kernel name {name:?}")))?;
        let mut f = std::ptr::null_mut();
        // SAFETY: the name is NUL-terminated; the module is loaded.
        check("cuModuleGetFunction", unsafe {
            cu::cuModuleGetFunction(&mut f, self.module, cname.as_ptr())
        })?;
        // Parameter sizes, so launches can be checked like on the direct path.
        let mut params = Vec::new();
        loop {
            let (mut off, mut size) = (0usize, 0usize);
            // SAFETY: out-pointers to locals; the driver answers CUDA_ERROR_INVALID_VALUE past the last one.
            let r = unsafe { cu::cuFuncGetParamInfo(f, params.len(), &mut off, &mut size) };
            if r != cu::CUresult::CUDA_SUCCESS {
                break;
            }
            params.push((off as u32, size as u32));
        }
        let mut max_dynamic = 0;
        // SAFETY: out-pointer to a local; a live function.
        check("cuFuncGetAttribute", unsafe {
            cu::cuFuncGetAttribute(
                &mut max_dynamic,
                cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                f,
            )
        })?;
        Ok(Function {
            module: self.clone(),
            func: f,
            params,
            name: name.into(),
            max_dynamic: Arc::new(AtomicU32::new(max_dynamic.max(0) as u32)),
        })
    }

    /// The device address and size of the module variable `name` (`cuModuleGetGlobal`); `None` when the module
    /// has none of that name.
    pub fn global(&self, name: &str) -> Result<Option<(u64, u64)>> {
        self.ctx.bind()?;
        let cname = std::ffi::CString::new(name)
            .map_err(|_| Error::InvalidArgument(format!("variable name {name:?}")))?;
        let (mut ptr, mut size) = (0, 0usize);
        // SAFETY: the name is NUL-terminated; out-pointers to locals; the module is loaded.
        let r =
            unsafe { cu::cuModuleGetGlobal_v2(&mut ptr, &mut size, self.module, cname.as_ptr()) };
        if r == cu::CUresult::CUDA_ERROR_NOT_FOUND {
            return Ok(None);
        }
        check("cuModuleGetGlobal", r)?;
        Ok(Some((ptr, size as u64)))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: unloads our own module once; its functions hold an Arc to it.
        unsafe { cu::cuModuleUnload(self.module) };
    }
}

/// A kernel of a driver module, with its parameter (offset, size) table.
#[derive(Clone, Debug)]
pub struct Function {
    pub(super) module: Arc<Module>,
    pub(super) func: cu::CUfunction,
    params: Vec<(u32, u32)>,
    /// The name it was looked up by.
    pub(super) name: Arc<str>,
    /// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` as last set or read (shared by clones), so a launch sets
    /// it only when it asks for more.
    max_dynamic: Arc<AtomicU32>,
}

// SAFETY: function handles are usable from any thread with the context current.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

impl Function {
    /// Each parameter's offset and size in bytes, in order, as the driver reports them.
    pub fn params(&self) -> &[(u32, u32)] {
        &self.params
    }

    /// libcuda's handle, for calls APEX does not wrap.
    pub fn raw(&self) -> cu::CUfunction {
        self.func
    }

    /// The kernel's name (as it was looked up).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Sets how much dynamic shared memory launches may ask for (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`;
    /// 48 KiB until set).
    pub fn set_max_dynamic_shared(&self, bytes: u32) -> Result<()> {
        let value = i32::try_from(bytes).map_err(|_| {
            Error::InvalidArgument(format!("{bytes} bytes of dynamic shared memory"))
        })?;
        self.module.ctx.bind()?;
        // SAFETY: a plain attribute set on a live function.
        check("cuFuncSetAttribute", unsafe {
            cu::cuFuncSetAttribute(
                self.func,
                cu::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                value,
            )
        })?;
        self.max_dynamic.store(bytes, Ordering::Relaxed);
        Ok(())
    }

    /// Raises the dynamic shared memory limit to `bytes` if it is lower (once per new maximum, not per launch): the
    /// driver refuses launches above 48 KiB with CUDA_ERROR_INVALID_VALUE otherwise.
    pub(super) fn ensure_dynamic_shared(&self, bytes: u32) -> Result<()> {
        if bytes > self.max_dynamic.load(Ordering::Relaxed) {
            self.set_max_dynamic_shared(bytes)?;
        }
        Ok(())
    }

    /// The module the kernel belongs to (kept loaded by the function).
    pub fn module(&self) -> &Arc<Module> {
        &self.module
    }
}
