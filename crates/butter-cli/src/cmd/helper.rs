//! mount(8) and umount(8) helpers: the butter binary invoked as `mount.fuse.butter` or
//! `umount.fuse.butter` (links `scripts/install` puts in /sbin).
//!
//! `mount -t fuse.butter IMAGE DIR -o OPTIONS`, and an fstab line
//! `IMAGE DIR fuse.butter OPTIONS 0 0`, make mount(8) run
//! `mount.fuse.butter IMAGE DIR [-sfnv] [-N NS] [-o OPTIONS] [-t TYPE]`; that becomes
//! `butter mount -d IMAGE DIR -o OPTIONS`, which returns once the mount is usable and serves
//! in the background, as mount(8) expects of a helper. umount(8) runs
//! `umount.fuse.butter DIR [-flnrv] [-N NS] [-t TYPE]`, which becomes `butter unmount DIR`
//! (`-l`: `--lazy`): it returns once the serving process has made its final commit.
//!
//! umount(8) runs a helper for a FUSE mount only when libmount's table of userspace mount
//! options (/run/mount/utab) names one with `uhelper=`. A mount made through the helper
//! records `uhelper=butter` there itself (unless the user's options did, which mount(8)
//! records), and takes it out when the mount ends however it ends.

use std::ffi::OsString;
use std::path::Path;

pub const MOUNT_HELPER: &str = "mount.fuse.butter";
pub const UMOUNT_HELPER: &str = "umount.fuse.butter";

/// What a helper invocation asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Helper {
    /// Not invoked as a helper: butter's own command line.
    No,
    /// The arguments of the butter command that does the job (without the program name).
    Run(Vec<OsString>),
    /// `-f` (fake): mount(8) asks for everything but the mount itself.
    Nothing,
    /// A usage error, said in mount(8)'s terms.
    Usage(String),
}

/// The helper call in `argv` (program name first), if the program was invoked by a helper's
/// name.
pub fn from_args(argv: &[OsString]) -> Helper {
    let Some(name) = argv
        .first()
        .and_then(|a| Path::new(a).file_name())
        .and_then(|n| n.to_str())
    else {
        return Helper::No;
    };
    let mount = match name {
        MOUNT_HELPER => true,
        UMOUNT_HELPER => false,
        _ => return Helper::No,
    };
    let mut positional: Vec<OsString> = Vec::new();
    let mut options: Vec<OsString> = Vec::new();
    let (mut fake, mut lazy) = (false, false);
    let mut it = argv[1..].iter();
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        if s == "-o" || s == "-N" || s == "-t" {
            let Some(v) = it.next() else {
                return Helper::Usage(format!("{name}: {s} needs a value"));
            };
            if s == "-o" {
                options.push(v.clone());
            }
        } else if let Some(v) = s.strip_prefix("-o").filter(|v| !v.is_empty()) {
            options.push(v.into());
        } else if s.starts_with('-') && s.len() > 1 && !s.starts_with("--") {
            // Flags mount(8) and umount(8) pass on: -s sloppy, -n no mtab, -v verbose,
            // -r remount read-only on failure, -f fake (mount) or force (umount), -l lazy.
            for f in s[1..].chars() {
                match f {
                    'f' if mount => fake = true,
                    'l' if !mount => lazy = true,
                    's' | 'n' | 'v' | 'r' | 'f' => {}
                    // -N and -t glued to their value.
                    'N' | 't' => break,
                    _ => return Helper::Usage(format!("{name}: unknown flag -{f}")),
                }
            }
        } else {
            positional.push(a.clone());
        }
    }
    if mount {
        let [image, dir] = &positional[..] else {
            return Helper::Usage(format!(
                "usage: {MOUNT_HELPER} IMAGE DIR [-o OPTIONS] (as mount -t fuse.butter runs it)"
            ));
        };
        if fake {
            return Helper::Nothing;
        }
        let mut out: Vec<OsString> = vec!["mount".into(), "-d".into(), "--as-mount-helper".into()];
        for o in options {
            out.push("-o".into());
            out.push(o);
        }
        out.push(image.clone());
        out.push(dir.clone());
        Helper::Run(out)
    } else {
        let [dir] = &positional[..] else {
            return Helper::Usage(format!(
                "usage: {UMOUNT_HELPER} DIR (as umount runs it for a fuse.butter mount)"
            ));
        };
        let mut out: Vec<OsString> = vec!["unmount".into()];
        if lazy {
            out.push("--lazy".into());
        }
        out.push(dir.clone());
        Helper::Run(out)
    }
}

const UTAB_DIR: &str = "/run/mount";
const UTAB: &str = "/run/mount/utab";
const UTAB_LOCK: &str = "/run/mount/utab.lock";

/// A path as libmount writes it in utab: space, tab, newline and backslash as octal escapes.
fn mangle(p: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let mut out = String::new();
    for &b in p.as_os_str().as_bytes() {
        if matches!(b, b' ' | b'\t' | b'\n' | b'\\') || !b.is_ascii() {
            out.push_str(&format!("\\{b:03o}"));
        } else {
            out.push(b as char);
        }
    }
    out
}

/// Runs `f` on utab's lines under libmount's lock, and writes back what it returns (through a
/// new file renamed over the old, as libmount does). Errors are left to the caller to ignore:
/// utab is a convenience for umount(8), not the mount.
fn edit_utab(f: impl FnOnce(Vec<String>) -> Vec<String>) -> std::io::Result<()> {
    use std::os::unix::io::AsRawFd;
    std::fs::create_dir_all(UTAB_DIR)?;
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(UTAB_LOCK)?;
    // SAFETY: flock on a descriptor we own; the lock goes with the file at the end.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let old = std::fs::read_to_string(UTAB).unwrap_or_default();
    let lines = f(old.lines().map(str::to_string).collect());
    let tmp = format!("{UTAB}.butter.{}", std::process::id());
    let mut text = lines.join("\n");
    if !text.is_empty() {
        text.push('\n');
    }
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, UTAB)
}

fn utab_target(line: &str) -> Option<&str> {
    line.split(' ').find_map(|f| f.strip_prefix("TARGET="))
}

/// Records `uhelper=butter` for the mount on `target` (absolute), unless utab has an entry
/// for it already (mount(8) writes one when the user's options hold userspace options).
pub fn utab_add(source: &Path, target: &Path) {
    let t = mangle(target);
    let r = edit_utab(|mut lines| {
        if !lines.iter().any(|l| utab_target(l) == Some(t.as_str())) {
            lines.push(format!(
                "SRC={} TARGET={t} ROOT=/ OPTS=uhelper=butter",
                mangle(source)
            ));
        }
        lines
    });
    if let Err(e) = r {
        log::warn!(
            "could not record the mount in {UTAB} (umount will not wait for the final commit): {e}"
        );
    }
}

/// Takes the `uhelper=butter` entry for `target` out of utab, if it is there.
pub fn utab_remove(target: &Path) {
    let t = mangle(target);
    if !std::fs::read_to_string(UTAB)
        .is_ok_and(|s| s.lines().any(|l| utab_target(l) == Some(t.as_str())))
    {
        return;
    }
    let _ = edit_utab(|lines| {
        lines
            .into_iter()
            .filter(|l| !(utab_target(l) == Some(t.as_str()) && l.contains("uhelper=butter")))
            .collect()
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<OsString> {
        a.iter().map(OsString::from).collect()
    }

    #[test]
    fn utab_paths_are_mangled_as_libmount_does() {
        assert_eq!(mangle(Path::new("/mnt/a b\\c")), "/mnt/a\\040b\\134c");
    }

    #[test]
    fn helper_calls_become_butter_commands() {
        assert_eq!(from_args(&args(&["butter", "ls", "x"])), Helper::No);
        assert_eq!(
            from_args(&args(&[
                "/sbin/mount.fuse.butter",
                "/img",
                "/mnt",
                "-n",
                "-o",
                "rw,noatime",
                "-t",
                "fuse.butter"
            ])),
            Helper::Run(args(&[
                "mount",
                "-d",
                "--as-mount-helper",
                "-o",
                "rw,noatime",
                "/img",
                "/mnt"
            ]))
        );
        assert_eq!(
            from_args(&args(&[
                "mount.fuse.butter",
                "/img",
                "/mnt",
                "-ocompress=zstd:-3"
            ])),
            Helper::Run(args(&[
                "mount",
                "-d",
                "--as-mount-helper",
                "-o",
                "compress=zstd:-3",
                "/img",
                "/mnt"
            ]))
        );
        assert_eq!(
            from_args(&args(&["mount.fuse.butter", "/img", "/mnt", "-sfv"])),
            Helper::Nothing
        );
        assert!(matches!(
            from_args(&args(&["mount.fuse.butter", "/img"])),
            Helper::Usage(_)
        ));
        assert!(matches!(
            from_args(&args(&["mount.fuse.butter", "/img", "/mnt", "-o"])),
            Helper::Usage(_)
        ));
        assert_eq!(
            from_args(&args(&[
                "/sbin/umount.fuse.butter",
                "/mnt",
                "-l",
                "-t",
                "fuse.butter"
            ])),
            Helper::Run(args(&["unmount", "--lazy", "/mnt"]))
        );
        assert_eq!(
            from_args(&args(&["umount.fuse.butter", "/mnt", "-n"])),
            Helper::Run(args(&["unmount", "/mnt"]))
        );
    }
}
