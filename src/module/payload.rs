//! The bytes of a module's code: owned, or a read-only map of a [module cache](super::cache) entry.
//!
//! PyTorch's cubins decompress to 10-22 MB each. Read from the cache into fresh memory, one costs 6-9 ms (page
//! faults on the new memory, then the copy); mapped, the kernel shares the page cache's pages and the load reads
//! only what it parses and links, so a module whose program launches a few of its kernels costs little more than
//! its headers.

use std::fs::File;
use std::ops::Deref;
use std::ptr::NonNull;

use rustix::mm::{MapFlags, ProtFlags, mmap, munmap};

/// A module's code bytes: owned, or a read-only map of a file (a module cache entry). Dereferences to the bytes.
///
/// ```
/// use apex::module::payload::Payload;
///
/// let p = Payload::from(vec![1u8, 2, 3]);
/// assert_eq!(&p[..], &[1, 2, 3]);
/// assert!(!p.is_mapped());
/// assert_eq!(p.into_vec(), vec![1, 2, 3]);
/// ```
pub struct Payload(Repr);

enum Repr {
    Owned(Vec<u8>),
    Mapped(Mapped),
}

/// `len` bytes at `offset` of a private read-only map of a whole file.
struct Mapped {
    base: NonNull<u8>,
    map_len: usize,
    offset: usize,
    len: usize,
}

// SAFETY: the map is read-only and private, and only unmapped on drop; sharing `&[u8]` views of it between threads
// is as sound as sharing a `&[u8]` of a `Vec`.
unsafe impl Send for Mapped {}
// SAFETY: as above: nothing writes through the map.
unsafe impl Sync for Mapped {}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: `base`/`map_len` are exactly what `mmap` returned, unmapped once; no slice of it outlives `self`
        // (every view borrows the `Payload`).
        if let Err(e) = unsafe { munmap(self.base.as_ptr().cast(), self.map_len) } {
            tracing::warn!(error = %e, "munmap of a module cache entry failed");
        }
    }
}

impl Payload {
    /// Maps `len` bytes at `offset` of `file` (whose length is `file_len`) read-only. The mapping sees the file as
    /// it is: callers map only files nothing rewrites in place (module cache entries are written aside and renamed
    /// into place, and removed by unlinking, which leaves a mapping intact). A file truncated under the mapping
    /// would fault the process at its next read, as a shared library truncated under `ld.so` does.
    pub(crate) fn map_file(
        file: &File,
        file_len: u64,
        offset: usize,
        len: usize,
    ) -> std::io::Result<Payload> {
        let map_len = usize::try_from(file_len).map_err(|_| std::io::ErrorKind::InvalidInput)?;
        let end = offset.checked_add(len);
        if end.is_none_or(|end| end > map_len) || map_len == 0 {
            return Err(std::io::ErrorKind::InvalidInput.into());
        }
        // SAFETY: a fresh private read-only map of `map_len` bytes of an open file at file offset 0 and an address
        // of the kernel's choosing: it aliases no Rust memory. POPULATE maps the page cache's pages in one call
        // instead of one fault per 16 pages as the content hash reads them.
        let base = unsafe {
            mmap(
                std::ptr::null_mut(),
                map_len,
                ProtFlags::READ,
                MapFlags::PRIVATE | MapFlags::POPULATE,
                file,
                0,
            )
        }?;
        let base = NonNull::new(base.cast::<u8>()).ok_or(std::io::ErrorKind::InvalidData)?;
        Ok(Payload(Repr::Mapped(Mapped {
            base,
            map_len,
            offset,
            len,
        })))
    }

    /// Whether the bytes are a map of a file rather than memory of the process's own.
    pub fn is_mapped(&self) -> bool {
        matches!(self.0, Repr::Mapped(_))
    }

    /// The bytes as a vector: the owned one as it is, a map's copied.
    pub fn into_vec(self) -> Vec<u8> {
        match self.0 {
            Repr::Owned(v) => v,
            Repr::Mapped(m) => m.bytes().to_vec(),
        }
    }
}

impl Mapped {
    fn bytes(&self) -> &[u8] {
        // SAFETY: `offset + len <= map_len` (checked at map time); the map is readable and lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(self.offset), self.len) }
    }
}

impl Deref for Payload {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match &self.0 {
            Repr::Owned(v) => v,
            Repr::Mapped(m) => m.bytes(),
        }
    }
}

impl AsRef<[u8]> for Payload {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl From<Vec<u8>> for Payload {
    fn from(v: Vec<u8>) -> Payload {
        Payload(Repr::Owned(v))
    }
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let how = if self.is_mapped() { "mapped" } else { "owned" };
        write!(f, "Payload({} bytes, {how})", self.len())
    }
}

impl PartialEq for Payload {
    fn eq(&self, other: &Payload) -> bool {
        self[..] == other[..]
    }
}

impl Eq for Payload {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_mapped_range_reads_the_file_and_copies_out() {
        let mut f = tempfile::tempfile().unwrap();
        let content: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        f.write_all(&content).unwrap();
        let p = Payload::map_file(&f, content.len() as u64, 100, 5000).unwrap();
        assert!(p.is_mapped());
        assert_eq!(&p[..], &content[100..5100]);
        assert_eq!(p, Payload::from(content[100..5100].to_vec()));
        assert_eq!(p.into_vec(), content[100..5100].to_vec());
    }

    #[test]
    fn a_range_past_the_file_is_refused() {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&[7; 64]).unwrap();
        for (offset, len) in [(0, 65), (60, 5), (usize::MAX, 2)] {
            assert!(Payload::map_file(&f, 64, offset, len).is_err());
        }
        assert!(Payload::map_file(&f, 0, 0, 0).is_err(), "an empty file");
    }
}
