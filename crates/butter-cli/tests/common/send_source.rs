//! The source side of the send/receive tests: a kernel-made subvolume with every kind of
//! inode, changed between five read-only snapshots in the ways an incremental send has to
//! express (renames across directories, a directory moved under its former child, swapped
//! names, hard links added and removed, inode numbers reused, overwrites, truncates, punched
//! holes, reflinks, xattrs), and the kernel's streams of them.

use super::kernel::{self, LoopMount};
use super::manifest::{self, CompareOpts, Manifest, TakeOpts};
use std::path::Path;
use std::process::Command;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Runs `script` with `sh -e` in `dir`; panics with its stderr when it fails.
pub fn sh(script: &str, dir: &Path) {
    let out = Command::new("sh")
        .arg("-ec")
        .arg(script)
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// What a received copy must share with its source: everything but ctime, birth time and
/// inode numbers (a receive makes new inodes, and changes them after the stream's times).
pub fn received_opts() -> CompareOpts {
    CompareOpts {
        ctime: false,
        btime: false,
        atime: false,
        inode_numbers: false,
        subvolumes: false,
        ..CompareOpts::all()
    }
}

/// `btrfs send -q ARGS` run in `dir`.
pub fn send(dir: &Path, args: &[&str]) {
    let mut c = Command::new("btrfs");
    c.arg("send").arg("-q").args(args).current_dir(dir);
    let out = kernel::run_output(&mut c);
    assert!(
        out.status.success(),
        "btrfs send {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A field of `btrfs subvolume show PATH` ("UUID", "Received UUID", "Flags", ...).
pub fn show_field(path: &Path, field: &str) -> String {
    let text = kernel::sh("btrfs", &["subvolume", "show", s(path)]);
    text.lines()
        .find_map(|l| {
            let (k, v) = l.trim().split_once(':')?;
            (k.trim() == field).then(|| v.trim().to_string())
        })
        .unwrap_or_else(|| panic!("no {field} in btrfs subvolume show:\n{text}"))
}

/// The source: a subvolume changed between four read-only snapshots s0..s3 (and s4 for the
/// kernel's own receive at the end), with every kind of inode and the changes an incremental
/// send has to express. Returns the manifests of s0..s4 and the snapshots' uuids.
pub fn make_source(img: &Path, mnt: &Path, streams: &Path) -> (Vec<Manifest>, Vec<String>) {
    let m = LoopMount::btrfs(img, mnt, "");
    let p = m.path();
    sh(
        "btrfs subvolume create x >/dev/null
         cd x
         echo hello > f; ln f hard; mkdir -p d/e/g; mknod cdev c 1 3; mknod bdev b 7 200
         mkfifo fifo; ln -s f link; ln -s /nowhere/at/all dangling
         python3 -c \"import socket; socket.socket(socket.AF_UNIX).bind('sock')\"
         dd if=/dev/urandom of=big bs=64k count=20 2>/dev/null
         cp --reflink=always big big.clone
         setfattr -n user.a -v 1 f; setfattr -n user.empty d
         fallocate -l 1M pre; truncate -s 3M sparse; echo tail >> sparse
         head -c 3000 /dev/urandom > small
         chown 1000:1000 f; chown 7:8 d; chmod 4755 big; chmod 1777 d/e
         touch -d '2001-02-03 04:05:06.789' small
         cd ..
         btrfs subvolume snapshot -r x s0 >/dev/null
         cd x
         rm hard; mv d/e/g g2; mv f d/f; echo new > newf; mv d/e e2; mv e2 d/e2
         dd if=/dev/urandom of=big bs=4k count=3 seek=5 conv=notrunc 2>/dev/null
         setfattr -x user.a d/f; setfattr -n user.b -v two newf; ln newf d/newf.link
         cd ..
         btrfs subvolume snapshot -r x s1 >/dev/null
         cd x
         mv d/newf.link nl; mv newf d/newf; mkdir d/sub; mv d/sub tmpdir
         mv tmpdir d/e2/deeper; mv d/e2 top; truncate -s 100 big.clone
         fallocate -p -o 65536 -l 65536 big; rm -f sparse; echo again > sparse
         cp --reflink=always big big.c2
         cd ..
         btrfs subvolume snapshot -r x s2 >/dev/null
         cd x
         mv link link.tmp; mv small link; mv link.tmp small
         rm -rf top; mkdir top; echo reused > top/r; chmod 600 top/r
         for i in $(seq 1 40); do echo $i > n$i; done; rm n7 n9
         cd ..
         btrfs subvolume snapshot -r x s3 >/dev/null
         cd x
         rm n1; echo last > last
         cd ..
         btrfs subvolume snapshot -r x s4 >/dev/null",
        p,
    );
    let st = |n: &str| s(&streams.join(n)).to_string();
    send(p, &["-f", &st("s0"), "s0"]);
    send(p, &["-p", "s0", "-f", &st("s1"), "s1"]);
    send(p, &["-p", "s1", "-f", &st("s2"), "s2"]);
    send(p, &["-p", "s2", "-f", &st("s3"), "s3"]);
    send(p, &["-p", "s3", "-f", &st("s4"), "s4"]);
    let mut mans = Vec::new();
    let mut uuids = Vec::new();
    for i in 0..5 {
        let snap = p.join(format!("s{i}"));
        mans.push(manifest::take(&snap, &TakeOpts::default()));
        uuids.push(show_field(&snap, "UUID"));
    }
    m.unmount();
    (mans, uuids)
}

/// A subvolume `c` written with zstd, zlib and lzo (one directory each, by the
/// btrfs.compression property), small files inline and compressed, and incompressible data;
/// its read-only snapshot `c0` sent by the kernel with protocol 2 and compressed data into
/// `stream`. Returns the manifest of `c0`.
pub fn make_compressed_source(img: &Path, mnt: &Path, stream: &Path) -> Manifest {
    let m = LoopMount::btrfs(img, mnt, "compress=zstd");
    sh(
        "btrfs subvolume create c >/dev/null
         for a in zstd zlib lzo; do
           mkdir c/$a; btrfs property set c/$a compression $a
           python3 -c \"import random; r=random.Random(7); w=[b'alpha',b'beta ',b'gamma\\n']
open('c/$a/text','wb').write(b''.join(r.choice(w) for _ in range(200000)))
open('c/$a/small','wb').write(b'y'*2500)\"
         done
         head -c 300000 /dev/urandom > c/random
         sync; btrfs subvolume snapshot -r c c0 >/dev/null",
        m.path(),
    );
    send(
        m.path(),
        &["--proto", "2", "--compressed-data", "-f", s(stream), "c0"],
    );
    let want = manifest::take(&m.path().join("c0"), &TakeOpts::default());
    m.unmount();
    want
}
