//! `butter receive --dump` against `btrfs receive --dump`, byte for byte, on streams the
//! kernel makes: full and incremental, protocol 1 and 2, `--no-data`, two subvolumes in one
//! send, over files, hard links, a device node, a socket, a fifo, a symlink, xattrs, a
//! reflinked copy, a preallocated file, a truncate, renames, removals and a file attribute.
//! A stream damaged anywhere gives an error naming the command and its byte offset, never a
//! panic. Needs root, loop devices and btrfs-progs; without them the test prints a notice and
//! passes, unless CI is set.

mod common;

use common::fuse_mount::{self, BUTTER};
use common::kernel::{self, LoopMount, ScratchDir};
use common::send_source::sh;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::Command;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// (exit status success, stdout, stderr) of `prog args`.
fn run(prog: &str, args: &[&str]) -> (bool, Vec<u8>, String) {
    let out = kernel::run_output(Command::new(prog).args(args));
    (
        out.status.success(),
        out.stdout,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn dump_matches_btrfs_receive_dump() {
    if !fuse_mount::require(
        "dump_matches_btrfs_receive_dump",
        &["setfattr", "fallocate", "chattr"],
    ) {
        return;
    }
    let sc = ScratchDir::new("receive-dump");
    let img = sc.join("a.img");
    fuse_mount::fresh_image(&img, 512 << 20);
    let streams = sc.dir("streams");
    {
        let m = LoopMount::btrfs(&img, &sc.dir("k"), "");
        let p = m.path();
        sh(
            "btrfs subvolume create x >/dev/null
             cd x
             echo a > f; ln f hard; mkdir dd; mknod cdev c 1 3; mkfifo fifo; ln -s f l
             python3 -c \"import socket; socket.socket(socket.AF_UNIX).bind('sock')\"
             dd if=/dev/urandom of=big bs=64k count=4 2>/dev/null
             cp --reflink=always big big2
             setfattr -n user.a -v 1 f
             fallocate -l 1M pre
             truncate -s 1000 f
             cd ..
             btrfs subvolume snapshot -r x x1 >/dev/null
             cd x
             rm hard; rmdir dd; setfattr -x user.a f; truncate -s 10 f; mv l l2
             chattr +A big
             cd ..
             btrfs subvolume snapshot -r x x2 >/dev/null",
            p,
        );
        let st = |name: &str| streams.join(name).to_str().unwrap().to_string();
        for args in [
            vec!["-f".to_string(), st("full"), "x1".into()],
            vec![
                "-p".into(),
                "x1".into(),
                "-f".into(),
                st("inc"),
                "x2".into(),
            ],
            vec![
                "--proto".into(),
                "2".into(),
                "-f".into(),
                st("full2"),
                "x1".into(),
            ],
            vec![
                "--proto".into(),
                "2".into(),
                "-p".into(),
                "x1".into(),
                "-f".into(),
                st("inc2"),
                "x2".into(),
            ],
            vec!["--no-data".into(), "-f".into(), st("nodata"), "x1".into()],
            vec!["-f".into(), st("two"), "x1".into(), "x2".into()],
        ] {
            let mut c = Command::new("btrfs");
            c.arg("send").arg("-q").args(&args).current_dir(p);
            let out = kernel::run_output(&mut c);
            assert!(
                out.status.success(),
                "btrfs send {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        m.unmount();
    }
    for name in ["full", "inc", "full2", "inc2", "nodata", "two"] {
        let f = streams.join(name);
        let (ok, ours, err) = run(BUTTER, &["receive", "--dump", "-f", s(&f)]);
        assert!(ok, "butter receive --dump {name}: {err}");
        let (ok, theirs, err) = run("btrfs", &["receive", "--dump", "-f", s(&f)]);
        assert!(ok, "btrfs receive --dump {name}: {err}");
        assert!(
            ours == theirs,
            "{name}: butter and btrfs dump differently:\nbutter:\n{}\nbtrfs:\n{}",
            String::from_utf8_lossy(&ours),
            String::from_utf8_lossy(&theirs)
        );
        assert!(!ours.is_empty());
    }
    // Damage: every 97th byte flipped in turn, and the stream cut short: an error that names
    // where, never a panic.
    let full = fs::read(streams.join("full")).unwrap();
    let bad = streams.join("bad");
    let mut refused = 0;
    for at in (17..full.len()).step_by(97) {
        let mut b = full.clone();
        b[at] ^= 0x5a;
        fs::write(&bad, &b).unwrap();
        let (ok, _, err) = run(BUTTER, &["receive", "--dump", "-f", s(&bad)]);
        assert!(!err.contains("panicked"), "byte {at}: {err}");
        if !ok {
            refused += 1;
            assert!(
                err.contains("at byte "),
                "byte {at}: the error names no offset: {err}"
            );
        }
    }
    assert!(refused > 0, "no damaged stream was refused");
    fs::write(&bad, &full[..full.len() / 2]).unwrap();
    let (ok, _, err) = run(BUTTER, &["receive", "--dump", "-f", s(&bad)]);
    assert!(!ok && err.contains("ends inside"), "a cut stream: {err}");
}

/// Names as users make them: every length from 1 to 255 bytes, with spaces, tabs, newlines,
/// backslashes, control bytes and bytes that are not UTF-8, as file, directory, symlink,
/// hard link, xattr and subvolume names; full and incremental (renames, clones from those
/// paths). `btrfs receive --dump` escapes them and pads paths to 32 columns or one space;
/// times are in the local zone (a POSIX TZ string here, which needs no tzdata). Both the
/// kernel's stream and butter's send of the same snapshots are compared.
#[test]
fn dump_matches_btrfs_receive_dump_with_odd_names() {
    if !fuse_mount::require(
        "dump_matches_btrfs_receive_dump_with_odd_names",
        &["python3"],
    ) {
        return;
    }
    let sc = ScratchDir::new("receive-dump-names");
    let img = sc.join("a.img");
    fuse_mount::fresh_image(&img, 512 << 20);
    let streams = sc.dir("streams");
    // The subvolume's own name has a space, a newline and a byte that is not UTF-8.
    let script = r#"
import os, subprocess, sys
os.chdir(sys.argv[1])
alphabet = [b for b in range(1, 256) if b != 0x2f]
def name(n, salt):
    s = bytes(alphabet[(n * 7 + i * 13 + salt) % len(alphabet)] for i in range(n))
    return s if s not in (b".", b"..") else b"x" * n
sv = b"sub vol\n\xe9"
if sys.argv[2] == "make":
    subprocess.run([b"btrfs", b"subvolume", b"create", sv], check=True, stdout=subprocess.DEVNULL)
    os.chdir(sv)
    d = name(40, 3)
    os.mkdir(d)
    for n in range(1, 256):
        p = name(n, 0)
        with open(p, "wb") as f:
            f.write(b"%d\n" % n)
        if n % 17 == 0:
            os.symlink(name(n, 5), name(n, 1))
        if n % 23 == 0:
            os.link(p, os.path.join(d, name(n, 2)))
        if n % 31 == 0:
            os.setxattr(p, b"user." + name(min(n, 200), 4).replace(b"\0", b"a"), name(n, 6) + b"\0" + name(3, 7))
    big = name(33, 8)
    with open(big, "wb") as f:
        f.write(os.urandom(128 << 10))
    subprocess.run([b"cp", b"--reflink=always", big, name(34, 9)], check=True)
else:
    os.chdir(sv)
    for n in range(1, 256, 3):
        os.rename(name(n, 0), name(n, 10))
    subprocess.run([b"cp", b"--reflink=always", name(33, 8), name(200, 11)], check=True)
    os.removexattr(name(62, 0), b"user." + name(62, 4))
"#;
    let py = sc.join("names.py");
    fs::write(&py, script).unwrap();
    let sv = std::ffi::OsStr::from_bytes(b"sub vol\n\xe9");
    // The first snapshot's name too (the stream's subvol command carries it).
    let s1 = std::ffi::OsStr::from_bytes(b"snap\t1 \xff");
    {
        let m = LoopMount::btrfs(&img, &sc.dir("k"), "");
        let p = m.path();
        let py_run = |step: &str| {
            let out = kernel::run_output(Command::new("python3").arg(&py).arg(p).arg(step));
            assert!(
                out.status.success(),
                "names.py {step}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        py_run("make");
        let send = |args: &[&std::ffi::OsStr]| {
            let out = kernel::run_output(
                Command::new("btrfs")
                    .arg("send")
                    .arg("-q")
                    .args(args)
                    .current_dir(p),
            );
            assert!(
                out.status.success(),
                "btrfs send {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let snap = |to: &std::ffi::OsStr| {
            let out = kernel::run_output(
                Command::new("btrfs")
                    .args(["subvolume", "snapshot", "-r"])
                    .arg(sv)
                    .arg(to)
                    .current_dir(p),
            );
            assert!(out.status.success(), "snapshot {to:?}");
        };
        snap(s1);
        py_run("change");
        snap("s2".as_ref());
        let f = |n: &str| streams.join(n).into_os_string();
        send(&["-f".as_ref(), &f("s1"), s1]);
        send(&["-p".as_ref(), s1, "-f".as_ref(), &f("inc"), "s2".as_ref()]);
        m.unmount();
    }
    // butter's own send of the same snapshots.
    for (name, args) in [
        ("b-s1", vec![s1]),
        ("b-inc", vec!["-p".as_ref(), s1, "s2".as_ref()]),
    ] {
        let out = kernel::run_output(
            Command::new(BUTTER)
                .args(["send", "-q", "-f", s(&streams.join(name))])
                .arg(&img)
                .args(&args),
        );
        assert!(
            out.status.success(),
            "butter send {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut escaped = 0;
    for name in ["s1", "inc", "b-s1", "b-inc"] {
        let f = streams.join(name);
        let dump = |prog: &str| {
            let out = kernel::run_output(
                Command::new(prog)
                    .args(["receive", "--dump", "-f", s(&f)])
                    .env("TZ", "XST-5:30"),
            );
            assert!(
                out.status.success(),
                "{prog} receive --dump {name}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            out.stdout
        };
        let (ours, theirs) = (dump(BUTTER), dump("btrfs"));
        let (ol, tl): (Vec<&[u8]>, Vec<&[u8]>) = (
            ours.split(|&b| b == b'\n').collect(),
            theirs.split(|&b| b == b'\n').collect(),
        );
        for (i, (o, t)) in ol.iter().zip(&tl).enumerate() {
            assert!(
                o == t,
                "{name} line {}: butter and btrfs differ:\nbutter: {}\nbtrfs:  {}",
                i + 1,
                String::from_utf8_lossy(o),
                String::from_utf8_lossy(t)
            );
        }
        assert_eq!(ol.len(), tl.len(), "{name}: line counts differ");
        assert!(
            theirs.windows(5).any(|w| w == b"+0530"),
            "{name}: no local times"
        );
        escaped += theirs
            .windows(2)
            .filter(|w| w == b"\\n" || w == b"\\ ")
            .count();
    }
    assert!(
        escaped > 1000,
        "the streams had few escaped names ({escaped})"
    );
}
