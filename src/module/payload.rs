//! The bytes of a module's code: owned, or a read-only map of a [module cache](super::cache) entry.
//!
//! PyTorch's cubins decompress to 10-22 MB each. Read from the cache into fresh memory, one costs 5-13 ms (page
//! faults on the new memory, then the copy); mapped, the kernel shares the page cache's pages, and the only pass
//! over all of them is the cache's content hash (about 2 ms for 22 MB), once per entry and boot; later loads read only
//! the pages the loader uses.
//!
//! Only files on local filesystems are mapped: a page of a mapped file that cannot be read (an I/O
//! error, a network filesystem's stale handle after another host removed the entry) faults the process at the read,
//! where a `read` would have returned an error the cache turns into a miss.

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
    /// Maps `len` bytes at `offset` of `file` (whose length is `file_len`) read-only; with `populate`, every page at
    /// once (for a pass over all of them), else each page at its first read.
    ///
    /// # Safety
    ///
    /// `file_len` is the file's size, and for as long as the payload lives nothing writes or truncates the file in
    /// place and its pages stay readable ([`mappable`]): the bytes behind a `&[u8]` must not change, and a page
    /// that could no longer be read would fault the process. Module cache entries hold this: they are written
    /// aside and renamed into place, and removed by unlinking, which leaves a mapping intact on a local filesystem.
    pub(crate) unsafe fn map_file(
        file: &File,
        file_len: u64,
        offset: usize,
        len: usize,
        populate: bool,
    ) -> std::io::Result<Payload> {
        let map_len = usize::try_from(file_len).map_err(|_| std::io::ErrorKind::InvalidInput)?;
        let end = offset.checked_add(len);
        if end.is_none_or(|end| end > map_len) || map_len == 0 {
            return Err(std::io::ErrorKind::InvalidInput.into());
        }
        // SAFETY: a fresh private read-only map of `map_len` bytes of an open file at file offset 0 and an address
        // of the kernel's choosing: it aliases no Rust memory. POPULATE maps the page cache's pages in one call
        // instead of one fault per 16 pages as the content hash reads them.
        let flags = if populate {
            MapFlags::PRIVATE | MapFlags::POPULATE
        } else {
            MapFlags::PRIVATE
        };
        let base = unsafe {
            mmap(
                std::ptr::null_mut(),
                map_len,
                ProtFlags::READ,
                flags,
                file,
                0,
            )
        }?;
        let Some(base) = NonNull::new(base.cast::<u8>()) else {
            // Not without MAP_FIXED; if it were, the map would still be unmapped here.
            // SAFETY: exactly what `mmap` returned; nothing refers to it.
            let _ = unsafe { munmap(base, map_len) };
            return Err(std::io::ErrorKind::InvalidData.into());
        };
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

/// Filesystems whose files are mapped (`statfs` magic numbers): local disks and memory. On these an unlinked file's
/// pages stay readable for as long as they are mapped, and a read fails only on a failing disk.
const LOCAL_FILESYSTEMS: [u32; 9] = [
    0xEF53,      // ext2, ext3, ext4
    0x5846_5342, // xfs
    0x9123_683E, // btrfs
    0x0102_1994, // tmpfs
    0x8584_58F6, // ramfs
    0x794C_7630, // overlayfs (containers)
    0xF2F5_2010, // f2fs
    0x2FC1_2FC1, // zfs
    0xCA45_1A4E, // bcachefs
];

/// Whether `file` is on a filesystem whose files may be mapped ([`LOCAL_FILESYSTEMS`]): not a network or FUSE one,
/// where another host's eviction or a server's error would fault a read of the mapping instead of failing a `read`.
pub(crate) fn mappable(file: &File) -> bool {
    rustix::fs::fstatfs(file).is_ok_and(|fs| {
        // `f_type` is a C long on most targets; the magic numbers fit 32 bits.
        #[allow(clippy::unnecessary_cast)]
        let magic = fs.f_type as u64 as u32;
        LOCAL_FILESYSTEMS.contains(&magic)
    })
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

    /// Maps a range of a temporary file nothing else writes, its pages populated at once or at their first read.
    fn map_as(
        f: &File,
        file_len: u64,
        offset: usize,
        len: usize,
        populate: bool,
    ) -> std::io::Result<Payload> {
        // SAFETY: `file_len` is the file's size, and the test's own temporary file is never written again.
        unsafe { Payload::map_file(f, file_len, offset, len, populate) }
    }

    fn map(f: &File, file_len: u64, offset: usize, len: usize) -> std::io::Result<Payload> {
        map_as(f, file_len, offset, len, true)
    }

    #[test]
    fn a_mapped_range_reads_the_file_and_copies_out() {
        let mut f = tempfile::tempfile().unwrap();
        let content: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        f.write_all(&content).unwrap();
        for populate in [true, false] {
            let p = map_as(&f, content.len() as u64, 100, 5000, populate).unwrap();
            assert!(p.is_mapped());
            assert_eq!(&p[..], &content[100..5100]);
            assert_eq!(p, Payload::from(content[100..5100].to_vec()));
            assert_eq!(p.into_vec(), content[100..5100].to_vec());
        }
    }

    #[test]
    fn a_range_past_the_file_is_refused() {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&[7; 64]).unwrap();
        for (offset, len) in [(0, 65), (60, 5), (usize::MAX, 2)] {
            assert!(map(&f, 64, offset, len).is_err());
        }
        // An empty range inside the file, and one at its end, are empty payloads.
        assert!(map(&f, 64, 10, 0).unwrap().is_empty());
        assert!(map(&f, 64, 64, 0).unwrap().is_empty());
        let empty = tempfile::tempfile().unwrap();
        assert!(
            map(&empty, 0, 0, 0).is_err(),
            "nothing to map in an empty file"
        );
    }

    #[test]
    fn temporary_files_are_on_a_filesystem_that_maps() {
        // The build machines' temporary directories are local (tmpfs, ext4, overlayfs); procfs is not a filesystem
        // the list names.
        let f = tempfile::tempfile().unwrap();
        assert!(
            mappable(&f),
            "{:?}",
            rustix::fs::fstatfs(&f).map(|s| s.f_type)
        );
        assert!(!mappable(&File::open("/proc/self/stat").unwrap()));
    }
}
