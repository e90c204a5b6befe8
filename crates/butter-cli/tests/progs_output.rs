//! Where the README promises btrfs-progs' output, butter's is byte for byte btrfs-progs 6.14's
//! on the same image: `subvolume list` (`butter subvolumes`) with every column option and
//! `-r`, `subvolume show` of every subvolume (snapshots listed, quota groups with quotas on,
//! times in the local zone), `subvolume get-default`. The kernel makes the image: subvolumes
//! and snapshots with names of every length from 1 to 255 bytes, with spaces, tabs, newlines
//! and bytes that are not UTF-8, nested and read-only. (`receive --dump` is compared in
//! receive_dump.rs.) Needs root, loop devices and btrfs-progs; fails under CI without.

mod common;

use common::fuse_mount::{self, BUTTER};
use common::kernel::{self, FsType, LoopMount, ScratchDir};
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::Path;
use std::process::Command;

/// A POSIX time zone (no tzdata needed) with an offset, so local times show.
const TZ: &str = "XST-5:30";

/// stdout of `prog args...` in TZ; panics with stderr when it fails.
fn out(prog: &str, args: &[&OsStr]) -> Vec<u8> {
    let o = kernel::run_output(Command::new(prog).args(args).env("TZ", TZ));
    assert!(
        o.status.success(),
        "{prog} {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o.stdout
}

fn same(what: &str, ours: &[u8], theirs: &[u8]) {
    assert!(
        ours == theirs,
        "{what}: butter and btrfs-progs differ:\nbutter:\n{}\nbtrfs:\n{}",
        String::from_utf8_lossy(ours),
        String::from_utf8_lossy(theirs)
    );
}

/// Name `n` bytes long: every byte but '/' and NUL turns up across the lengths.
fn name(n: usize, salt: usize) -> Vec<u8> {
    let alphabet: Vec<u8> = (1..=255u8).filter(|&b| b != b'/').collect();
    let s: Vec<u8> = (0..n)
        .map(|i| alphabet[(n * 7 + i * 13 + salt) % alphabet.len()])
        .collect();
    if s == b"." || s == b".." {
        vec![b'x'; n]
    } else {
        s
    }
}

#[test]
fn subvolume_list_show_and_get_default_match_btrfs_progs() {
    if !fuse_mount::require("subvolume_list_show_and_get_default_match_btrfs_progs", &[]) {
        return;
    }
    let sc = ScratchDir::new("progs-output");
    let img = sc.join("a.img");
    fuse_mount::fresh_image(&img, 512 << 20);
    let mut paths: Vec<Vec<u8>> = Vec::new();
    {
        let m = LoopMount::btrfs(&img, &sc.dir("k"), "");
        let p = m.path();
        let run = |args: &[&OsStr]| {
            out("btrfs", args);
        };
        let at = |rel: &[u8]| -> OsString {
            let mut b = p.as_os_str().as_bytes().to_vec();
            b.push(b'/');
            b.extend_from_slice(rel);
            OsString::from_vec(b)
        };
        run(&["quota".as_ref(), "enable".as_ref(), p.as_os_str()]);
        run(&["subvolume".as_ref(), "create".as_ref(), &at(b"@")]);
        for n in 1..=255 {
            let nm = name(n, 0);
            // Every fifth inside @ (nested), the others at the top level.
            let rel = if n % 5 == 0 {
                [&b"@/"[..], &nm].concat()
            } else {
                nm
            };
            run(&["subvolume".as_ref(), "create".as_ref(), &at(&rel)]);
            std::fs::write(Path::new(&at(&rel)).join("f"), vec![b'd'; 1000 * n]).unwrap();
            paths.push(rel);
        }
        // Snapshots of @ (read-only and not), of a snapshot, and of the top level.
        for (src, dst, ro) in [
            (&b"@"[..], &b"@ snap\n1"[..], true),
            (b"@", b"@/inner\xff", false),
            (b"@ snap\n1", b"snap of snap", true),
            (b"", b"top\tsnap", false),
        ] {
            let mut args: Vec<OsString> = vec!["subvolume".into(), "snapshot".into()];
            if ro {
                args.push("-r".into());
            }
            args.push(at(src));
            args.push(at(dst));
            let args: Vec<&OsStr> = args.iter().map(|a| a.as_os_str()).collect();
            run(&args);
            paths.push(dst.to_vec());
        }
        run(&[
            "quota".as_ref(),
            "rescan".as_ref(),
            "-w".as_ref(),
            p.as_os_str(),
        ]);
        run(&["subvolume".as_ref(), "set-default".as_ref(), &at(b"@")]);
        m.unmount();
    }
    // The kernel's view through a read-only mount of the top level (nothing changes on disk),
    // butter's from the image.
    let m = LoopMount::new(&img, &sc.dir("ro"), FsType::Btrfs, "ro,noatime,subvolid=5");
    let mp = m.path().as_os_str();
    let i = img.as_os_str();
    let mut compared = 0;
    for opts in [
        vec![],
        vec!["-p"],
        vec!["-c"],
        vec!["-g"],
        vec!["-u"],
        vec!["-q"],
        vec!["-R"],
        vec!["-r"],
        vec!["-p", "-c", "-u", "-q", "-R"],
        vec!["-R", "-u", "-r", "-q"],
    ] {
        let opts: Vec<&OsStr> = opts.iter().map(OsStr::new).collect();
        let theirs = out(
            "btrfs",
            &[&["subvolume".as_ref(), "list".as_ref()][..], &opts, &[mp]].concat(),
        );
        let ours = out(
            BUTTER,
            &[&["subvolume".as_ref(), "list".as_ref()][..], &opts, &[i]].concat(),
        );
        same(&format!("subvolume list {opts:?}"), &ours, &theirs);
        compared += 1;
    }
    let theirs = out("btrfs", &["subvolume".as_ref(), "get-default".as_ref(), mp]);
    let ours = out(BUTTER, &["subvolume".as_ref(), "get-default".as_ref(), i]);
    same("subvolume get-default", &ours, &theirs);
    paths.push(b"@".to_vec());
    paths.push(Vec::new());
    for rel in &paths {
        let mut k = mp.as_bytes().to_vec();
        k.push(b'/');
        k.extend_from_slice(rel);
        let theirs = out(
            "btrfs",
            &["subvolume".as_ref(), "show".as_ref(), OsStr::from_bytes(&k)],
        );
        let shown = if rel.is_empty() { &b"/"[..] } else { rel };
        let ours = out(
            BUTTER,
            &[
                "subvolume".as_ref(),
                "show".as_ref(),
                "--subvol-id".as_ref(),
                "5".as_ref(),
                "--".as_ref(),
                i,
                OsStr::from_bytes(shown),
            ],
        );
        same(
            &format!("subvolume show {}", String::from_utf8_lossy(rel)),
            &ours,
            &theirs,
        );
        compared += 1;
    }
    m.unmount();
    assert!(compared > 260, "only {compared} comparisons");
    let (rc, report) = fuse_mount::butter_check(&img);
    assert_eq!(rc, 0, "{report}");
}
