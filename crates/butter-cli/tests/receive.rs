//! `butter receive IMAGE DIR` against the kernel: streams the kernel's `btrfs send` makes
//! (a full send and a chain of three incrementals in protocol 1, a full send in protocol 2
//! with compressed data) received into images by butter must give what the source snapshots
//! hold (names, types, modes, owners, sizes, mtimes, xattrs, link targets, hard-link groups,
//! content), pass both checkers, mount in the kernel, carry their received uuids, and take a
//! further incremental stream applied by the kernel's `btrfs receive`. Damaged and hostile
//! streams fail with an error naming the command and its byte offset, change nothing outside
//! DIR, leave the half-received subvolume writable and without a received uuid, and leave the
//! image clean. Needs root, loop devices and btrfs-progs; without them the test prints a
//! notice and passes, unless CI is set.

mod common;

use common::fuse_mount::{self, butter_check, BUTTER};
use common::kernel::{self, LoopMount, ScratchDir};
use common::manifest::{self, CompareOpts, Manifest, TakeOpts};
use common::send_source::{
    make_compressed_source, make_source, received_opts, send, sh, show_field,
};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// (exit code, stdout, stderr) of `butter args`.
fn butter(args: &[&str]) -> (i32, String, String) {
    let out = kernel::run_output(Command::new(BUTTER).args(args));
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn butter_ok(args: &[&str]) -> String {
    let (rc, out, err) = butter(args);
    assert_eq!(rc, 0, "butter {args:?}: {err}{out}");
    out
}

#[test]
fn kernel_streams_received_by_butter_match_their_sources() {
    if !fuse_mount::require(
        "kernel_streams_received_by_butter_match_their_sources",
        &["setfattr", "fallocate", "python3"],
    ) {
        return;
    }
    let sc = ScratchDir::new("receive");
    let src = sc.join("src.img");
    fuse_mount::fresh_image(&src, 512 << 20);
    let streams = sc.dir("streams");
    let (mans, uuids) = make_source(&src, &sc.dir("src"), &streams);

    // The chain into a butter-made image, the incrementals through standard input.
    let dst = sc.join("dst.img");
    fs::File::create(&dst).unwrap().set_len(512 << 20).unwrap();
    butter_ok(&["mkfs", s(&dst)]);
    butter_ok(&["receive", "-f", s(&streams.join("s0")), s(&dst), "/"]);
    for i in 1..4 {
        let out = kernel::run_output(
            Command::new(BUTTER)
                .args(["receive", s(&dst), "/"])
                .stdin(fs::File::open(streams.join(format!("s{i}"))).unwrap()),
        );
        assert!(
            out.status.success(),
            "butter receive of s{i} from stdin: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let list = butter_ok(&["subvolume", "list", "-R", s(&dst)]);
    for (i, uuid) in uuids.iter().enumerate().take(4) {
        assert!(
            list.contains(uuid.as_str()),
            "s{i}'s received uuid {uuid} is not in butter subvolume list -R:\n{list}"
        );
    }
    let (rc, out) = butter_check(&dst);
    assert_eq!(rc, 0, "butter check after the chain:\n{out}");
    kernel::assert_btrfs_check(&dst);
    {
        let m = LoopMount::btrfs(&dst, &sc.dir("dst"), "");
        for (i, want) in mans.iter().enumerate().take(4) {
            let at = m.path().join(format!("s{i}"));
            let got = manifest::take(&at, &TakeOpts::default());
            manifest::assert_same(want, &got, &received_opts(), &format!("s{i} received"));
            assert_eq!(show_field(&at, "Received UUID"), uuids[i]);
            assert!(show_field(&at, "Flags").contains("readonly"));
        }
        // The kernel's own receive finds s3 by the received uuid butter recorded.
        let out = kernel::run_output(
            Command::new("btrfs")
                .args(["receive", "-f"])
                .arg(streams.join("s4"))
                .arg(m.path()),
        );
        assert!(
            out.status.success(),
            "btrfs receive of s4 onto butter's s3: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got = manifest::take(&m.path().join("s4"), &TakeOpts::default());
        manifest::assert_same(
            &mans[4],
            &got,
            &received_opts(),
            "s4 received by the kernel",
        );
        m.unmount();
    }
    kernel::assert_btrfs_check(&dst);
    let (rc, out) = butter_check(&dst);
    assert_eq!(rc, 0, "butter check after the kernel's receive:\n{out}");

    // Protocol 2 with compressed data, into a block-group-tree image of mkfs.btrfs: the
    // compressed extents are stored as they come.
    {
        let want = make_compressed_source(&src, &sc.dir("src"), &streams.join("c0"));
        let dst2 = sc.join("dst2.img");
        kernel::mkfs_btrfs(&dst2, 256 << 20, &["-O", "block-group-tree"]);
        butter_ok(&["receive", "-f", s(&streams.join("c0")), s(&dst2), "/"]);
        let (rc, out) = butter_check(&dst2);
        assert_eq!(rc, 0, "butter check after the v2 receive:\n{out}");
        kernel::assert_btrfs_check(&dst2);
        let tree = kernel::dump_tree(&dst2, &["-t", "256"]);
        for alg in ["zlib", "lzo", "zstd"] {
            assert!(
                tree.contains(&format!("({alg})")),
                "no {alg} extent stored as it came:\n{tree}"
            );
        }
        let m = LoopMount::btrfs_ro(&dst2, &sc.dir("dst2"));
        let got = manifest::take(&m.path().join("c0"), &TakeOpts::default());
        manifest::assert_same(&want, &got, &received_opts(), "c0 received (protocol 2)");
        m.unmount();
    }
}

/// A send stream built by hand: version 1, commands with their crc32c.
struct Stream(Vec<u8>);

impl Stream {
    fn new() -> Stream {
        let mut b = b"btrfs-stream\0".to_vec();
        b.extend_from_slice(&1u32.to_le_bytes());
        Stream(b)
    }

    fn cmd(mut self, kind: u16, attrs: &[(u16, &[u8])]) -> Stream {
        let mut p = Vec::new();
        for (t, v) in attrs {
            p.extend_from_slice(&t.to_le_bytes());
            p.extend_from_slice(&(v.len() as u16).to_le_bytes());
            p.extend_from_slice(v);
        }
        let mut c = (p.len() as u32).to_le_bytes().to_vec();
        c.extend_from_slice(&kind.to_le_bytes());
        c.extend_from_slice(&[0; 4]);
        c.extend_from_slice(&p);
        let crc = !crc32c::crc32c_append(!0, &c);
        c[6..10].copy_from_slice(&crc.to_le_bytes());
        self.0.extend_from_slice(&c);
        self
    }

    fn subvol(self, name: &str) -> Stream {
        self.cmd(
            1,
            &[
                (15, name.as_bytes()),
                (1, &[0x5a; 16]),
                (2, &7u64.to_le_bytes()),
            ],
        )
    }

    fn mkfile(self, path: &str) -> Stream {
        self.cmd(3, &[(15, path.as_bytes()), (3, &300u64.to_le_bytes())])
    }

    fn end(self) -> Stream {
        self.cmd(21, &[])
    }
}

#[test]
fn damaged_and_hostile_streams_fail_cleanly() {
    if !fuse_mount::require(
        "damaged_and_hostile_streams_fail_cleanly",
        &["setfattr", "python3"],
    ) {
        return;
    }
    let sc = ScratchDir::new("receive-bad");
    let src = sc.join("src.img");
    fuse_mount::fresh_image(&src, 256 << 20);
    let full = sc.join("full");
    {
        let m = LoopMount::btrfs(&src, &sc.dir("src"), "");
        sh(
            "btrfs subvolume create x >/dev/null
             cd x; echo a > f; mkdir d; ln -s f l; setfattr -n user.k -v v f
             dd if=/dev/urandom of=big bs=64k count=3 2>/dev/null; cd ..
             btrfs subvolume snapshot -r x x1 >/dev/null",
            m.path(),
        );
        send(m.path(), &["-f", s(&full), "x1"]);
        m.unmount();
    }
    let good = fs::read(&full).unwrap();

    let dst = sc.join("dst.img");
    fuse_mount::fresh_image(&dst, 256 << 20);
    {
        let m = LoopMount::btrfs(&dst, &sc.dir("dst"), "");
        sh(
            "mkdir outside; echo keep > outside/file; ln -s / outside/root
             for i in $(seq 0 40); do mkdir d$i; done",
            m.path(),
        );
        m.unmount();
    }
    let outside = |img: &Path| -> Manifest {
        let m = LoopMount::btrfs_ro(img, &sc.dir("look"));
        let got = manifest::take(&m.path().join("outside"), &TakeOpts::default());
        m.unmount();
        got
    };
    let before = outside(&dst);
    let mut dir = 0;
    let mut next_dir = || {
        dir += 1;
        format!("/d{dir}")
    };
    let mut try_receive = |bytes: &[u8], what: &str| -> (String, String) {
        let f = sc.join("bad");
        fs::write(&f, bytes).unwrap();
        let d = next_dir();
        let (rc, _, err) = butter(&["receive", "-q", "-f", s(&f), s(&dst), &d]);
        assert!(rc != 0 && rc != 101, "{what}: exit {rc}, stderr:\n{err}");
        assert!(err.contains("byte"), "{what}: no byte offset in:\n{err}");
        (d, err)
    };

    // Cut short, and one byte changed, at spread-out places.
    let n = good.len();
    for k in 1..12 {
        let at = n * k / 12;
        try_receive(&good[..at], &format!("stream cut at {at} of {n}"));
        let mut flipped = good.clone();
        flipped[at] ^= 0x20;
        try_receive(&flipped, &format!("byte {at} of {n} changed"));
    }

    // Hostile commands: each fails naming its index (the third command) and offset, and the
    // subvolume received so far stays writable, without a received uuid.
    let hostile: Vec<(&str, Stream)> = vec![
        (
            "a path up out of DIR",
            Stream::new().subvol("h").mkfile("f").mkfile("../evil"),
        ),
        (
            "an absolute path",
            Stream::new().subvol("h").mkfile("f").mkfile("/evil"),
        ),
        (
            "a path through a symlink",
            Stream::new()
                .subvol("h")
                .cmd(8, &[(15, b"l"), (17, b"/"), (3, &300u64.to_le_bytes())])
                .mkfile("l/evil"),
        ),
        (
            "a rename out of DIR",
            Stream::new()
                .subvol("h")
                .mkfile("f")
                .cmd(9, &[(15, b"f"), (16, b"../f")]),
        ),
        (
            "a clone from a subvolume not received here",
            Stream::new().subvol("h").mkfile("f").cmd(
                16,
                &[
                    (15, b"f"),
                    (18, &0u64.to_le_bytes()),
                    (24, &4096u64.to_le_bytes()),
                    (20, &[0x77; 16]),
                    (21, &1u64.to_le_bytes()),
                    (22, b"f"),
                    (23, &0u64.to_le_bytes()),
                ],
            ),
        ),
        (
            "an unknown command",
            Stream::new().subvol("h").mkfile("f").cmd(99, &[]),
        ),
        (
            "an unknown attribute",
            Stream::new()
                .subvol("h")
                .mkfile("f")
                .cmd(3, &[(15, b"g"), (77, b"?")]),
        ),
    ];
    for (what, st) in hostile {
        let bytes = st.end().0;
        let (d, err) = try_receive(&bytes, what);
        assert!(
            err.contains("command 3 (") && err.contains("at byte"),
            "{what}: the error does not name the command:\n{err}"
        );
        let show = butter_ok(&["subvolume", "show", s(&dst), &format!("{d}/h")]);
        assert!(
            !show.contains("readonly"),
            "{what}: the half-received subvolume is read-only:\n{show}"
        );
        let received = show
            .lines()
            .find(|l| l.contains("Received UUID"))
            .unwrap_or_default()
            .to_string();
        assert!(
            received.trim_end().ends_with('-'),
            "{what}: the half-received subvolume has a received uuid: {received}"
        );
    }

    let (rc, out) = butter_check(&dst);
    assert_eq!(rc, 0, "butter check after the bad streams:\n{out}");
    kernel::assert_btrfs_check(&dst);
    let after = outside(&dst);
    manifest::assert_same(&before, &after, &CompareOpts::all(), "outside DIR");
    let m = LoopMount::btrfs_ro(&dst, &sc.dir("look"));
    for i in 0..=41 {
        let stray: PathBuf = m.path().join(format!("d{i}/evil"));
        assert!(!stray.exists(), "{} was written", stray.display());
    }
    assert!(!m.path().join("evil").exists());
    m.unmount();
}
