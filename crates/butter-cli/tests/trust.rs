//! What keeps images people already have valid (issue "Trust every image"), each against the
//! kernel and btrfs-progs:
//! - every feature bit butter does not keep correct is refused by name before a byte changes;
//! - a quota filesystem changed by butter passes `btrfs check` (qgroups marked for a rescan),
//!   and a rescan by the kernel makes the numbers exact again;
//! - one writer: `butter mkfs -f` refuses an image that a butter mount or the kernel holds,
//!   naming who holds it;
//! - `butter unmount` returns after the final commit, with the butter process gone (also for
//!   `-d`);
//! - an unprivileged mount where /dev/fuse is closed to the user says what to do, and one
//!   where it is open works.
//!
//! Needs root, /dev/fuse, fusermount3, loop devices, kernel btrfs and btrfs-progs; fails under
//! CI without them.

mod common;

use butter::format::csum::CsumType;
use common::fuse_mount::{self, ButterMount, BUTTER};
use common::kernel::{self, LoopMount, ScratchDir};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const SIZE: u64 = 300 << 20;

fn butter(args: &[&str]) -> Output {
    kernel::run_output(Command::new(BUTTER).args(args))
}

fn text(o: &Output) -> String {
    let mut s = String::from_utf8_lossy(&o.stdout).into_owned();
    s.push_str(&String::from_utf8_lossy(&o.stderr));
    s
}

fn hash_file(p: &Path) -> Vec<u8> {
    use sha2::{Digest, Sha256};
    Sha256::digest(fs::read(p).unwrap()).to_vec()
}

/// Sets bits in the primary superblock's incompat, compat_ro or flags word and fixes its
/// checksum (crc32c), as a newer or different btrfs would have written it.
fn patch_super(img: &Path, incompat: u64, compat_ro: u64, flags: u64) {
    let mut f = fs::read(img).unwrap();
    let sb = &mut f[0x10000..0x11000];
    let or = |sb: &mut [u8], at: usize, v: u64| {
        let old = u64::from_le_bytes(sb[at..at + 8].try_into().unwrap());
        sb[at..at + 8].copy_from_slice(&(old | v).to_le_bytes());
    };
    or(sb, 56, flags);
    or(sb, 180, compat_ro);
    or(sb, 188, incompat);
    let c = CsumType::Crc32c.compute(&sb[32..]);
    sb[..32].copy_from_slice(&c);
    fs::write(img, f).unwrap();
}

#[test]
fn feature_bits_are_refused_by_name_before_any_write() {
    if !fuse_mount::require("feature_bits_are_refused_by_name_before_any_write", &[]) {
        return;
    }
    let s = ScratchDir::new("trust-features");
    let base = s.join("base.img");
    kernel::mkfs_btrfs(&base, SIZE, &["-O", "^block-group-tree"]);
    // (what to set, incompat, compat_ro, flags, the name the refusal must give, readable)
    let cases: &[(&str, u64, u64, u64, &str, bool)] = &[
        ("metadata-uuid", 1 << 10, 0, 0, "metadata-uuid", false),
        ("zoned", 1 << 12, 0, 0, "zoned", false),
        ("extent-tree-v2", 1 << 13, 0, 0, "extent-tree-v2", false),
        ("raid-stripe-tree", 1 << 14, 0, 0, "raid-stripe-tree", false),
        ("squota", 1 << 16, 0, 0, "squota", true),
        ("remap-tree", 1 << 17, 0, 0, "remap-tree", false),
        ("unknown incompat", 1 << 40, 0, 0, "incompat bit 40", false),
        ("verity", 0, 1 << 2, 0, "verity", true),
        ("unknown compat_ro", 0, 1 << 20, 0, "compat_ro bit 20", true),
        ("seeding", 0, 0, 1 << 32, "seed device", true),
        ("changing csum", 0, 0, 1 << 39, "checksum conversion", true),
    ];
    for &(what, inc, cro, fl, name, readable) in cases {
        let img = s.join(format!("{}.img", what.replace(' ', "-")));
        fs::copy(&base, &img).unwrap();
        patch_super(&img, inc, cro, fl);
        let before = hash_file(&img);
        let o = butter(&["subvolume", "create", img.to_str().unwrap(), "new"]);
        let t = text(&o);
        assert!(!o.status.success(), "{what}: butter wrote the image:\n{t}");
        assert!(
            t.contains(name),
            "{what}: the refusal does not name it:\n{t}"
        );
        assert!(!t.contains("panicked"), "{what}: {t}");
        if readable {
            assert!(t.contains("read-only instead"), "{what}: no advice:\n{t}");
            let o = butter(&["ls", img.to_str().unwrap()]);
            assert!(
                o.status.success(),
                "{what}: read-only use fails: {}",
                text(&o)
            );
        }
        // A read-write mount is refused the same way.
        let mnt = s.dir(format!("{}.mnt", what.replace(' ', "-")));
        let log = s.join("mount.log");
        match ButterMount::try_start(&img, &mnt, &[], &log) {
            Ok(m) => {
                m.unmount();
                panic!("{what}: mounted read-write");
            }
            Err((_, t)) => assert!(t.contains(name), "{what}: mount refusal:\n{t}"),
        }
        assert_eq!(hash_file(&img), before, "{what}: the image changed");
    }
    // Real images of features butter does not write: mixed block groups (mkfs -M), simple
    // quotas (mkfs -O squota), a seed device (btrfstune -S 1).
    for (what, args, tune, name) in [
        ("mixed-bg", vec!["-M"], None, "mixed-bg"),
        ("squota", vec!["-O", "squota"], None, "squota"),
        ("seed", vec![], Some("-S1"), "seed device"),
    ] {
        let img = s.join(format!("real-{what}.img"));
        kernel::mkfs_btrfs(&img, SIZE, &args);
        if let Some(t) = tune {
            kernel::run(Command::new("btrfstune").arg(t).arg(&img));
        }
        let before = hash_file(&img);
        let o = butter(&["subvolume", "create", img.to_str().unwrap(), "new"]);
        let t = text(&o);
        assert!(!o.status.success() && t.contains(name), "{what}: {t}");
        assert_eq!(hash_file(&img), before, "{what}: the image changed");
        let o = butter(&["ls", img.to_str().unwrap()]);
        assert!(
            o.status.success(),
            "{what}: read-only use fails: {}",
            text(&o)
        );
    }
}

/// The qgroup status flags of an image (from btrfs-progs' dump-tree).
fn qgroup_status(img: &Path) -> String {
    let d = kernel::dump_tree(img, &["-t", "quota"]);
    let mut lines = d.lines();
    while let Some(l) = lines.next() {
        if l.contains("QGROUP_STATUS") {
            return lines.next().unwrap_or("").trim().to_string();
        }
    }
    panic!("no qgroup status item in:\n{d}");
}

#[test]
fn quota_filesystem_changes_leave_qgroups_for_rescan() {
    if !fuse_mount::require("quota_filesystem_changes_leave_qgroups_for_rescan", &[]) {
        return;
    }
    let s = ScratchDir::new("trust-quota");
    let img = s.join("q.img");
    kernel::mkfs_btrfs(&img, SIZE, &["-O", "block-group-tree"]);
    {
        let m = LoopMount::btrfs(&img, &s.dir("k"), "");
        kernel::run(
            Command::new("btrfs")
                .args(["quota", "enable"])
                .arg(m.path()),
        );
        kernel::run(
            Command::new("btrfs")
                .args(["subvolume", "create"])
                .arg(m.path().join("sv")),
        );
        fs::write(m.path().join("sv/a"), vec![7u8; 1 << 20]).unwrap();
        fs::write(m.path().join("b"), vec![9u8; 300 << 10]).unwrap();
        kernel::run(
            Command::new("btrfs")
                .args(["quota", "rescan", "-w"])
                .arg(m.path()),
        );
        m.unmount();
    }
    kernel::assert_btrfs_check(&img);
    assert!(!qgroup_status(&img).contains("INCONSISTENT"));
    // Changes through butter: a mount writing and deleting, and a new subvolume.
    let mnt = s.dir("b");
    let m = ButterMount::start(&img, &mnt, &[], &s.join("mount.log"));
    fs::write(mnt.join("sv/c"), vec![1u8; 2 << 20]).unwrap();
    fs::remove_file(mnt.join("b")).unwrap();
    m.unmount();
    let o = butter(&["subvolume", "create", img.to_str().unwrap(), "sv2"]);
    assert!(o.status.success(), "{}", text(&o));
    let st = qgroup_status(&img);
    assert!(
        st.contains("INCONSISTENT"),
        "qgroup status not marked: {st}"
    );
    fuse_mount::verify_image(&img, &s.dir("kv"), None, "after butter's changes");
    // The kernel's rescan makes the numbers exact; btrfs check agrees, and the new
    // subvolume has its qgroup.
    {
        let m = LoopMount::btrfs(&img, &s.dir("k2"), "");
        kernel::run(
            Command::new("btrfs")
                .args(["quota", "rescan", "-w"])
                .arg(m.path()),
        );
        let show = kernel::run(
            Command::new("btrfs")
                .args(["qgroup", "show", "--raw"])
                .arg(m.path()),
        );
        let sv2 = kernel::run(
            Command::new("btrfs")
                .args(["subvolume", "show"])
                .arg(m.path().join("sv2")),
        );
        let id = sv2
            .lines()
            .find_map(|l| l.trim().strip_prefix("Subvolume ID:"))
            .map(|v| v.trim().to_string())
            .expect("subvolume id");
        assert!(
            show.contains(&format!("0/{id}")),
            "no qgroup for sv2:\n{show}"
        );
        m.unmount();
    }
    assert!(!qgroup_status(&img).contains("INCONSISTENT"));
    kernel::assert_btrfs_check(&img);
}

#[test]
fn mkfs_refuses_an_image_that_is_in_use() {
    if !fuse_mount::require("mkfs_refuses_an_image_that_is_in_use", &[]) {
        return;
    }
    let s = ScratchDir::new("trust-one-writer");
    let img = s.join("a.img");
    let o = butter(&["mkfs", "-b", "300M", img.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    let mnt = s.dir("m");
    let m = ButterMount::start(&img, &mnt, &[], &s.join("mount.log"));
    fs::write(mnt.join("kept"), b"still here").unwrap();
    let pid = m.pid().unwrap();
    let before = hash_file(&img);
    let o = butter(&["mkfs", "-f", img.to_str().unwrap()]);
    let t = text(&o);
    assert!(
        !o.status.success(),
        "mkfs -f overwrote a mounted image:\n{t}"
    );
    assert!(
        t.contains(&format!("process {pid}")) && t.contains("butter mount"),
        "the refusal does not say who holds the image:\n{t}"
    );
    assert_eq!(hash_file(&img), before, "mkfs changed the image");
    // A second writer is refused the same way.
    let o = butter(&["subvolume", "create", img.to_str().unwrap(), "x"]);
    assert!(!o.status.success() && text(&o).contains(&format!("process {pid}")));
    m.unmount();
    fuse_mount::verify_image(&img, &s.dir("k"), None, "after the refused mkfs");
    let o = butter(&["cat", img.to_str().unwrap(), "kept"]);
    assert_eq!(o.stdout, b"still here");
    // Held by the kernel: refused naming the mount (the kernel itself writes the image while
    // it is mounted, so what must hold is that the filesystem is intact afterwards).
    let k = LoopMount::btrfs(&img, &s.dir("k2"), "");
    let o = butter(&["mkfs", "-f", img.to_str().unwrap()]);
    let t = text(&o);
    assert!(
        !o.status.success() && (t.contains("mounted on") || t.contains("loop")),
        "{t}"
    );
    k.unmount();
    let o = butter(&["cat", img.to_str().unwrap(), "kept"]);
    assert_eq!(
        o.stdout,
        b"still here",
        "after the refused mkfs: {}",
        text(&o)
    );
    kernel::assert_btrfs_check(&img);
}

fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            let state = s
                .rsplit_once(')')
                .map(|(_, r)| r.trim_start().chars().next());
            !matches!(state, Some(Some('Z')))
        })
        .unwrap_or(false)
}

#[test]
fn unmount_returns_after_the_final_commit() {
    if !fuse_mount::require("unmount_returns_after_the_final_commit", &[]) {
        return;
    }
    let s = ScratchDir::new("trust-unmount");
    let img = s.join("a.img");
    let o = butter(&["mkfs", "-b", "300M", img.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    for daemon in [false, true] {
        let mnt = s.dir(format!("m{daemon}"));
        let name = format!("file-{daemon}");
        // commit=0: nothing is committed before the unmount.
        let (pid, child) = if daemon {
            let o = butter(&[
                "mount",
                "-d",
                "-o",
                "commit=0",
                img.to_str().unwrap(),
                mnt.to_str().unwrap(),
            ]);
            assert!(o.status.success(), "{}", text(&o));
            (None, None)
        } else {
            let m = ButterMount::start(&img, &mnt, &["-o", "commit=0"], &s.join("m.log"));
            (m.pid(), Some(m))
        };
        fs::write(mnt.join(&name), vec![5u8; 3 << 20]).unwrap();
        let holder = {
            let o = butter(&["mkfs", "-f", img.to_str().unwrap()]);
            text(&o)
        };
        let pid = pid.unwrap_or_else(|| {
            holder
                .split("process ")
                .nth(1)
                .and_then(|r| r.split_whitespace().next())
                .and_then(|p| p.parse().ok())
                .unwrap_or_else(|| panic!("no holder named: {holder}"))
        });
        let t = Instant::now();
        let o = butter(&["unmount", mnt.to_str().unwrap()]);
        assert!(o.status.success(), "butter unmount: {}", text(&o));
        // Returned: the process is gone and the image shows the file, at once.
        assert!(
            !alive(pid),
            "butter unmount returned while butter {pid} still runs"
        );
        let o = butter(&["ls", img.to_str().unwrap()]);
        assert!(text(&o).contains(&name), "not committed: {}", text(&o));
        let o = butter(&[
            "subvolume",
            "create",
            img.to_str().unwrap(),
            &format!("s{daemon}"),
        ]);
        assert!(o.status.success(), "reopen right after: {}", text(&o));
        eprintln!("butter unmount (daemon {daemon}) took {:?}", t.elapsed());
        if let Some(m) = child {
            // Already unmounted; reap it.
            m.unmount();
        }
        assert!(!kernel::is_mountpoint(&mnt));
    }
    fuse_mount::verify_image(&img, &s.dir("k"), None, "after butter unmount");
    // Not a butter mount: a clear refusal.
    let o = butter(&["unmount", s.path().to_str().unwrap()]);
    assert!(!o.status.success() && text(&o).contains("not a mount point"));
}

#[test]
fn unprivileged_mount_says_what_to_do_or_works() {
    if !fuse_mount::require(
        "unprivileged_mount_says_what_to_do_or_works",
        &["unshare", "setpriv", "mknod"],
    ) {
        return;
    }
    let s = ScratchDir::new("trust-unpriv");
    fs::set_permissions(s.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let src = s.dir("src");
    fs::write(src.join("hello"), b"hi\n").unwrap();
    kernel::run(Command::new("chown").args(["-R", "65534:65534"]).arg(&src));
    let img = s.join("u.img");
    let o = butter(&[
        "mkfs",
        "-b",
        "300M",
        "--rootdir",
        src.to_str().unwrap(),
        img.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    kernel::run(Command::new("chown").arg("65534:65534").arg(&img));
    let mnt = s.dir("m");
    kernel::run(Command::new("chown").arg("65534:65534").arg(&mnt));
    let out = s.join("out.txt");
    // In a mount namespace of its own, /dev/fuse is replaced by a node of the mode under test;
    // the user is nobody.
    let script = format!(
        r#"set -u
B={butter}; D={dir}; IMG={img}; M={mnt}
as_user() {{ setpriv --reuid=65534 --regid=65534 --clear-groups "$@"; }}
mount --make-rprivate / 
mknod $D/fuse600 c 10 229 && chmod 600 $D/fuse600 && mount --bind $D/fuse600 /dev/fuse
as_user $B mount -d $IMG $M > $D/closed.txt 2>&1; echo "closed rc=$?" >> $D/closed.txt
umount /dev/fuse
mknod $D/fuse666 c 10 229 && chmod 666 $D/fuse666 && mount --bind $D/fuse666 /dev/fuse
as_user $B mount -d $IMG $M > $D/open.txt 2>&1; echo "open rc=$?" >> $D/open.txt
as_user sh -c "echo written-by-nobody > $M/new && cat $M/hello" >> $D/open.txt 2>&1
as_user $B unmount $M >> $D/open.txt 2>&1; echo "unmount rc=$?" >> $D/open.txt
umount /dev/fuse
"#,
        butter = fuse_mount::butter_for_anyone(&s).display(),
        dir = s.path().display(),
        img = img.display(),
        mnt = mnt.display(),
    );
    let o = kernel::run_output(Command::new("unshare").args(["-m", "sh", "-c", &script]));
    let _ = fs::write(&out, text(&o));
    let closed = fs::read_to_string(s.join("closed.txt")).unwrap_or_default();
    assert!(
        closed.contains("closed rc=1") && closed.contains("chmod 0666 /dev/fuse"),
        "with /dev/fuse closed to the user, butter mount must fail saying what to do:\n{closed}"
    );
    assert!(!closed.contains("panicked"));
    let open = fs::read_to_string(s.join("open.txt")).unwrap_or_default();
    assert!(
        open.contains("open rc=0") && open.contains("hi") && open.contains("unmount rc=0"),
        "with /dev/fuse open, nobody's mount must work:\n{open}\n{}",
        text(&o)
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while kernel::is_mountpoint(&mnt) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let o = butter(&["cat", img.to_str().unwrap(), "new"]);
    assert_eq!(o.stdout, b"written-by-nobody\n", "{}", text(&o));
    fuse_mount::verify_image(&img, &s.dir("k"), None, "after nobody's mount");
}
