//! Marks of entries whose content was checked in full since the machine booted, so that later hits in the same boot
//! check the header and the file's identity instead of hashing every byte again (the hash was half of a warm module
//! load on one core: ~1.5 ms for a 20 MB PyTorch cubin).
//!
//! What the content hash guards against is an entry that is not what was written: one torn by a crash (the rename
//! that publishes an entry can reach the disk before its data does), or bytes the disk gave back wrong at the first
//! read. Both show in the first full check after the boot they happen in, and a mark is only ever written after such
//! a check passed. A mark names the boot (`/proc/sys/kernel/random/boot_id`, read at every check, so a process
//! restored in a later boot does not take an earlier boot's marks), the entry file (device, inode, length, and its
//! birth time and, where the filesystem answers `FS_IOC_GETVERSION`, its inode generation: an inode number freed by
//! an eviction or a restore of the directory is given to the next file made, at once on ext4, and birth times are
//! stamped from a clock that moves once per scheduler tick (three files made in turn here, Linux 6.18 on ext4, got
//! the same inode number and the same birth time to the nanosecond), but ext4, xfs and f2fs draw each new inode's
//! generation at random (btrfs and zfs give the creating transaction, and do not hand freed inode numbers out again
//! at once)) and the content hash its header claims. An entry is never rewritten
//! in place (a new one is a new file, renamed over the name), so a file with the same identity in the same boot holds
//! the bytes that were checked, as long as nothing else changes it in place. Whoever can write the cache directory can
//! forge a mark as easily as an entry: the directory is trusted as before (SECURITY.md).
//!
//! What a mark cannot vouch for: a page of a checked entry that left the page cache and reads back wrong from the
//! disk later in the same boot (as a page of a shared library would). Marks are used only for entries on local
//! filesystems (those that are mapped): on a network filesystem another host can replace an entry behind this
//! host's back. Where the boot id or a file's birth time cannot be read (`statx` without `STATX_BTIME`), every hit is
//! checked in full. A mark is a small file of its own (an inode and a block); marks do not count towards the cap.

use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, StatxFlags};

/// What a mark file's name adds to its entry's.
pub(super) const MARK_SUFFIX: &str = ".ok";
const MARK_MAGIC: &[u8; 8] = b"APEXMOK3";
/// Magic, boot id, then the identity's seven `u64`s.
const MARK_LEN: usize = 8 + 16 + 7 * 8;

/// A boot's identity: the 128 bits of the kernel's boot id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct BootId(pub(super) [u8; 16]);

impl BootId {
    /// The boot id in the kernel's text form (a UUID: 32 hex digits, dashes anywhere), else `None`.
    pub(super) fn parse(text: &str) -> Option<BootId> {
        let digits: Vec<u8> = text
            .trim()
            .bytes()
            .filter(|&b| b != b'-')
            .map(|b| (b as char).to_digit(16).map(|d| d as u8))
            .collect::<Option<_>>()?;
        if digits.len() != 32 {
            return None;
        }
        let mut id = [0u8; 16];
        for (i, pair) in digits.chunks_exact(2).enumerate() {
            id[i] = pair[0] << 4 | pair[1];
        }
        Some(BootId(id))
    }
}

/// This boot's id, read at each call (a few µs; a process may outlive a boot, restored from a checkpoint); `None` where
/// it cannot be read (not Linux, `/proc` not mounted).
pub(super) fn boot_id() -> Option<BootId> {
    fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .and_then(|t| BootId::parse(&t))
}

/// An entry file's identity for a mark: the file, and the content hash its header claims.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Identity {
    dev: u64,
    ino: u64,
    len: u64,
    born_s: u64,
    born_ns: u64,
    /// The inode's generation (`FS_IOC_GETVERSION`); 0 where the filesystem keeps none.
    generation: u64,
    content_hash: u64,
}

impl Identity {
    /// The identity of the open entry `file` whose header claims `content_hash`; `None` where the filesystem does not
    /// give a birth time (the entry is then hashed at every read).
    pub(super) fn of(file: &File, content_hash: u64) -> Option<Identity> {
        let want = StatxFlags::TYPE | StatxFlags::INO | StatxFlags::SIZE | StatxFlags::BTIME;
        let st = rustix::fs::statx(file, "", AtFlags::EMPTY_PATH, want).ok()?;
        let regular = rustix::fs::FileType::from_raw_mode(st.stx_mode.into())
            == rustix::fs::FileType::RegularFile;
        if !StatxFlags::from_bits_retain(st.stx_mask).contains(want) || !regular {
            return None;
        }
        Some(Identity {
            dev: u64::from(st.stx_dev_major) << 32 | u64::from(st.stx_dev_minor),
            ino: st.stx_ino,
            len: st.stx_size,
            born_s: st.stx_btime.tv_sec as u64,
            born_ns: u64::from(st.stx_btime.tv_nsec),
            generation: generation(file).unwrap_or(0),
            content_hash,
        })
    }

    fn encode(&self, boot: BootId) -> [u8; MARK_LEN] {
        let mut out = [0u8; MARK_LEN];
        let fields = [
            self.dev,
            self.ino,
            self.len,
            self.born_s,
            self.born_ns,
            self.generation,
            self.content_hash,
        ];
        out[..8].copy_from_slice(MARK_MAGIC);
        out[8..24].copy_from_slice(&boot.0);
        for (i, v) in fields.iter().enumerate() {
            out[24 + 8 * i..32 + 8 * i].copy_from_slice(&v.to_le_bytes());
        }
        out
    }
}

/// `FS_IOC_GETVERSION`: `_IOR('v', 1, long)`.
const FS_IOC_GETVERSION: rustix::ioctl::Opcode =
    rustix::ioctl::opcode::read::<std::ffi::c_long>(b'v', 1);

/// The inode generation of `file` where its filesystem answers `FS_IOC_GETVERSION` (ext4, xfs, f2fs, btrfs and zfs
/// write an `int`; tmpfs, overlayfs and bcachefs refuse the request).
fn generation(file: &File) -> Option<u64> {
    let mut value: std::ffi::c_long = 0;
    // SAFETY: FS_IOC_GETVERSION writes at most a `long` (the filesystems that answer it write an `int`) through the
    // pointer, which points at `value`, a `long` that outlives the call; `file` is an open regular file
    // (`Identity::of` checks), and a filesystem that does not know the request refuses it.
    unsafe {
        let updater =
            rustix::ioctl::Updater::<FS_IOC_GETVERSION, std::ffi::c_long>::new(&mut value);
        rustix::ioctl::ioctl(file, updater).ok()?;
    }
    Some(value as u64)
}

/// The mark file of the entry at `entry`.
pub(super) fn mark_path(entry: &Path) -> PathBuf {
    let mut name = entry.as_os_str().to_owned();
    name.push(MARK_SUFFIX);
    PathBuf::from(name)
}

/// Whether `entry` carries a mark of this boot for exactly this identity. Anything else (no mark, another boot's, a
/// torn or foreign one) is no mark: the entry is checked in full.
pub(super) fn is_marked(entry: &Path, boot: BootId, id: &Identity) -> bool {
    let Ok(f) = File::open(mark_path(entry)) else {
        return false;
    };
    // One byte more than a mark: a longer file is not one.
    let mut got = Vec::with_capacity(MARK_LEN + 1);
    if f.take(MARK_LEN as u64 + 1).read_to_end(&mut got).is_err() {
        return false;
    }
    got == id.encode(boot)
}

/// Marks `entry` (in `dir`) as checked in full in this boot: written aside and renamed into place, so a reader never
/// takes half a mark for one.
pub(super) fn mark(dir: &Path, entry: &Path, boot: BootId, id: &Identity) -> io::Result<()> {
    let name = entry
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    super::write_aside(
        dir,
        &format!("{name}{MARK_SUFFIX}"),
        &mark_path(entry),
        &[&id.encode(boot)],
    )
}

/// Removes `entry`'s mark, if any (with the entry, or when the entry proved unsound).
pub(super) fn unmark(entry: &Path) {
    let _ = fs::remove_file(mark_path(entry));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field of the identity, and the boot, is in the mark: an identity that differs in any one of them finds
    /// no mark (the birth time is what tells a file from an earlier one given the same inode number).
    #[test]
    fn a_mark_is_for_one_boot_and_one_identity() {
        let dir = tempfile::tempdir().unwrap();
        let entry = dir.path().join("e.payload");
        fs::write(&entry, b"entry").unwrap();
        let id = Identity {
            dev: 1,
            ino: 2,
            len: 3,
            born_s: 4,
            born_ns: 5,
            generation: 10,
            content_hash: 6,
        };
        let boot = BootId([7; 16]);
        mark(dir.path(), &entry, boot, &id).unwrap();
        assert!(is_marked(&entry, boot, &id));
        let others = [
            Identity { dev: 9, ..id },
            Identity { ino: 9, ..id },
            Identity { len: 9, ..id },
            Identity { born_s: 9, ..id },
            Identity { born_ns: 9, ..id },
            Identity {
                generation: 9,
                ..id
            },
            Identity {
                content_hash: 9,
                ..id
            },
        ];
        for (i, other) in others.iter().enumerate() {
            assert!(!is_marked(&entry, boot, other), "field {i}");
        }
        assert!(!is_marked(&entry, BootId([8; 16]), &id), "another boot");
        unmark(&entry);
        assert!(!is_marked(&entry, boot, &id), "unmarked");
        assert!(!mark_path(&entry).exists());
    }
}
