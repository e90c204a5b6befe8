//! Every image of btrfs-progs' checker corpus (tests/corpus/) that `btrfs check --readonly`
//! calls clean goes through a read-write session on `butter mount`: files created, written,
//! renamed and deleted, pre-existing files renamed and deleted, then the unmount. Afterwards
//! both checkers must call the image clean and a kernel mount must show exactly the change.
//! An image butter cannot write must be refused by name (and still open read-only); an image
//! that neither mounts read-write nor is refused with a reason fails the test, as does a
//! panic or a hang.
//!
//! Needs root, /dev/fuse, fusermount3, loop devices, kernel btrfs and btrfs-progs (with
//! btrfs-image for the metadata dumps); without them it fails under CI.

mod common;

use common::corpus::{self, CorpusImage};
use common::fuse_mount::{self, ButterMount, BUTTER};
use common::kernel::{self, LoopMount, ScratchDir};
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

/// How long the file operations of one session may take before it counts as a hang.
const OPS_LIMIT: Duration = Duration::from_secs(90);

/// What happened to one image.
enum Outcome {
    /// btrfs check does not call it clean: no read-write session (it would only add damage).
    Damaged,
    /// butter refused to write it, naming why, and it opens read-only.
    Refused(String),
    /// The session ran and every check after it passed.
    Written(String),
}

fn data_for(name: &str, len: usize) -> Vec<u8> {
    let mut x: u32 = name.bytes().fold(0x811c9dc5u32, |h, b| {
        (h ^ b as u32).wrapping_mul(0x01000193)
    });
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

/// What the session did to pre-existing top-level files, to be found again by the kernel.
#[derive(Default, Debug)]
struct Changes {
    deleted: Option<String>,
    moved: Option<(String, String)>,
}

/// The session's file operations on the mount at `m` (run on a worker thread, so that a hang
/// is caught by a timeout).
fn session(m: &Path, tag: &str) -> std::io::Result<Changes> {
    let mut ch = Changes::default();
    // Pre-existing regular files at the top: delete one and rename another (their data is not
    // read: metadata dumps carry no data blocks).
    let mut files: Vec<String> = Vec::new();
    for e in fs::read_dir(m)? {
        let e = e?;
        let md = fs::symlink_metadata(e.path())?;
        if md.file_type().is_file() {
            files.push(e.file_name().to_string_lossy().into_owned());
        }
    }
    files.sort();
    if let Some(f) = files.first() {
        fs::remove_file(m.join(f))?;
        ch.deleted = Some(f.clone());
    }
    if let Some(f) = files.get(1) {
        let to = format!("{f}.moved-by-butter");
        fs::rename(m.join(f), m.join(&to))?;
        ch.moved = Some((f.clone(), to));
    }
    let d = m.join("butter-rw");
    fs::create_dir(&d)?;
    fs::write(d.join("a"), data_for(tag, 300 << 10))?;
    fs::write(d.join("b"), data_for("b", 3000))?;
    fs::write(d.join("small"), b"inline bytes\n")?;
    fs::rename(d.join("a"), d.join("c"))?;
    fs::remove_file(d.join("b"))?;
    fs::create_dir(d.join("sub"))?;
    fs::rename(d.join("small"), d.join("sub/small"))?;
    let f = fs::OpenOptions::new().write(true).open(d.join("c"))?;
    f.sync_all()?;
    Ok(ch)
}

/// The kernel's view after the session: the change is there, and only the change.
fn kernel_sees(root: &Path, tag: &str, ch: &Changes) -> Result<(), String> {
    let d = root.join("butter-rw");
    let c = fs::read(d.join("c")).map_err(|e| format!("read butter-rw/c: {e}"))?;
    if c != data_for(tag, 300 << 10) {
        return Err("butter-rw/c has other bytes than were written".into());
    }
    let small = fs::read(d.join("sub/small")).map_err(|e| format!("read sub/small: {e}"))?;
    if small != b"inline bytes\n" {
        return Err("butter-rw/sub/small has other bytes than were written".into());
    }
    for gone in ["a", "b", "small"] {
        if d.join(gone).symlink_metadata().is_ok() {
            return Err(format!("butter-rw/{gone} should be gone"));
        }
    }
    if let Some(f) = &ch.deleted {
        if root.join(f).symlink_metadata().is_ok() {
            return Err(format!("deleted file {f} is still there"));
        }
    }
    if let Some((from, to)) = &ch.moved {
        if root.join(from).symlink_metadata().is_ok() {
            return Err(format!("renamed file {from} is still under its old name"));
        }
        if !root.join(to).symlink_metadata().is_ok_and(|m| m.is_file()) {
            return Err(format!("renamed file {to} is missing"));
        }
    }
    Ok(())
}

fn run_one(img: &CorpusImage, scratch: &ScratchDir) -> Result<Outcome, String> {
    let safe = img.name.replace('/', "__");
    let copy = scratch.join(format!("{safe}.raw"));
    corpus::copy_to(img, &copy);
    let (clean, _) = kernel::btrfs_check(&copy);
    if !clean {
        let _ = fs::remove_file(&copy);
        return Ok(Outcome::Damaged);
    }
    // Some images btrfs check calls clean the kernel refuses to mount (a relocation tree of
    // a non-subvolume, a dev extent without a chunk): for those the kernel's view cannot be
    // compared, only both checkers.
    let kmnt: PathBuf = scratch.dir(format!("{safe}.kmnt"));
    let kernel_mounts =
        std::panic::catch_unwind(|| LoopMount::btrfs_ro(&copy, &kmnt).unmount()).is_ok();
    let mnt = scratch.dir(format!("{safe}.mnt"));
    let log = scratch.join(format!("{safe}.log"));
    let mount = match ButterMount::try_start(&copy, &mnt, &[], &log) {
        Ok(m) => m,
        Err((st, text)) => {
            if text.contains("panicked") || st.code() == Some(101) {
                return Err(format!("butter mount panicked:\n{text}"));
            }
            if !text.contains("read-only instead") {
                return Err(format!(
                    "butter mount failed ({st}) without naming a feature it refuses:\n{text}"
                ));
            }
            // Refused by name: it must still open read-only.
            let out = kernel::run_output(Command::new(BUTTER).arg("ls").arg(&copy));
            if !out.status.success() {
                return Err(format!(
                    "refused read-write, and `butter ls` fails too: {}",
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
            let reason = text
                .lines()
                .find(|l| l.contains("read-only instead"))
                .unwrap_or("")
                .to_string();
            let _ = fs::remove_file(&copy);
            return Ok(Outcome::Refused(reason));
        }
    };
    let (tx, rx) = mpsc::channel();
    let at = mount.path().to_path_buf();
    let tag = img.name.clone();
    std::thread::spawn(move || {
        let _ = tx.send(session(&at, &tag));
    });
    let ch = match rx.recv_timeout(OPS_LIMIT) {
        Ok(Ok(ch)) => ch,
        Ok(Err(e)) => {
            let log = mount.log_text();
            drop(mount);
            return Err(format!(
                "a file operation failed: {e}\nbutter's log:\n{log}"
            ));
        }
        Err(_) => {
            let log = mount.log_text();
            mount.kill9();
            return Err(format!(
                "the file operations hung for {OPS_LIMIT:?}\nbutter's log:\n{log}"
            ));
        }
    };
    let inode_of_root = fs::metadata(mount.path()).map(|m| m.ino()).unwrap_or(0);
    mount.unmount();
    let (ok, text) = kernel::btrfs_check(&copy);
    if !ok {
        return Err(format!("btrfs check after the session:\n{text}"));
    }
    let (rc, text) = fuse_mount::butter_check(&copy);
    if rc != 0 {
        let (rc0, _) = fuse_mount::butter_check(&img.path);
        let before = if rc0 != 0 {
            "butter check calls the unchanged image unclean too (a false error of butter's checker; see tests/corpus.rs)"
        } else {
            "the unchanged image was clean to butter check"
        };
        return Err(format!(
            "butter check after the session ({before}):\n{text}"
        ));
    }
    let kernel = if kernel_mounts {
        let km = LoopMount::btrfs_ro(&copy, &kmnt);
        let seen = kernel_sees(km.path(), &img.name, &ch);
        km.unmount();
        seen.map_err(|e| format!("the kernel mount after the session: {e}"))?;
        "the kernel shows the change"
    } else {
        "the kernel refuses to mount the original too: checkers only"
    };
    let _ = fs::remove_file(&copy);
    Ok(Outcome::Written(format!(
        "{kernel}; deleted {:?}, moved {:?} (root inode {inode_of_root})",
        ch.deleted, ch.moved
    )))
}

#[test]
fn corpus_read_write_sessions() {
    if !fuse_mount::require("corpus_read_write_sessions", &["btrfs-image", "xz"]) {
        return;
    }
    let images = corpus::images();
    assert!(images.len() >= 79, "corpus has {} images", images.len());
    let scratch = ScratchDir::new("corpus-rw");
    let (mut written, mut refused, mut damaged) = (0, 0, 0);
    let mut failures = Vec::new();
    for img in &images {
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_one(img, &scratch)));
        match res {
            Ok(Ok(Outcome::Damaged)) => {
                damaged += 1;
                println!("{:60} damaged (btrfs check): not written", img.name);
            }
            Ok(Ok(Outcome::Refused(why))) => {
                refused += 1;
                println!("{:60} refused: {why}", img.name);
            }
            Ok(Ok(Outcome::Written(what))) => {
                written += 1;
                println!("{:60} written, both checkers clean: {what}", img.name);
            }
            Ok(Err(e)) => {
                println!("{:60} FAILED", img.name);
                failures.push(format!("{}: {e}", img.name));
            }
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                println!("{:60} FAILED (panic in the test)", img.name);
                failures.push(format!("{}: {msg}", img.name));
            }
        }
    }
    println!(
        "corpus read-write: {} images: {written} written and clean, {refused} refused by name, {damaged} damaged (not written), {} failed",
        images.len(),
        failures.len()
    );
    assert!(written > 0, "no corpus image was written at all");
    assert!(
        failures.is_empty(),
        "{} corpus images failed the read-write session:\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}
