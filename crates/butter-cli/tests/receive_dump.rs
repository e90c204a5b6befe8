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
