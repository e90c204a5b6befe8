//! What a new user meets first, said in their words: each case runs the command as a user
//! would and checks what it prints.
//!
//! - A missing image is "no such file", not an I/O error at byte 0 (ls, cat, check, mount,
//!   a read-write command).
//! - A missing mount point says it does not exist and how to make it.
//! - `mkfs -f` of an image the user may not write says "permission denied", not "in use".
//! - An empty input to `receive` says there is no stream, not that a stream is damaged.
//! - `receive -q` prints nothing but errors (no "At subvol").
//! - A mount in the foreground says where it is mounted and how to unmount it.
//! - `ls IMAGE FILE` lists the file, as ls(1) does.
//! - `df` on a mount shows what the kernel's btrfs shows on the same image, and the space of
//!   a removed file is back after `sync` (a look at the free space commits what was freed).
//! - With a distribution layout (`@` the default subvolume), `--subvol-id 5` takes the paths
//!   `butter subvolumes` prints in every command that takes a path; without it a top-level
//!   path that is not found names the option.
//! - `cat` of a damaged block says so once, with what to do.
//!
//! Needs root (a user switch, FUSE, btrfs-progs for the images); fails under CI without.

mod common;

use common::fuse_mount::{self, ButterMount, BUTTER};
use common::kernel::{self, ScratchDir};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

/// `butter ARGS...` with `stdin`: (exit code, stdout, stderr).
fn butter_in(args: &[&str], stdin: Stdio) -> (Option<i32>, String, String) {
    let out = kernel::run_output(Command::new(BUTTER).args(args).stdin(stdin));
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn butter(args: &[&str]) -> (Option<i32>, String, String) {
    butter_in(args, Stdio::null())
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn a_missing_image_or_mount_point_is_named_as_missing() {
    if !fuse_mount::require("a_missing_image_or_mount_point_is_named_as_missing", &[]) {
        return;
    }
    let sc = ScratchDir::new("first-hour-missing");
    let gone = sc.join("no-such.img");
    for args in [
        vec!["ls", s(&gone)],
        vec!["cat", s(&gone), "etc/hostname"],
        vec!["check", s(&gone)],
        vec!["subvolume", "create", s(&gone), "sv"],
        vec!["mount", s(&gone), s(&sc.dir("m"))],
    ] {
        let (code, _, err) = butter(&args);
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert!(
            err.contains("no such file") && !err.contains("I/O error") && !err.contains("byte 0"),
            "{args:?}: {err}"
        );
    }
    let img = sc.join("t.img");
    fuse_mount::fresh_image(&img, 256 << 20);
    let nodir = sc.join("not-made-yet");
    let (code, _, err) = butter(&["mount", s(&img), s(&nodir)]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("does not exist") && err.contains("mkdir -p"),
        "{err}"
    );
}

#[test]
fn mkfs_of_an_image_the_user_may_not_write_says_so() {
    if !fuse_mount::require("mkfs_of_an_image_the_user_may_not_write_says_so", &[]) {
        return;
    }
    let sc = ScratchDir::new("first-hour-perm");
    fs::set_permissions(sc.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let img = sc.join("ro.img");
    fs::File::create(&img).unwrap().set_len(256 << 20).unwrap();
    fs::set_permissions(&img, fs::Permissions::from_mode(0o444)).unwrap();
    let bin = fuse_mount::butter_for_anyone(&sc);
    let out = kernel::run_output(
        Command::new(&bin)
            .args(["mkfs", "-f", s(&img)])
            .uid(65534)
            .gid(65534),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("permission denied") && !err.contains("in use"),
        "{err}"
    );
}

#[test]
fn receive_of_nothing_and_receive_quiet() {
    if !fuse_mount::require("receive_of_nothing_and_receive_quiet", &[]) {
        return;
    }
    let sc = ScratchDir::new("first-hour-receive");
    let img = sc.join("t.img");
    fuse_mount::fresh_image(&img, 256 << 20);
    // An empty input: no stream at all, not a damaged one.
    let empty = sc.join("empty");
    fs::write(&empty, b"").unwrap();
    let (code, _, err) = butter_in(
        &["receive", s(&img), "/"],
        Stdio::from(fs::File::open(&empty).unwrap()),
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("empty") && !err.contains("damaged"), "{err}");
    let (code, _, err) = butter(&["receive", "-f", s(&empty), s(&img), "/"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("empty") && !err.contains("damaged"), "{err}");
    // -q: errors only.
    let (code, _, err) = butter(&["subvolume", "create", s(&img), "sv"]);
    assert_eq!(code, Some(0), "{err}");
    let (code, _, err) = butter(&["subvolume", "snapshot", "-r", s(&img), "sv", "snap"]);
    assert_eq!(code, Some(0), "{err}");
    let stream = sc.join("s.stream");
    let (code, _, err) = butter(&["send", "-q", "-f", s(&stream), s(&img), "/snap"]);
    assert_eq!(code, Some(0), "{err}");
    let (code, _, err) = butter(&["subvolume", "create", s(&img), "in"]);
    assert_eq!(code, Some(0), "{err}");
    let (code, out, err) = butter(&["receive", "-q", "-f", s(&stream), s(&img), "in"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!((out.as_str(), err.as_str()), ("", ""), "receive -q printed");
    // Without -q, btrfs receive's line.
    let (code, _, err) = butter(&["subvolume", "create", s(&img), "in2"]);
    assert_eq!(code, Some(0), "{err}");
    let (code, _, err) = butter(&["receive", "-f", s(&stream), s(&img), "in2"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("At subvol snap"), "{err}");
    let (ok, text) = kernel::btrfs_check(&img);
    assert!(ok, "{text}");
}

#[test]
fn a_foreground_mount_says_where_it_is() {
    if !fuse_mount::require("a_foreground_mount_says_where_it_is", &[]) {
        return;
    }
    let sc = ScratchDir::new("first-hour-mount");
    let img = sc.join("t.img");
    fuse_mount::fresh_image(&img, 256 << 20);
    let m = ButterMount::start(&img, &sc.dir("m"), &[], &sc.join("m.log"));
    let dir = m.path().to_path_buf();
    // The line comes once the mount is usable: wait for it a moment.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let mut log = m.log_text();
    while !log.contains("is mounted on") && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
        log = m.log_text();
    }
    m.unmount();
    assert!(
        log.contains(&format!("is mounted on {} (read-write)", dir.display()))
            && log.contains(&format!("umount {}", dir.display())),
        "{log}"
    );
}

/// (f_blocks, f_bfree, f_bavail) in bytes.
fn statvfs(p: &Path) -> (u64, u64, u64) {
    let c = std::ffi::CString::new(s(p)).unwrap();
    // SAFETY: statvfs into a zeroed struct we own.
    let mut v: libc::statvfs = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::statvfs(c.as_ptr(), &mut v) };
    assert_eq!(r, 0, "statvfs {p:?}: {}", std::io::Error::last_os_error());
    let f = v.f_frsize as u64;
    (
        v.f_blocks as u64 * f,
        v.f_bfree as u64 * f,
        v.f_bavail as u64 * f,
    )
}

/// `df` on a fresh mount shows what the kernel's btrfs shows on the same image (used: the
/// bytes the block groups use and the global reserve, not the chunks allocated), and after
/// `rm big; sync` the space is back at once.
#[test]
fn statfs_is_the_kernels_and_space_comes_back_after_rm() {
    if !fuse_mount::require("statfs_is_the_kernels_and_space_comes_back_after_rm", &[]) {
        return;
    }
    let sc = ScratchDir::new("first-hour-statfs");
    let img = sc.join("t.img");
    fuse_mount::fresh_image(&img, 256 << 20);
    let copy = sc.join("k.img");
    fs::copy(&img, &copy).unwrap();
    let k = kernel::LoopMount::btrfs(&copy, &sc.dir("k"), "");
    let want = statvfs(k.path());
    k.unmount();
    let m = ButterMount::start(&img, &sc.dir("m"), &[], &sc.join("m.log"));
    let got = statvfs(m.path());
    let near = |a: u64, b: u64| a.abs_diff(b) <= want.0 / 50;
    assert_eq!(got.0, want.0, "size: butter {got:?}, kernel {want:?}");
    assert!(
        near(got.1, want.1) && near(got.2, want.2),
        "free/available: butter {got:?}, kernel {want:?} (bytes)"
    );
    // 64 MiB written and made durable, then removed: `sync; df` has it back.
    let big = m.path().join("big");
    let f = fs::File::create(&big).unwrap();
    std::io::Write::write_all(&mut &f, &vec![0x5au8; 64 << 20]).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let full = statvfs(m.path());
    assert!(
        full.2 + (60 << 20) <= got.2,
        "64 MiB written, yet {full:?} vs {got:?}"
    );
    fs::remove_file(&big).unwrap();
    kernel::sync_all();
    // The file goes when the kernel forgets its inode (FUSE's FORGET, sent with the unlink
    // and served beside this statfs): a moment, far from the 30 s of a timed commit.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    let mut after = statvfs(m.path());
    while after.2 + (4 << 20) < got.2 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
        after = statvfs(m.path());
    }
    assert!(
        after.2 + (4 << 20) >= got.2,
        "after rm and sync: {after:?}, before the write: {got:?}"
    );
    m.unmount();
    let (ok, text) = kernel::btrfs_check(&img);
    assert!(ok, "{text}");
}

/// Mount options as users and fstab lines write them: what the kernel's btrfs accepts is
/// accepted (what changes nothing for an image is ignored), zstd's negative levels compress,
/// and the kernel reads what was written.
#[test]
fn mount_options_as_users_write_them() {
    if !fuse_mount::require("mount_options_as_users_write_them", &[]) {
        return;
    }
    let sc = ScratchDir::new("first-hour-options");
    let img = sc.join("t.img");
    fuse_mount::fresh_image(&img, 256 << 20);
    let opts = "defaults,relatime,noatime,space_cache=v2,ssd,nossd,discard,discard=async,\
                autodefrag,user_subvol_rm_allowed,x-systemd.automount,x-systemd.device-timeout=10,\
                nofail,compress=zstd:-3";
    let m = ButterMount::start(&img, &sc.dir("m"), &["-o", opts], &sc.join("m.log"));
    let text = "compressible line of text\n".repeat(20_000);
    fs::write(m.path().join("f"), &text).unwrap();
    let want = common::manifest::take(m.path(), &Default::default());
    m.unmount();
    fuse_mount::verify_image(
        &img,
        &sc.dir("v"),
        Some(&want),
        "options as users write them",
    );
    // Compressed: the file's extents take less than its size.
    let out = kernel::run_output(Command::new(BUTTER).args(["compsize", s(&img), "f"]));
    let listing = String::from_utf8_lossy(&out.stdout);
    assert!(listing.contains("zstd"), "{listing}");
    // Still refused: what butter does not know.
    let (code, _, err) = butter(&["mount", s(&img), s(&sc.dir("m2")), "-o", "frobnicate"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("unknown mount option 'frobnicate'"), "{err}");
}

/// `ls IMAGE FILE` lists the file, as ls(1) does, with -l too (a symlink shows its target).
#[test]
fn ls_of_a_file_lists_it() {
    if !fuse_mount::require("ls_of_a_file_lists_it", &[]) {
        return;
    }
    let sc = ScratchDir::new("first-hour-ls");
    let src = sc.dir("src");
    fs::create_dir(src.join("etc")).unwrap();
    fs::write(src.join("etc/hostname"), b"host\n").unwrap();
    std::os::unix::fs::symlink("hostname", src.join("etc/hn")).unwrap();
    let img = sc.join("t.img");
    let (code, _, err) = butter(&["mkfs", "-q", "-b", "256M", "--rootdir", s(&src), s(&img)]);
    assert_eq!(code, Some(0), "{err}");
    let (code, out, err) = butter(&["ls", s(&img), "etc/hostname"]);
    assert_eq!((code, out.as_str()), (Some(0), "etc/hostname\n"), "{err}");
    let (code, out, err) = butter(&["ls", "-l", s(&img), "etc/hostname"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.starts_with("-rw-r--r--") && out.trim_end().ends_with(" etc/hostname"),
        "{out}"
    );
    let (code, out, err) = butter(&["ls", "-l", s(&img), "etc/hn"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.trim_end().ends_with("etc/hn -> hostname"), "{out}");
    let (code, out, err) = butter(&["ls", s(&img), "etc"]);
    assert_eq!((code, out.as_str()), (Some(0), "hn\nhostname\n"), "{err}");
}

/// A distribution layout (`@` the default subvolume, `@home` beside it): with `--subvol-id 5`
/// every command that takes a path inside the image takes the paths `butter subvolumes`
/// prints, as printed; without it paths start in the default subvolume, and a path that is
/// not found there names the option. A name that is not UTF-8 reaches its file. The image
/// ends clean for both checkers and the kernel sees what butter made.
#[test]
fn subvol_id_reaches_every_subvolume() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    if !fuse_mount::require("subvol_id_reaches_every_subvolume", &[]) {
        return;
    }
    let sc = ScratchDir::new("first-hour-subvol-id");
    let root = sc.dir("root");
    fs::create_dir_all(root.join("@/etc")).unwrap();
    fs::create_dir_all(root.join("@home/u")).unwrap();
    fs::write(root.join("@/etc/hostname"), "box\n").unwrap();
    fs::write(root.join("@home/u/notes"), vec![b'n'; 300_000]).unwrap();
    fs::write(root.join(OsStr::from_bytes(b"@/caf\xe9 x")), "odd\n").unwrap();
    let img = sc.join("a.img");
    let (code, _, err) = butter(&[
        "mkfs",
        "-b",
        "300M",
        "--rootdir",
        s(&root),
        "--subvol",
        "default:@",
        "--subvol",
        "@home",
        s(&img),
    ]);
    assert_eq!(code, Some(0), "mkfs: {err}");
    let i = s(&img);
    let (_, list, _) = butter(&["subvolumes", i]);
    assert!(
        list.contains("path @\n") && list.contains("path @home\n"),
        "{list}"
    );

    // Without the option: the default subvolume, as before; a top-level path names the option.
    let (code, out, _) = butter(&["cat", i, "etc/hostname"]);
    assert_eq!((code, out.as_str()), (Some(0), "box\n"));
    let (code, _, err) = butter(&["ls", i, "@home"]);
    assert_eq!(code, Some(1));
    assert!(
        err.contains("not found") && err.contains("--subvol-id 5"),
        "{err}"
    );

    // With it, every path as `butter subvolumes` prints it.
    let ok = |args: &[&str]| -> String {
        let (code, out, err) = butter(args);
        assert_eq!(code, Some(0), "{args:?}: {err}");
        out
    };
    assert_eq!(ok(&["ls", "--subvol-id", "5", i, "@home"]), "u\n");
    assert_eq!(
        ok(&["cat", "--subvol-id", "5", i, "@/etc/hostname"]),
        "box\n"
    );
    assert!(ok(&["compsize", "--subvol-id", "5", i, "@home"]).contains("Processed 1 file"));
    assert!(ok(&["filesystem", "du", "-s", "--subvol-id", "5", i, "@home"]).contains("@home"));
    ok(&[
        "subvolume",
        "snapshot",
        "-r",
        "--subvol-id",
        "5",
        i,
        "@",
        "@/root-snap",
    ]);
    let (_, list, _) = butter(&["subvolumes", i]);
    assert!(list.contains("path @/root-snap"), "{list}");
    assert!(ok(&["subvolume", "show", "--subvol-id", "5", i, "@/root-snap"]).contains("root-snap"));
    assert_eq!(
        ok(&[
            "property",
            "get",
            "--subvol-id",
            "5",
            i,
            "@/root-snap",
            "ro"
        ]),
        "ro=true\n"
    );
    let stream = sc.join("snap.stream");
    ok(&[
        "send",
        "-q",
        "--subvol-id",
        "5",
        "-f",
        s(&stream),
        i,
        "@/root-snap",
    ]);
    ok(&[
        "subvolume",
        "create",
        "--subvol-id",
        "5",
        i,
        "@home/backups",
    ]);
    ok(&[
        "receive",
        "-q",
        "--subvol-id",
        "5",
        "-f",
        s(&stream),
        i,
        "@home/backups",
    ]);
    assert_eq!(
        ok(&[
            "cat",
            "--subvol-id",
            "5",
            i,
            "@home/backups/root-snap/etc/hostname"
        ]),
        "box\n"
    );
    ok(&["subvolume", "delete", "--subvol-id", "5", i, "@/root-snap"]);
    // By the default subvolume's own paths, the same subvolume is where it always was.
    assert!(ok(&["ls", i, "/"]).contains("etc"));
    // A name that is not UTF-8, from the shell as bytes.
    let out = kernel::run_output(
        Command::new(BUTTER)
            .args(["cat", "--subvol-id", "5", i])
            .arg(OsStr::from_bytes(b"@/caf\xe9 x")),
    );
    assert_eq!(
        out.stdout,
        b"odd\n",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // An id that is not a subvolume says how to find one.
    let (code, _, err) = butter(&["ls", "--subvol-id", "4242", i]);
    assert_eq!(code, Some(1));
    assert!(err.contains("butter subvolumes"), "{err}");

    let (code, report) = fuse_mount::butter_check(&img);
    assert_eq!(code, 0, "{report}");
    let (clean, report) = kernel::btrfs_check(&img);
    assert!(clean, "{report}");
    let m = kernel::LoopMount::btrfs(&img, &sc.dir("k"), "subvolid=5");
    let p = m.path();
    assert_eq!(
        fs::read_to_string(p.join("@home/backups/root-snap/etc/hostname")).unwrap(),
        "box\n"
    );
    assert!(!p.join("@/root-snap").exists());
    m.unmount();
}

/// `cat` of a file whose data block is damaged says so once (the error, with what to do),
/// not once from the library's log and again from the command.
#[test]
fn cat_of_a_damaged_block_says_so_once() {
    if !fuse_mount::require("cat_of_a_damaged_block_says_so_once", &[]) {
        return;
    }
    let sc = ScratchDir::new("first-hour-bad-block");
    let root = sc.dir("root");
    let marker: Vec<u8> = (0..64 * 1024u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    fs::write(root.join("f"), &marker).unwrap();
    let img = sc.join("a.img");
    let (code, _, err) = butter(&["mkfs", "-b", "200M", "--rootdir", s(&root), s(&img)]);
    assert_eq!(code, Some(0), "mkfs: {err}");
    let mut bytes = fs::read(&img).unwrap();
    let at = bytes
        .windows(64)
        .position(|w| w == &marker[8192..8192 + 64])
        .expect("the file's data is not in the image");
    bytes[at] ^= 0xff;
    fs::write(&img, &bytes).unwrap();
    let (code, _, err) = butter(&["cat", s(&img), "f"]);
    assert_eq!(code, Some(1), "{err}");
    assert_eq!(err.matches("checksum mismatch").count(), 1, "{err}");
    assert!(
        err.contains("file offset 8192") && err.contains("butter restore"),
        "{err}"
    );
}
