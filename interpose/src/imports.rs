//! Imports of other loaded objects, redirected. A library that binds a function by a versioned reference
//! (`cuptiActivityEnable@libcupti.so.13`, as PyTorch's Kineto does) is not interposed by an unversioned definition in
//! a preloaded library, and a Rust `cdylib` cannot define versioned symbols (rustc gives the linker a version script
//! of its own). So the importing objects' GOT slots for such a function — the lazy `JUMP_SLOT`s of PLT calls and the
//! `GLOB_DAT`s of calls through the GOT — are rewritten to point at the preload's wrapper, which calls the provider's
//! own function (looked up in the provider itself, which may not be in the global scope).
//!
//! Only objects that name the provider among their `DT_NEEDED` libraries are touched, each held loaded meanwhile, and
//! only slots of undefined symbols that hold the provider's function (or, for a PLT slot, a lazy-binding stub of the
//! object's own); a slot in the pages glibc made read-only is made writable for the store and read-only again.

use std::ffi::{CStr, c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

/// One function to redirect: its name, the wrapper's address, and the slot the provider's own function goes into
/// (what the wrapper calls).
#[derive(Debug)]
pub struct Redirect {
    /// The function's name (unversioned).
    pub name: &'static CStr,
    /// The wrapper every importer calls instead.
    pub ours: usize,
    /// Filled with the provider's own function.
    pub real: &'static AtomicUsize,
}

const DT_NULL: i64 = 0;
const DT_NEEDED: i64 = 1;
const DT_PLTRELSZ: i64 = 2;
const DT_STRTAB: i64 = 5;
const DT_SYMTAB: i64 = 6;
const DT_RELA: i64 = 7;
const DT_RELASZ: i64 = 8;
const DT_STRSZ: i64 = 10;
const DT_PLTREL: i64 = 20;
const DT_JMPREL: i64 = 23;
const R_X86_64_GLOB_DAT: u32 = 6;
const R_X86_64_JUMP_SLOT: u32 = 7;
const RELA_SIZE: usize = 24;
const SYM_SIZE: usize = 24;

/// What one object's dynamic section says.
#[derive(Default)]
struct Dynamic {
    strtab: usize,
    strsz: usize,
    symtab: usize,
    jmprel: usize,
    pltrelsz: usize,
    rela: usize,
    relasz: usize,
    plt_is_rela: bool,
    needed: Vec<usize>,
}

/// A loaded object, as `dl_iterate_phdr` gives it.
struct Object {
    name: Vec<u8>,
    base: usize,
    dynamic: usize,
    /// The RELRO segment (start, end), absolute.
    relro: Option<(usize, usize)>,
    /// Every PT_LOAD segment (start, end), absolute.
    loads: Vec<(usize, usize)>,
    /// The PT_LOAD segments mapped writable (`PF_W`).
    writable: Vec<(usize, usize)>,
}

/// The object `dl_iterate_phdr` reports, if it has a dynamic section.
///
/// # Safety
/// `info` is the loader's, valid for the call.
unsafe fn object_from(info: &libc::dl_phdr_info) -> Option<Object> {
    let name = if info.dlpi_name.is_null() {
        Vec::new()
    } else {
        // SAFETY: a NUL-terminated path the loader keeps.
        unsafe { CStr::from_ptr(info.dlpi_name) }
            .to_bytes()
            .to_vec()
    };
    let base = info.dlpi_addr as usize;
    let mut o = Object {
        name,
        base,
        dynamic: 0,
        relro: None,
        loads: Vec::new(),
        writable: Vec::new(),
    };
    for i in 0..usize::from(info.dlpi_phnum) {
        // SAFETY: `dlpi_phnum` headers at `dlpi_phdr`.
        let ph = unsafe { &*info.dlpi_phdr.add(i) };
        let start = base.wrapping_add(ph.p_vaddr as usize);
        let end = start.wrapping_add(ph.p_memsz as usize);
        match ph.p_type {
            libc::PT_DYNAMIC => o.dynamic = start,
            libc::PT_GNU_RELRO => o.relro = Some((start, end)),
            libc::PT_LOAD => {
                o.loads.push((start, end));
                if ph.p_flags & libc::PF_W != 0 {
                    o.writable.push((start, end));
                }
            }
            _ => {}
        }
    }
    (o.dynamic != 0).then_some(o)
}

unsafe extern "C" fn collect(
    info: *mut libc::dl_phdr_info,
    _size: usize,
    data: *mut c_void,
) -> c_int {
    // SAFETY: `data` is the `Vec<Object>` `objects` passed; `info` is the loader's, valid during the callback.
    let (out, info) = unsafe { (&mut *data.cast::<Vec<Object>>(), &*info) };
    // SAFETY: as above.
    if let Some(o) = unsafe { object_from(info) } {
        out.push(o);
    }
    0
}

unsafe extern "C" fn first_adds(
    info: *mut libc::dl_phdr_info,
    size: usize,
    data: *mut c_void,
) -> c_int {
    // `dlpi_adds` is there when the loader's structure reaches it (glibc 2.4 on).
    if size >= std::mem::offset_of!(libc::dl_phdr_info, dlpi_subs) {
        // SAFETY: `data` is the u64 `loads_so_far` passed; `info` is the loader's, with the field (checked above).
        unsafe { *data.cast::<u64>() = (*info).dlpi_adds };
    }
    1
}

/// How many objects the process has loaded so far (`dl_phdr_info::dlpi_adds`): when it changes, new libraries may
/// import what [`redirect_imports`] redirects. 0 where the loader does not say.
pub fn loads_so_far() -> u64 {
    let mut adds = 0u64;
    // SAFETY: the callback writes one u64 into `adds` and stops the iteration.
    unsafe { libc::dl_iterate_phdr(Some(first_adds), (&mut adds as *mut u64).cast()) };
    adds
}

/// Every loaded object with a dynamic section.
fn objects() -> Vec<Object> {
    let mut out: Vec<Object> = Vec::new();
    // SAFETY: the callback only reads what the loader passes and pushes into `out`.
    unsafe { libc::dl_iterate_phdr(Some(collect), (&mut out as *mut Vec<Object>).cast()) };
    out
}

impl Object {
    /// An address from the dynamic section: glibc relocates most entries in place on x86-64, but not all loaders
    /// do, so a value below the base is taken as relative to it.
    fn absolute(&self, v: usize) -> usize {
        if self.base != 0 && v < self.base {
            self.base.wrapping_add(v)
        } else {
            v
        }
    }

    /// Whether `[at, at + len)` lies inside one of the object's loaded segments.
    fn holds(&self, at: usize, len: usize) -> bool {
        at.checked_add(len)
            .is_some_and(|end| self.loads.iter().any(|&(s, e)| at >= s && end <= e))
    }

    /// The dynamic section's entries this needs, checked to lie in the object's segments.
    fn dynamic(&self) -> Option<Dynamic> {
        let mut d = Dynamic::default();
        let mut at = self.dynamic;
        // A dynamic section is a few dozen entries; a bound keeps a corrupt one from running on.
        for _ in 0..4096 {
            if !self.holds(at, 16) {
                return None;
            }
            // SAFETY: 16 bytes inside a loaded segment of the object.
            let (tag, val) = unsafe {
                (
                    (at as *const i64).read_unaligned(),
                    ((at + 8) as *const u64).read_unaligned() as usize,
                )
            };
            match tag {
                DT_NULL => break,
                DT_NEEDED => d.needed.push(val),
                DT_STRTAB => d.strtab = self.absolute(val),
                DT_STRSZ => d.strsz = val,
                DT_SYMTAB => d.symtab = self.absolute(val),
                DT_JMPREL => d.jmprel = self.absolute(val),
                DT_PLTRELSZ => d.pltrelsz = val,
                DT_PLTREL => d.plt_is_rela = val as i64 == DT_RELA,
                DT_RELA => d.rela = self.absolute(val),
                DT_RELASZ => d.relasz = val,
                _ => {}
            }
            at += 16;
        }
        (d.strtab != 0 && d.symtab != 0 && self.holds(d.strtab, d.strsz)).then_some(d)
    }

    /// The NUL-terminated string at `offset` of the string table.
    fn string<'a>(&self, d: &'a Dynamic, offset: usize) -> Option<&'a [u8]> {
        if offset >= d.strsz {
            return None;
        }
        // SAFETY: the string table lies in the object's segments (checked in `dynamic`), `strsz` bytes long.
        let table = unsafe { std::slice::from_raw_parts(d.strtab as *const u8, d.strsz) };
        let s = &table[offset..];
        Some(&s[..s.iter().position(|&b| b == 0)?])
    }
}

/// The file name of a path (what follows its last `/`).
fn file_name(path: &[u8]) -> &[u8] {
    path.rsplit(|&b| b == b'/').next().unwrap_or(path)
}

/// The one loaded object whose file name starts with `provider` (`libcupti.so`): `None` when none is loaded, or
/// several (two versions of the library: which one an importer binds to would have to be read from each).
fn provider_object<'a>(all: &'a [Object], provider: &[u8]) -> Option<&'a Object> {
    let mut found = all
        .iter()
        .filter(|o| file_name(&o.name).starts_with(provider));
    let first = found.next()?;
    found.all(|o| o.base == first.base).then_some(first)
}

/// `name` as the loaded library whose file name starts with `provider` defines it (looked up in that library, which
/// may not be in the global scope: a library a Python extension needs is loaded `RTLD_LOCAL`); 0 when it is not
/// loaded or does not define it.
pub fn provider_symbol(provider: &[u8], name: &CStr) -> usize {
    let all = objects();
    let Some(lib) = provider_object(&all, provider) else {
        return 0;
    };
    lookup(lib, &[name]).first().copied().unwrap_or(0)
}

/// `names` as loaded object `lib` defines them (0 for one it does not), through glibc's own `dlsym` (a preloaded
/// library may wrap `dlsym` itself).
fn lookup(lib: &Object, names: &[&CStr]) -> Vec<usize> {
    let Ok(path) = std::ffi::CString::new(lib.name.clone()) else {
        return Vec::new();
    };
    let Some(dlsym) = crate::real_dlsym() else {
        return Vec::new();
    };
    // SAFETY: a NUL-terminated path of a loaded object; RTLD_NOLOAD never loads anything.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
    if handle.is_null() {
        return Vec::new();
    }
    let found = names
        .iter()
        // SAFETY: a live handle and NUL-terminated names.
        .map(|n| unsafe { dlsym(handle, n.as_ptr()) } as usize)
        .collect();
    // SAFETY: the handle from the dlopen above (the object stays loaded: its importers hold it).
    unsafe { libc::dlclose(handle) };
    found
}

/// Points every importer's GOT slots for `redirects` at the wrappers. `provider` is how the providing library's file
/// name starts (`libcupti.so`); only objects that name such a library among their `DT_NEEDED` are touched, and
/// nothing when no such library or several are loaded. Returns how many slots now point at a wrapper. x86-64 only
/// (elsewhere 0).
///
/// # Safety
/// Each wrapper must have the signature of the function it replaces and call the function its `real` slot holds.
/// No other code may rewrite the same slots meanwhile.
pub unsafe fn redirect_imports(redirects: &[Redirect], provider: &[u8]) -> usize {
    // SAFETY: the caller's promise.
    unsafe { redirect(redirects, provider, true) }
}

/// [`redirect_imports`], the object this code is in rewritten too unless `skip_own`.
///
/// # Safety
/// As [`redirect_imports`].
#[cfg(target_arch = "x86_64")]
unsafe fn redirect(redirects: &[Redirect], provider: &[u8], skip_own: bool) -> usize {
    let all = objects();
    let Some(lib) = provider_object(&all, provider) else {
        return 0;
    };
    let names: Vec<&CStr> = redirects.iter().map(|r| r.name).collect();
    let mut wanted = Vec::new();
    for (r, f) in redirects.iter().zip(lookup(lib, &names)) {
        if f != 0 && f != r.ours {
            r.real.store(f, Ordering::Release);
            wanted.push((r, f));
        }
    }
    if wanted.is_empty() {
        return 0;
    }
    let own = if skip_own { own_object() } else { None };
    // Every other object is held loaded first (`RTLD_NOLOAD`: never loads anything, and waits for a load under way
    // to finish its relocation), so none is unmapped, or still being relocated, while its slots are read and written.
    let mut held = Vec::new();
    for o in &all {
        if o.base == lib.base || own.is_some_and(|b| b == o.base) || o.name.is_empty() {
            continue;
        }
        let Ok(path) = std::ffi::CString::new(o.name.clone()) else {
            continue;
        };
        // SAFETY: a NUL-terminated path; RTLD_NOLOAD never loads anything.
        let h = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
        if !h.is_null() {
            held.push((o.name.clone(), h));
        }
    }
    let mut pass = Pass {
        wanted,
        provider,
        page: page_size(),
        done: 0,
    };
    // The held objects as the loader lists them now (relocated), and the main program (never unloaded).
    for o in objects() {
        let fresh = o.base != lib.base
            && own.is_none_or(|b| b != o.base)
            && (o.name.is_empty() || held.iter().any(|(n, _)| *n == o.name));
        if fresh {
            // SAFETY: held loaded (or the main program); the caller's promise for the wrappers.
            unsafe { patch_object(&mut pass, &o) };
        }
    }
    for (_, h) in held {
        // SAFETY: a handle from the dlopen above.
        unsafe { libc::dlclose(h) };
    }
    pass.done
}

/// What one walk over the loaded objects rewrites ([`redirect`]).
#[cfg(target_arch = "x86_64")]
struct Pass<'a> {
    /// Each redirect with the provider's own function.
    wanted: Vec<(&'a Redirect, usize)>,
    provider: &'a [u8],
    page: usize,
    /// Slots that point at a wrapper.
    done: usize,
}

/// Rewrites object `o`'s slots for `pass.wanted`, if it needs the provider.
///
/// # Safety
/// `o` is loaded and relocated for the call; as [`redirect_imports`] for the wrappers.
#[cfg(target_arch = "x86_64")]
unsafe fn patch_object(pass: &mut Pass<'_>, o: &Object) {
    let Some(d) = o.dynamic() else { return };
    if !d.needed.iter().any(|&n| {
        o.string(&d, n)
            .is_some_and(|s| file_name(s).starts_with(pass.provider))
    }) {
        return;
    }
    let tables = [
        (d.jmprel, if d.plt_is_rela { d.pltrelsz } else { 0 }),
        (d.rela, d.relasz),
    ];
    for (table, size) in tables {
        if table == 0 || !o.holds(table, size) {
            continue;
        }
        for i in 0..size / RELA_SIZE {
            let at = table + i * RELA_SIZE;
            // SAFETY: inside the relocation table, which lies in the object's segments.
            let (offset, info) = unsafe {
                (
                    (at as *const u64).read_unaligned() as usize,
                    ((at + 8) as *const u64).read_unaligned(),
                )
            };
            let kind = (info & 0xffff_ffff) as u32;
            if kind != R_X86_64_JUMP_SLOT && kind != R_X86_64_GLOB_DAT {
                continue;
            }
            let Some(sym) = usize::try_from(info >> 32)
                .ok()
                .and_then(|i| i.checked_mul(SYM_SIZE))
                .and_then(|o| d.symtab.checked_add(o))
                .filter(|&sym| o.holds(sym, SYM_SIZE))
            else {
                continue;
            };
            // SAFETY: a symbol table entry inside the object's segments: st_name is its first word, st_shndx the
            // u16 at byte 6.
            let (name_at, shndx) = unsafe {
                (
                    (sym as *const u32).read_unaligned() as usize,
                    ((sym + 6) as *const u16).read_unaligned(),
                )
            };
            // Only imports: a function the object defines itself (a shim of its own) stays its own.
            if shndx != 0 {
                continue;
            }
            let Some(name) = o.string(&d, name_at) else {
                continue;
            };
            let Some(&(r, real)) = pass.wanted.iter().find(|(r, _)| r.name.to_bytes() == name)
            else {
                continue;
            };
            let slot = o.base.wrapping_add(offset);
            if !slot.is_multiple_of(8) || !o.holds(slot, 8) {
                continue;
            }
            // SAFETY: an aligned GOT slot inside the object's segments.
            let now = unsafe { (*(slot as *const AtomicUsize)).load(Ordering::Acquire) };
            // The provider's function (bound), or, in a PLT slot, a stub of the object's own (lazy binding, not
            // called yet): anything else was put there by someone else, and stays.
            let lazy = kind == R_X86_64_JUMP_SLOT && o.holds(now, 1);
            if now == r.ours {
                pass.done += 1;
            } else if now == real || lazy {
                // SAFETY: the caller's promise for the wrapper; the slot is made writable for the store.
                if unsafe { store(o, slot, r.ours, pass.page) } {
                    pass.done += 1;
                }
            }
        }
    }
}

/// GOT slots are x86-64's here: elsewhere nothing is redirected.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn redirect(_: &[Redirect], _: &[u8], _: bool) -> usize {
    0
}

/// The page size mprotect works in.
fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p)
        .ok()
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096)
}

/// Stores `value` into GOT slot `slot` of `o`, made writable for the store when it lies in the pages the loader
/// made read-only: the RELRO segment rounded down to whole pages at both ends, as glibc protects it (the last,
/// partial page stays writable, shared with the data after it).
///
/// # Safety
/// `slot` is an aligned GOT slot of `o` that only this code rewrites.
unsafe fn store(o: &Object, slot: usize, value: usize, page: usize) -> bool {
    let start = slot & !(page - 1);
    let relro = o
        .relro
        .map(|(s, e)| (s & !(page - 1), e & !(page - 1)))
        .filter(|&(s, e)| slot >= s && slot + 8 <= e);
    // Outside the read-only pages a GOT slot lies in a writable segment; anything else is not a slot to write.
    if relro.is_none() && !o.writable.iter().any(|&(s, e)| slot >= s && slot + 8 <= e) {
        return false;
    }
    if relro.is_some() {
        // SAFETY: the page of a loaded segment of the object; made read-only again below.
        if unsafe {
            libc::mprotect(
                start as *mut c_void,
                page,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        } != 0
        {
            return false;
        }
    }
    // SAFETY: the caller's promise; an aligned, writable word. Atomic: other threads call through it meanwhile.
    unsafe { (*(slot as *const AtomicUsize)).store(value, Ordering::Release) };
    if relro.is_some() {
        // SAFETY: as above.
        unsafe { libc::mprotect(start as *mut c_void, page, libc::PROT_READ) };
    }
    true
}

/// The load base of the object this code is in (never rewritten).
fn own_object() -> Option<usize> {
    let here = own_object as *const () as usize;
    objects()
        .into_iter()
        .find(|o| o.holds(here, 1))
        .map(|o| o.base)
}

#[cfg(test)]
mod tests {
    use super::*;

    static REAL: AtomicUsize = AtomicUsize::new(0);
    static CALLS: AtomicUsize = AtomicUsize::new(0);

    extern "C" fn counted_getpid() -> libc::pid_t {
        CALLS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: libc's getpid, stored by the redirect.
        let f = unsafe {
            std::mem::transmute::<usize, extern "C" fn() -> libc::pid_t>(
                REAL.load(Ordering::Acquire),
            )
        };
        f()
    }

    /// This test binary imports `getpid` from libc: redirected, its calls reach the wrapper, which calls libc's.
    #[test]
    fn an_import_of_a_needed_library_is_redirected_and_calls_the_real_function() {
        let pid = std::process::id() as libc::pid_t;
        let redirects = [Redirect {
            name: c"getpid",
            ours: counted_getpid as *const () as usize,
            real: &REAL,
        }];
        // No object needs a library named so: nothing is touched.
        // SAFETY: the wrapper has getpid's signature and calls the real one.
        assert_eq!(
            unsafe { redirect(&redirects, b"libnothing-such", false) },
            0
        );
        assert_eq!(REAL.load(Ordering::Acquire), 0);
        // SAFETY: as above.
        let n = unsafe { redirect(&redirects, b"libc.so.", false) };
        assert!(n >= 1, "this binary's getpid import was redirected");
        assert_ne!(REAL.load(Ordering::Acquire), 0, "libc's own getpid found");
        let before = CALLS.load(Ordering::Relaxed);
        // SAFETY: getpid has no preconditions.
        assert_eq!(
            unsafe { libc::getpid() },
            pid,
            "the wrapper calls libc's getpid"
        );
        assert!(
            CALLS.load(Ordering::Relaxed) > before,
            "the call went through the wrapper"
        );
        // Again: slots already redirected are counted, not rewritten.
        // SAFETY: as above.
        assert_eq!(unsafe { redirect(&redirects, b"libc.so.", false) }, n);
        // The public form leaves the object it is in alone (the preload's own imports).
        // SAFETY: as above.
        let _ = unsafe { redirect_imports(&redirects, b"libc.so.") };
        // SAFETY: getpid has no preconditions.
        assert_eq!(unsafe { libc::getpid() }, pid);
    }

    #[test]
    fn the_loaders_count_of_objects_is_read() {
        // The test binary, libc, the loader at least.
        assert!(loads_so_far() >= 3, "{}", loads_so_far());
    }
}
