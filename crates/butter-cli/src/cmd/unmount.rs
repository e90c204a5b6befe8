//! `butter unmount DIR`: unmounts a `butter mount` and returns only once the butter process
//! serving it has exited, so its final commit is on disk. `fusermount3 -u` returns as soon as
//! the kernel lets go of the mount point, before that commit; a script that checks or reopens
//! the image right after it would see the state before.

use super::{CliError, CliResult};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct UnmountArgs {
    /// Mount point of a `butter mount`.
    pub dir: PathBuf,
    /// Detach the mount now even if it is busy; wait for the butter process to finish once the
    /// last open file on it is closed.
    #[arg(short = 'l', long)]
    pub lazy: bool,
}

/// One mount from /proc/self/mountinfo.
struct MountEntry {
    fstype: String,
    source: String,
}

/// Undoes the octal escapes of /proc/self/mountinfo (space, tab, newline, backslash).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn mount_at(dir: &Path) -> Option<MountEntry> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    // The last entry for a mount point is the one on top.
    text.lines().rev().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        let mp = unescape(left.split(' ').nth(4)?);
        if Path::new(&mp) != dir {
            return None;
        }
        let mut r = right.split(' ');
        let fstype = r.next()?.to_string();
        let source = unescape(r.next()?);
        Some(MountEntry { fstype, source })
    })
}

/// The butter processes serving `dir`: running `butter mount ... DIR ...` (the mount point
/// compared after resolving it in the process's own working directory) with /dev/fuse open.
fn servers_of(dir: &Path) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return out;
    };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Some(args) = butter::io::device::process_cmdline(pid) else {
            continue;
        };
        // `butter mount ...`, or mount(8)'s helper `mount.fuse.butter IMAGE DIR ...`.
        let helper = args.first().is_some_and(|a| {
            Path::new(a).file_name() == Some(std::ffi::OsStr::new(super::helper::MOUNT_HELPER))
        });
        let Some(m) = (if helper {
            Some(0)
        } else {
            args.iter().position(|a| a == "mount")
        }) else {
            continue;
        };
        let cwd = std::fs::read_link(format!("/proc/{pid}/cwd")).unwrap_or_default();
        let names_dir = args[m + 1..].iter().any(|a| {
            let p = cwd.join(a);
            std::fs::canonicalize(&p).map(|c| c == dir).unwrap_or(false) || p == dir
        });
        if !names_dir {
            continue;
        }
        let has_fuse = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|fds| {
                fds.flatten().any(|fd| {
                    std::fs::read_link(fd.path()).is_ok_and(|t| t == Path::new("/dev/fuse"))
                })
            })
            .unwrap_or(false);
        if has_fuse {
            out.push(pid);
        }
    }
    out
}

/// Whether the process is gone (or a zombie: it has exited and waits to be reaped).
fn exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => s
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state == "Z" || state == "X"),
    }
}

pub fn unmount(a: UnmountArgs) -> CliResult {
    let dir =
        std::fs::canonicalize(&a.dir).map_err(|e| CliError(format!("{}: {e}", a.dir.display())))?;
    let Some(m) = mount_at(&dir) else {
        return Err(CliError(format!("{} is not a mount point", dir.display())));
    };
    if !m.fstype.starts_with("fuse") {
        return Err(CliError(format!(
            "{} is a {} mount, not a butter mount: use umount",
            dir.display(),
            m.fstype
        )));
    }
    let servers = servers_of(&dir);
    crate::fuse::unmount(&dir, a.lazy).map_err(|e| {
        let busy = if e.contains("busy") {
            ": files on it are still open (close them, or use --lazy to detach it now and \
             let butter finish when they are closed)"
        } else {
            ""
        };
        CliError(format!("unmounting {}: {e}{busy}", dir.display()))
    })?;
    if servers.is_empty() {
        log::warn!(
            "no butter process serving {} was found (source {}); unmounted without waiting",
            dir.display(),
            m.source
        );
        return Ok(());
    }
    let start = Instant::now();
    let mut next_note = Duration::from_secs(2);
    while !servers.iter().all(|&p| exited(p)) {
        if start.elapsed() >= next_note {
            eprintln!(
                "butter: waiting for the butter process {} to finish writing {} ({}s)",
                servers
                    .iter()
                    .map(|p| p.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                m.source,
                start.elapsed().as_secs()
            );
            next_note += Duration::from_secs(10);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(unescape(r"/a\040b\011c\134d"), "/a b\tc\\d");
        assert_eq!(unescape(r"/plain"), "/plain");
        assert_eq!(unescape(r"/end\04"), "/end\\04");
    }
}
