//! Block devices: the only place bytes enter or leave the engine.
//!
//! [`FileDevice`] serves an image file or a block device; tests and benchmarks also have a
//! device in memory with fault injection (`crate::io::ram`, under the `internals` feature).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Byte-addressed storage. Reads and writes are exact: a short read is an error.
pub trait BlockDevice: Send + Sync {
    /// Reads exactly `buf.len()` bytes at `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes all of `buf` at `offset`.
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Makes every completed write durable.
    fn flush(&self) -> io::Result<()>;
    /// Size in bytes.
    fn len(&self) -> u64;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Hint that `range` will be read soon (no-op by default).
    fn will_need(&self, _offset: u64, _len: u64) {}
    /// Makes the device `len` bytes long where it can change size (an image file grows or is
    /// cut); one that cannot accepts any length up to its own (by default) and refuses more.
    fn set_len(&self, len: u64) -> io::Result<()> {
        if len <= self.len() {
            return Ok(());
        }
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("the device is {} bytes and cannot grow", self.len()),
        ))
    }
}

/// An image file or block device.
pub struct FileDevice {
    file: File,
    /// Its size: an image file's changes with [`BlockDevice::set_len`], a block device's is
    /// read again there (a partition or volume grown meanwhile).
    len: std::sync::atomic::AtomicU64,
    regular: bool,
}

/// The size of a block device (or any file) open as `file`: where its end is.
fn end_of(file: &File) -> io::Result<u64> {
    use std::io::Seek;
    let mut f = file;
    f.seek(io::SeekFrom::End(0))
}

impl FileDevice {
    pub fn open(path: &Path, writable: bool) -> io::Result<FileDevice> {
        let file = OpenOptions::new().read(true).write(writable).open(path)?;
        let meta = file.metadata()?;
        let regular = meta.file_type().is_file();
        let len = if regular { meta.len() } else { end_of(&file)? };
        Ok(FileDevice {
            file,
            len: len.into(),
            regular,
        })
    }

    /// Opens an image file or block device read-write for the only writer: an image file gets
    /// an exclusive `flock` (held as long as the device is open, released by the kernel when
    /// the process dies, even by SIGKILL), a block device is opened `O_EXCL` (which fails
    /// while the kernel has it mounted). An image file that backs a loop device is refused
    /// too: the kernel may have it mounted. Errors have kind `ResourceBusy` and say who holds
    /// the image.
    pub fn open_exclusive(path: &Path) -> io::Result<FileDevice> {
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        let meta = std::fs::metadata(path)?;
        let busy = |why: String| io::Error::new(io::ErrorKind::ResourceBusy, why);
        if meta.file_type().is_file() {
            if let Some(dev) = loop_device_backed_by(meta.dev(), meta.ino()) {
                return Err(busy(format!(
                    "the image backs loop device {dev}, so the kernel may have it mounted: \
                     unmount it and detach the loop device (umount, losetup -d {dev}) first"
                )));
            }
            let dev = FileDevice::open(path, true)?;
            // A writer that is finishing (a mount's final commit after its unmount) lets go
            // within moments: wait a little for it before giving up.
            let deadline = std::time::Instant::now() + LOCK_WAIT;
            let mut told = false;
            loop {
                match dev.file.try_lock() {
                    Ok(()) => return Ok(dev),
                    Err(std::fs::TryLockError::WouldBlock) => {}
                    Err(std::fs::TryLockError::Error(e)) => return Err(e),
                }
                let who = || lock_holder(meta.dev(), meta.ino());
                if std::time::Instant::now() >= deadline {
                    return Err(busy(format!(
                        "the image is open read-write in {}: unmount it first (butter unmount \
                         MOUNTPOINT waits for its last commit), wait for it to finish, or open \
                         the image read-only",
                        who().unwrap_or_else(|| "another butter process".into())
                    )));
                }
                if !told && deadline - std::time::Instant::now() < LOCK_WAIT / 2 {
                    log::info!(
                        "waiting for {} to let go of {}",
                        who().unwrap_or_else(|| "another butter process".into()),
                        path.display()
                    );
                    told = true;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        } else {
            /// Linux O_EXCL: on a block device, fail with EBUSY while it is mounted or opened
            /// exclusively by someone else.
            const O_EXCL: i32 = 0o200;
            const EBUSY: i32 = 16;
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(O_EXCL)
                .open(path)
                .map_err(|e| {
                    if e.raw_os_error() == Some(EBUSY) {
                        busy(
                            "the device is in use (mounted by the kernel, or open read-write in \
                             another butter process): unmount it first"
                                .into(),
                        )
                    } else {
                        e
                    }
                })?;
            let len = end_of(&file)?;
            Ok(FileDevice {
                file,
                len: len.into(),
                regular: false,
            })
        }
    }
}

/// How long a read-write open waits for another writer to let go of an image.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Who holds the write lock (`flock`) on the file with this device and inode number: "butter
/// process PID (`COMMAND LINE`)", from /proc/locks and /proc/PID/cmdline.
pub(crate) fn lock_holder(dev: u64, ino: u64) -> Option<String> {
    // Linux's encoding of a dev_t into major and minor numbers.
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    let want = format!("{major:02x}:{minor:02x}:{ino}");
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    let pid = locks.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        // N: FLOCK ADVISORY WRITE PID MAJ:MIN:INO START END
        (f.len() >= 6 && f[1] == "FLOCK" && f[3] == "WRITE" && f[5] == want)
            .then(|| f[4].parse::<u32>().ok())
            .flatten()
    })?;
    let cmd = process_cmdline(pid).unwrap_or_default().join(" ");
    Some(if cmd.is_empty() {
        format!("process {pid}")
    } else {
        format!("process {pid} (`{cmd}`)")
    })
}

/// The argument vector of process `pid` (from /proc/PID/cmdline), if it is readable.
pub fn process_cmdline(pid: u32) -> Option<Vec<String>> {
    let b = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(
        b.split(|&c| c == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect(),
    )
}

/// The loop device (`/dev/loopN`) whose backing file is the file with this device and inode
/// number, if any (from /sys/block/loop*/loop/backing_file).
fn loop_device_backed_by(dev: u64, ino: u64) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    for e in std::fs::read_dir("/sys/block").ok()?.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with("loop") {
            continue;
        }
        let Ok(backing) = std::fs::read_to_string(e.path().join("loop/backing_file")) else {
            continue;
        };
        let backing = backing.trim_end_matches('\n');
        if let Ok(m) = std::fs::metadata(backing) {
            if m.dev() == dev && m.ino() == ino {
                return Some(format!("/dev/{name}"));
            }
        }
    }
    None
}

impl BlockDevice for FileDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let len = self.len();
        if offset
            .checked_add(buf.len() as u64)
            .is_none_or(|end| end > len)
        {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "read of {} bytes at {offset} beyond device end {len}",
                    buf.len(),
                ),
            ));
        }
        self.file.read_exact_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(buf, offset)
    }
    /// Asks the kernel to start reading the range into its page cache (a whole-tree walk
    /// on a cold cache then waits on one read at a time no longer).
    fn will_need(&self, offset: u64, len: u64) {
        use std::os::fd::AsRawFd;
        let (Ok(off), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
            return;
        };
        // SAFETY: posix_fadvise only reads its integer arguments; the descriptor is open for
        // as long as `self.file` lives. A failed hint changes nothing.
        unsafe {
            libc::posix_fadvise(self.file.as_raw_fd(), off, len, libc::POSIX_FADV_WILLNEED);
        }
    }
    fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }
    fn len(&self) -> u64 {
        self.len.load(std::sync::atomic::Ordering::Acquire)
    }
    fn set_len(&self, len: u64) -> io::Result<()> {
        use std::sync::atomic::Ordering;
        if self.regular {
            self.file.set_len(len)?;
            self.len.store(len, Ordering::Release);
            return Ok(());
        }
        let now = end_of(&self.file)?;
        self.len.store(now, Ordering::Release);
        if len > now {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!(
                    "the device is {now} bytes: make it larger first (the partition, the volume)"
                ),
            ));
        }
        Ok(())
    }
}
