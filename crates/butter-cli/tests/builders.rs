//! The image builders' own mkfs.btrfs command lines, run with `butter mkfs` in their place:
//! systemd-repart's (as an unprivileged user in a user namespace that maps it to root, as
//! repart runs it), Yocto's two (image_types, and wic's under a libc-hooking fakeroot),
//! NixOS's (under faketime and fakeroot, then `btrfs check`), and Buildroot's. Each image
//! passes both checkers, the kernel shows the source tree with the owners those tools
//! reported, and a second run with SOURCE_DATE_EPOCH and DETERMINISTIC_SEED=1 makes the same
//! bytes. Yocto's wic line also runs under pseudo, the fakeroot Yocto itself uses, with
//! owners, modes and a device node that exist only in pseudo's database. Needs root (to become
//! an unprivileged user), loop devices, btrfs-progs, fakeroot, faketime and pseudo; without
//! them the test prints a notice and passes, unless CI is set.

mod common;

use common::fuse_mount::{self, butter_check};
use common::kernel::{self, LoopMount, ScratchDir};
use common::manifest::{self, CompareOpts, Manifest, TakeOpts};
use std::path::Path;
use std::process::Command;

/// Runs `script` with `sh -c` as the unprivileged user nobody, in `dir`, with `env`.
fn as_nobody(dir: &Path, script: &str, env: &[(&str, &str)]) -> std::process::Output {
    let mut full = String::new();
    for (k, v) in env {
        full.push_str(&format!("export {k}='{v}'; "));
    }
    full.push_str(&format!("cd '{}' && {script}", dir.display()));
    kernel::run_output(
        Command::new("su")
            .args(["nobody", "-s", "/bin/sh", "-c"])
            .arg(full),
    )
}

/// Gives `dir` (the tree and the images) to nobody, and a copy of the butter binary where
/// nobody can reach it (the checkout may not be); returns the copy's path.
fn hand_to_nobody(sc: &ScratchDir, dir: &Path) -> String {
    let st = Command::new("chown")
        .args(["-R", "nobody:nogroup"])
        .arg(dir)
        .status()
        .unwrap();
    assert!(st.success());
    std::fs::set_permissions(
        sc.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    fuse_mount::butter_for_anyone(sc).display().to_string()
}

/// The source tree as seen through `wrapper` (fakeroot, unshare -r): owners as it reports.
fn manifest_via(dir: &Path, src: &str, wrapper: &str) -> Manifest {
    // Root under the wrapper sees every file as its own: the kernel must show root owners.
    let out = as_nobody(dir, &format!("{wrapper} stat -c '%u %g' {src}"), &[]);
    assert!(out.status.success(), "{wrapper} stat: {out:?}");
    let owner = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(
        owner, "0 0",
        "{wrapper} does not map the tree's owner to root"
    );
    manifest::take(&dir.join(src), &TakeOpts::default())
}

fn check_image(img: &Path, mnt: &Path, want: &Manifest, as_root: bool, what: &str) {
    let (rc, out) = butter_check(img);
    assert_eq!(rc, 0, "{what}: butter check:\n{out}");
    kernel::assert_btrfs_check(img);
    // The top level, whatever the default subvolume is.
    let m = LoopMount::new(img, mnt, kernel::FsType::Btrfs, "ro,noatime,subvolid=5");
    let got = manifest::take(m.path(), &TakeOpts::default());
    m.unmount();
    let opts = CompareOpts {
        root_attrs: false,
        atime: false,
        owner: !as_root,
        ..CompareOpts::restore()
    };
    manifest::assert_same(want, &got, &opts, what);
    if as_root {
        for (p, e) in &got.entries {
            assert_eq!(
                (e.uid, e.gid),
                (0, 0),
                "{what}: {} is not root's",
                p.display()
            );
        }
    }
}

#[test]
fn image_builders_command_lines() {
    if !fuse_mount::require(
        "image_builders_command_lines",
        &["fakeroot", "faketime", "unshare", "su"],
    ) {
        return;
    }
    let sc = ScratchDir::new("builders");
    let dir = sc.dir("work");
    // A tree nobody owns: a root filesystem's worth of kinds, and a directory for nodatacow.
    let src = dir.join("root");
    for d in ["etc", "var/lib/images", "home/user", "usr/bin"] {
        std::fs::create_dir_all(src.join(d)).unwrap();
    }
    std::fs::write(src.join("etc/hostname"), "builder\n").unwrap();
    std::fs::write(src.join("usr/bin/tool"), vec![0x7fu8; 200_000]).unwrap();
    std::fs::write(src.join("var/lib/images/disk.raw"), vec![0u8; 300_000]).unwrap();
    std::fs::write(src.join("home/user/notes"), "words ".repeat(5000)).unwrap();
    std::os::unix::fs::symlink("../usr/bin/tool", src.join("etc/tool")).unwrap();
    let b = hand_to_nobody(&sc, &dir);
    let reproducible = [
        ("SOURCE_DATE_EPOCH", "1700000000"),
        ("DETERMINISTIC_SEED", "1"),
    ];
    let lines: Vec<(&str, String, Option<&str>)> = vec![
        (
            "systemd-repart",
            format!(
                "unshare -r {b} mkfs -q -L repart -U 11111111-2222-3333-4444-555555555555 \
                 --nodiscard -r root --sectorsize=4096 --subvol default:home \
                 --inode-flags nodatacow:var/lib/images --compress zstd:3 --shrink IMG"
            ),
            Some("unshare -r"),
        ),
        (
            "yocto-image-types",
            format!("{b} mkfs -n 4096 --shrink -r root IMG"),
            None,
        ),
        (
            "yocto-wic",
            format!("fakeroot {b} mkfs -b 300M -r root -L wic IMG"),
            Some("fakeroot"),
        ),
        (
            "nixos",
            format!(
                "faketime -f '1970-01-01 00:00:01' fakeroot {b} mkfs -L nixos \
                 -U 22222222-3333-4444-5555-666666666666 -r root --shrink IMG && btrfs check IMG"
            ),
            Some("fakeroot"),
        ),
        (
            "buildroot",
            format!(
                "{b} mkfs -f -r root -L buildroot --byte-count 300M --nodesize 16384 \
                 --sectorsize 4096 --features free-space-tree IMG"
            ),
            None,
        ),
    ];
    for (name, line, wrapper) in lines {
        let mut images = Vec::new();
        for run in 0..2 {
            let img = format!("{name}-{run}.img");
            // The builders hand over an existing (empty) file; mkfs.btrfs takes either.
            let out = as_nobody(
                &dir,
                &format!("touch {img} && {}", line.replace("IMG", &img)),
                &reproducible,
            );
            assert!(
                out.status.success(),
                "{name}: {line}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            images.push(dir.join(img));
        }
        assert!(
            std::fs::read(&images[0]).unwrap() == std::fs::read(&images[1]).unwrap(),
            "{name}: two runs with SOURCE_DATE_EPOCH and DETERMINISTIC_SEED=1 differ"
        );
        let want = match wrapper {
            Some(w) => manifest_via(&dir, "root", w),
            None => manifest::take(&src, &TakeOpts::default()),
        };
        check_image(&images[0], &sc.dir("k"), &want, wrapper.is_some(), name);
    }
}

/// `find ROOT` under `wrapper` (empty: none): each entry's path, owner, mode, type and device
/// numbers, and for everything but directories its size and mtime; sorted.
fn listing(dir: &Path, root: &str, wrapper: &str, env: &[(&str, &str)]) -> Vec<String> {
    let script = format!(
        "cd {root} && {wrapper} sh -c \"find . -type d -exec stat -c '%n %u %g %a %F' {{}} + && \
         find . ! -type d -exec stat -c '%n %u %g %a %F %t:%T %s %Y' {{}} +\""
    );
    let out = if wrapper.is_empty() {
        kernel::run_output(
            Command::new("sh")
                .arg("-c")
                .arg(format!("cd '{}' && {script}", dir.display())),
        )
    } else {
        as_nobody(dir, &script, env)
    };
    assert!(
        out.status.success(),
        "listing {root} under '{wrapper}': {out:?}"
    );
    let mut v: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    v.sort();
    v
}

/// Yocto's wic line under pseudo (the LD_PRELOAD fakeroot Yocto builds with): the tree is
/// chowned to root, one file to 5:6, a program made setuid and a character device made, all
/// only in pseudo's database (the real files stay nobody's, the device a plain file). The
/// image shows what pseudo reports: the kernel's listing of the image equals pseudo's of the
/// tree, the files' bytes are the source's, both checkers pass, and two runs make the same
/// bytes.
#[test]
fn yocto_wic_under_pseudo() {
    if !fuse_mount::require("yocto_wic_under_pseudo", &["pseudo", "su"]) {
        return;
    }
    let sc = ScratchDir::new("builders-pseudo");
    let dir = sc.dir("work");
    let src = dir.join("root");
    for d in ["etc", "usr/bin", "dev"] {
        std::fs::create_dir_all(src.join(d)).unwrap();
    }
    std::fs::write(src.join("etc/hostname"), "yocto\n").unwrap();
    std::fs::write(src.join("etc/motd"), "words ".repeat(3000)).unwrap();
    std::fs::write(src.join("usr/bin/tool"), vec![0x7fu8; 150_000]).unwrap();
    std::os::unix::fs::symlink("../usr/bin/tool", src.join("etc/tool")).unwrap();
    let b = hand_to_nobody(&sc, &dir);
    let state = dir.join("pseudo-state").display().to_string();
    let env = [
        ("PSEUDO_PREFIX", "/usr"),
        ("PSEUDO_LIBDIR", "/usr/lib/x86_64-linux-gnu/pseudo"),
        ("PSEUDO_LOCALSTATEDIR", state.as_str()),
        ("SOURCE_DATE_EPOCH", "1700000000"),
        ("DETERMINISTIC_SEED", "1"),
    ];
    let setup = "pseudo sh -c 'chown -R 0:0 root && chown 5:6 root/etc/hostname && \
                 chmod 4711 root/usr/bin/tool && mknod root/dev/null c 1 3'";
    let out = as_nobody(&dir, setup, &env);
    assert!(out.status.success(), "pseudo setup: {out:?}");
    let theirs = listing(&dir, "root", "pseudo", &env);
    assert!(
        theirs
            .iter()
            .any(|l| l.starts_with("./dev/null 0 0 644 character special file 1:3")),
        "pseudo did not fake the device: {theirs:?}"
    );
    let mut images = Vec::new();
    for run in 0..2 {
        let img = format!("wic-{run}.img");
        let line = format!("touch {img} && pseudo {b} mkfs -b 300M -r root -L wic {img}");
        let out = as_nobody(&dir, &line, &env);
        assert!(out.status.success(), "{line}: {out:?}");
        images.push(dir.join(img));
    }
    assert!(
        std::fs::read(&images[0]).unwrap() == std::fs::read(&images[1]).unwrap(),
        "two runs under pseudo with SOURCE_DATE_EPOCH and DETERMINISTIC_SEED=1 differ"
    );
    let (rc, out) = butter_check(&images[0]);
    assert_eq!(rc, 0, "butter check:\n{out}");
    kernel::assert_btrfs_check(&images[0]);
    let mnt = sc.dir("k");
    let m = LoopMount::new(&images[0], &mnt, kernel::FsType::Btrfs, "ro,noatime");
    let ours = listing(m.path(), ".", "", &[]);
    for f in ["etc/hostname", "etc/motd", "usr/bin/tool"] {
        assert!(
            std::fs::read(m.path().join(f)).unwrap() == std::fs::read(src.join(f)).unwrap(),
            "{f}: bytes differ"
        );
    }
    m.unmount();
    // The top directory: mkfs gives the image's root the source root's attributes.
    assert_eq!(
        ours, theirs,
        "the image (left) against pseudo's view of the tree (right)"
    );
}
