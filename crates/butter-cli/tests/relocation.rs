//! Relocation offline against the kernel:
//!
//! - A kernel-made image filled through a kernel mount (a subvolume, a snapshot and a
//!   read-only snapshot sharing its extents, reflinks, zstd-compressed and inline extents, a
//!   nodatacow file, quotas on), half its files deleted, shrunk by `butter filesystem resize
//!   min`: both checkers clean, the kernel shows every file as before and the same qgroup
//!   numbers, still consistent, the image file no larger than the data and metadata it holds
//!   plus the kernel's reserves; grown back by 1 GiB, the kernel fills the new space.
//! - Conversion: single-device DUP metadata to single and back, and a two-device single data
//!   filesystem to RAID1 and back; each time both checkers are clean and the kernel shows the
//!   profiles and the same files.
//! - Device remove and replace of a filesystem written through butter's mount: the kernel
//!   shows the files the mount wrote, both checkers clean.
//!
//! Needs root, loop devices, kernel btrfs and btrfs-progs (and FUSE for the last): fails
//! without them under CI.

mod common;

use common::fuse_mount::{self, ButterMount};
use common::kernel::{self, LoopMount, MultiLoopMount, ScratchDir};
use common::manifest::{self, CompareOpts, Manifest, TakeOpts};
use common::{output_text as text, run_butter as butter};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const MIB: u64 = 1 << 20;

fn take(dir: &Path) -> Manifest {
    manifest::take(
        dir,
        &TakeOpts {
            cross_subvolumes: true,
            ..TakeOpts::default()
        },
    )
}

/// The kernel's files of a filesystem of one or several devices, and its `btrfs filesystem
/// df -b` output.
fn kernel_view(images: &[PathBuf], s: &ScratchDir, name: &str) -> (Manifest, String) {
    let m = MultiLoopMount::new(images, &s.dir(name), "ro");
    let df = kernel::run(
        Command::new("btrfs")
            .args(["filesystem", "df", "-b"])
            .arg(m.path()),
    );
    let man = take(m.path());
    m.unmount();
    (man, df)
}

/// Both checkers clean on every device.
fn both_checks(images: &[PathBuf], what: &str) {
    let others: Vec<String> = images[1..]
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    let (rc, out) = fuse_mount::butter_check_set(&images[0], &others);
    assert_eq!(rc, 0, "{what}: butter check:\n{out}");
    let (ok, t) = kernel::btrfs_check_devices(images);
    assert!(ok, "{what}: btrfs check:\n{t}");
}

/// `(total, used)` bytes of a `btrfs filesystem df -b` line starting with `prefix`.
fn df_line(df: &str, prefix: &str) -> (u64, u64) {
    let l = df
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} in:\n{df}"));
    let num = |k: &str| -> u64 {
        l.split(k)
            .nth(1)
            .and_then(|t| t.split(',').next())
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {k} in {l}"))
    };
    (num("total="), num("used="))
}

/// `btrfs qgroup show --raw` on a read-only kernel mount; fails when the kernel finds the
/// qgroup numbers inconsistent.
fn qgroups(img: &Path, s: &ScratchDir, name: &str) -> String {
    let m = LoopMount::btrfs_ro(img, &s.dir(name));
    let o = kernel::run_output(
        Command::new("btrfs")
            .args(["qgroup", "show", "--raw"])
            .arg(m.path()),
    );
    m.unmount();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success() && !err.contains("inconsistent"),
        "{name}: qgroups: {err}"
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn same(want: &Manifest, got: &Manifest, what: &str) {
    manifest::assert_same(want, got, &CompareOpts::restore(), what);
}

fn sh(mnt: &Path, script: &str) {
    kernel::run(Command::new("sh").arg("-ec").arg(script).current_dir(mnt));
}

#[test]
fn kernel_filled_image_shrunk_to_its_minimum_and_grown_back() {
    if !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("reloc-min");
    let img = s.join("fs.img");
    kernel::mkfs_btrfs(&img, 1 << 30, &["-O", "block-group-tree"]);
    {
        let m = LoopMount::btrfs(&img, &s.dir("fill"), "compress=zstd");
        sh(
            m.path(),
            "btrfs quota enable .
             btrfs subvolume create sv >/dev/null
             i=0
             while [ $i -lt 160 ]; do
               head -c $(( (i * 7919) % 300000 + 1 )) /dev/urandom > sv/f$i
               i=$((i + 1))
             done
             i=0
             while [ $i -lt 40 ]; do
               yes \"compressible line $i\" | head -c 400000 > sv/z$i
               i=$((i + 1))
             done
             echo tiny > sv/inline
             mkdir sv/nocow && chattr +C sv/nocow
             head -c 3000000 /dev/urandom > sv/nocow/db
             cp --reflink=always sv/f7 sv/f7.clone
             cp --reflink=always sv/z3 sv/z3.clone
             btrfs subvolume snapshot sv snap >/dev/null
             btrfs subvolume snapshot -r sv rosnap >/dev/null
             i=1
             while [ $i -lt 160 ]; do rm sv/f$i; i=$((i + 2)); done
             i=0
             while [ $i -lt 40 ]; do rm snap/z$i; i=$((i + 2)); done
             echo changed > snap/f2
             dd if=/dev/urandom of=sv/nocow/db bs=4096 count=10 seek=20 conv=notrunc 2>/dev/null
             sync
             btrfs quota rescan -w . >/dev/null",
        );
        m.unmount();
    }
    let (want, df0) = kernel_view(std::slice::from_ref(&img), &s, "k0");
    let q0 = qgroups(&img, &s, "q0");
    let i = img.to_str().unwrap();
    let o = butter(&["filesystem", "resize", i, "min"]);
    assert!(o.status.success(), "{}", text(&o));
    let len = fs::metadata(&img).unwrap().len();
    assert_eq!(len, kernel::super_field(&img, "dev_item.total_bytes"));
    both_checks(std::slice::from_ref(&img), "after min");
    let (got, df1) = kernel_view(std::slice::from_ref(&img), &s, "k1");
    same(&want, &got, "files after min");
    // Relocation changes nothing qgroups count: they stay consistent, with the same numbers
    // (btrfs check, clean above, verifies them against its own count too).
    assert_eq!(qgroups(&img, &s, "q1"), q0, "qgroups after min");
    // No larger than what it holds plus the kernel's reserves: data used, then twice (DUP)
    // the metadata used with half as much again and 16 MiB (the global reserve, here 6 MiB,
    // and the reservations of the kernel's writes, which a tighter fit refuses), the system
    // chunks, the first MiB, and a MiB of rounding for each.
    let (_, data) = df_line(&df0, "Data,");
    let (_, meta) = df_line(&df0, "Metadata,");
    let (sys, _) = df_line(&df0, "System,");
    let bound = MIB + data + 2 * (meta + meta / 2 + 16 * MIB) + 2 * sys + 4 * MIB;
    assert!(
        len <= bound,
        "min left {len} bytes, more than {bound}:\nbefore\n{df0}\nafter\n{df1}"
    );
    eprintln!(
        "min: 1 GiB -> {} MiB ({} MiB of data)",
        len >> 20,
        data >> 20
    );
    // The kernel writes into the minimal filesystem: its metadata has room (the data chunks
    // are full: min leaves no data space, growing gives it).
    {
        let m = LoopMount::btrfs(&img, &s.dir("kw"), "");
        fs::create_dir(m.path().join("sv/after-min")).unwrap();
        for k in 0..50 {
            fs::write(m.path().join(format!("sv/after-min/{k}")), b"small").unwrap();
        }
        m.unmount();
    }
    kernel::assert_btrfs_check(&img);
    let (want2, _) = kernel_view(std::slice::from_ref(&img), &s, "k1b");

    // Grown back by 1 GiB: the sizes move together and the kernel fills the new space.
    let o = butter(&["filesystem", "resize", i, "+1G"]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(fs::metadata(&img).unwrap().len(), len + (1 << 30));
    assert_eq!(kernel::super_field(&img, "total_bytes"), len + (1 << 30));
    both_checks(std::slice::from_ref(&img), "after +1G");
    let (got, _) = kernel_view(std::slice::from_ref(&img), &s, "k2");
    same(&want2, &got, "files after +1G");
    {
        let m = LoopMount::btrfs(&img, &s.dir("kg"), "");
        fs::write(m.path().join("big"), vec![1u8; 700 << 20])
            .expect("the kernel writes 700 MiB into the grown filesystem");
        fs::remove_file(m.path().join("big")).unwrap();
        m.unmount();
    }
    kernel::assert_btrfs_check(&img);
}

#[test]
fn profiles_converted_and_back_on_one_and_two_devices() {
    if !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("reloc-convert");
    // One device: metadata DUP -> single (needs --force) -> DUP.
    let img = s.join("one.img");
    kernel::mkfs_btrfs(&img, 512 * MIB, &[] as &[&str]);
    {
        let m = LoopMount::btrfs(&img, &s.dir("f1"), "");
        sh(
            m.path(),
            "mkdir d; i=0; while [ $i -lt 300 ]; do head -c $((i * 331)) /dev/urandom > d/f$i; i=$((i+1)); done",
        );
        m.unmount();
    }
    let one = vec![img.clone()];
    let (want, _) = kernel_view(&one, &s, "k0");
    let i = img.to_str().unwrap();
    let o = butter(&["balance", "start", "-f", "-mconvert=single", i]);
    assert!(o.status.success(), "{}", text(&o));
    both_checks(&one, "metadata single");
    let (got, df) = kernel_view(&one, &s, "k1");
    same(&want, &got, "files with single metadata");
    assert!(
        df.contains("Metadata, single") && df.contains("System, single") && !df.contains("DUP"),
        "{df}"
    );
    let o = butter(&["balance", "start", "-mconvert=dup", i]);
    assert!(o.status.success(), "{}", text(&o));
    both_checks(&one, "metadata DUP again");
    let (got, df) = kernel_view(&one, &s, "k2");
    same(&want, &got, "files with DUP metadata again");
    assert!(
        df.contains("Metadata, DUP")
            && df.contains("System, DUP")
            && !df.contains("single: total=0"),
        "{df}"
    );

    // Two devices: data single -> RAID1 -> single.
    let two: Vec<PathBuf> = (0..2).map(|k| s.join(format!("two{k}.img"))).collect();
    for p in &two {
        fs::File::create(p).unwrap().set_len(512 * MIB).unwrap();
    }
    kernel::run(
        Command::new("mkfs.btrfs")
            .args(["-q", "-f", "-d", "single", "-m", "raid1"])
            .args(&two),
    );
    {
        let m = MultiLoopMount::new(&two, &s.dir("f2"), "");
        sh(
            m.path(),
            "head -c 100000000 /dev/urandom > big; mkdir d; i=0; while [ $i -lt 100 ]; do head -c $((i * 997)) /dev/urandom > d/f$i; i=$((i+1)); done",
        );
        m.unmount();
    }
    let (want, _) = kernel_view(&two, &s, "k3");
    let (a, b) = (two[0].to_str().unwrap(), two[1].to_str().unwrap());
    let o = butter(&["balance", "start", "-dconvert=raid1", a, "--device", b]);
    assert!(o.status.success(), "{}", text(&o));
    both_checks(&two, "data RAID1");
    let (got, df) = kernel_view(&two, &s, "k4");
    same(&want, &got, "files with RAID1 data");
    assert!(
        df.contains("Data, RAID1") && !df.contains("Data, single"),
        "{df}"
    );
    // RAID1 data survives the loss of either device: each alone reads every file.
    for (k, p) in two.iter().enumerate() {
        let o = butter(&["check", "--degraded", p.to_str().unwrap()]);
        assert!(o.status.success(), "device {k} alone: {}", text(&o));
    }
    let o = butter(&["balance", "start", "-dconvert=single", a, "--device", b]);
    assert!(o.status.success(), "{}", text(&o));
    both_checks(&two, "data single again");
    let (got, df) = kernel_view(&two, &s, "k5");
    same(&want, &got, "files with single data again");
    assert!(
        df.contains("Data, single") && !df.contains("Data, RAID1"),
        "{df}"
    );
}

#[test]
fn device_remove_and_replace_of_a_filesystem_the_mount_wrote() {
    if !fuse_mount::require("relocation", &[]) || !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("reloc-dev");
    let d: Vec<PathBuf> = (0..4).map(|k| s.join(format!("d{k}.img"))).collect();
    for p in &d {
        fs::File::create(p).unwrap().set_len(400 * MIB).unwrap();
    }
    let p: Vec<&str> = d.iter().map(|x| x.to_str().unwrap()).collect();
    let o = butter(&[
        "mkfs", "-q", "-m", "raid1", "-d", "single", p[0], p[1], p[2],
    ]);
    assert!(o.status.success(), "{}", text(&o));
    // The mount writes files over the three devices.
    let write = |dev_args: &[&str], tag: &str| -> Manifest {
        let mut args = vec!["-o", "uring=off"];
        args.extend_from_slice(dev_args);
        let m = ButterMount::start(
            &d[0],
            &s.dir(format!("bm-{tag}")),
            &args,
            &s.join(format!("{tag}.log")),
        );
        let dir = m.path().join(tag);
        fs::create_dir(&dir).unwrap();
        for k in 0..60u64 {
            let len = (k as usize * 7919) % 2_000_000 + 1;
            let data: Vec<u8> = (0..len).map(|x| (x as u64 * 31 + k) as u8).collect();
            fs::write(dir.join(format!("f{k}")), data).unwrap();
        }
        let man = take(m.path());
        m.unmount();
        man
    };
    write(&["--device", p[1], "--device", p[2]], "first");
    // Remove device 2: its chunks move to devices 1 and 3.
    let o = butter(&[
        "device", "remove", p[0], "--device", p[1], "--device", p[2], "2",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let left = vec![d[0].clone(), d[2].clone()];
    both_checks(&left, "after remove");
    let sb = kernel::run_output(
        Command::new("btrfs")
            .args(["inspect-internal", "dump-super"])
            .arg(&d[1]),
    );
    assert!(
        !String::from_utf8_lossy(&sb.stdout).contains("_BHRfS_M [match]"),
        "the removed device still has a btrfs superblock"
    );
    // The mount writes more on the two left; then device 3 is replaced by device 4.
    let want = write(&["--device", p[2]], "second");
    let o = butter(&["device", "replace", p[0], "--device", p[2], p[2], p[3]]);
    assert!(o.status.success(), "{}", text(&o));
    let now = vec![d[0].clone(), d[3].clone()];
    both_checks(&now, "after replace");
    let (got, df) = kernel_view(&now, &s, "k");
    manifest::assert_same(
        &want,
        &got,
        &CompareOpts {
            atime: false,
            ..CompareOpts::fuse()
        },
        "the mount's files through the kernel after remove and replace",
    );
    assert!(df.contains("Metadata, RAID1"), "{df}");
    // A missing device is replaced from the other copies: device 4 goes missing (RAID1
    // metadata; the data on it is lost only where single data lived on it, so data first
    // becomes RAID1).
    let o = butter(&[
        "balance",
        "start",
        "-dconvert=raid1",
        p[0],
        "--device",
        p[3],
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let o = butter(&[
        "device",
        "replace",
        "--degraded",
        p[0],
        "missing",
        p[1],
        "-f",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let fin = vec![d[0].clone(), d[1].clone()];
    both_checks(&fin, "after replacing the missing device");
    let (got, _) = kernel_view(&fin, &s, "k2");
    manifest::assert_same(
        &want,
        &got,
        &CompareOpts {
            atime: false,
            ..CompareOpts::fuse()
        },
        "files after replacing a missing device",
    );
}

/// The kernel's own balance, paused on a mount (its BALANCE_ITEM left in the image): `butter
/// balance status` shows it, `butter balance resume` finishes it (the files the same, both
/// checkers clean, the kernel shows no balance after), and `cancel` on a copy drops it.
#[test]
fn a_balance_the_kernel_paused_is_resumed_by_butter() {
    if !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("reloc-resume");
    let img = s.join("fs.img");
    kernel::mkfs_btrfs(&img, 2 << 30, &[] as &[&str]);
    {
        let m = LoopMount::btrfs(&img, &s.dir("fill"), "");
        sh(
            m.path(),
            "i=0; while [ $i -lt 8 ]; do head -c 100000000 /dev/zero > f$i; echo $i >> f$i; i=$((i+1)); done
             sync
             btrfs balance start -dusage=100 . >/dev/null 2>&1 &
             n=0
             until btrfs balance pause . 2>/dev/null; do
               n=$((n+1)); [ $n -lt 200 ] || exit 1; sleep 0.02
             done
             wait || true
             btrfs balance status . | grep -q paused",
        );
        m.unmount();
    }
    let one = vec![img.clone()];
    let (want, _) = kernel_view(&one, &s, "k0");
    let copy = s.join("copy.img");
    fs::copy(&img, &copy).unwrap();
    let i = img.to_str().unwrap();
    let o = butter(&["balance", "status", i]);
    assert!(
        o.status.success() && text(&o).contains("is paused") && text(&o).contains("usage"),
        "{}",
        text(&o)
    );
    let o = butter(&["balance", "start", "-dusage=50", i]);
    assert!(
        !o.status.success() && text(&o).contains("resume"),
        "a new balance over a paused one: {}",
        text(&o)
    );
    let o = butter(&["balance", "resume", i]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("Done, had to relocate"), "{}", text(&o));
    let o = butter(&["balance", "status", i]);
    assert!(text(&o).contains("No balance found"), "{}", text(&o));
    both_checks(&one, "after resume");
    let (got, _) = kernel_view(&one, &s, "k1");
    same(&want, &got, "files after the resumed balance");
    let m = LoopMount::btrfs(&img, &s.dir("k2"), "");
    let st = kernel::run_output(
        Command::new("btrfs")
            .args(["balance", "status"])
            .arg(m.path()),
    );
    m.unmount();
    assert!(
        String::from_utf8_lossy(&st.stdout).contains("No balance found"),
        "the kernel still sees a balance: {}",
        String::from_utf8_lossy(&st.stdout)
    );
    // Cancel drops the item and changes nothing else.
    let c = copy.to_str().unwrap();
    let o = butter(&["balance", "cancel", c]);
    assert!(o.status.success(), "{}", text(&o));
    let o = butter(&["balance", "status", c]);
    assert!(text(&o).contains("No balance found"), "{}", text(&o));
    kernel::assert_btrfs_check(&copy);
}

/// Device removal and a balance run through a running butter mount (the kernel's ioctls,
/// served by the mount) while another thread writes files into it: the writes all land, the
/// removed device's superblock is wiped, the data is RAID1 after the conversion, and after
/// the unmount the kernel shows the files the mount showed, both checkers clean.
#[test]
fn device_remove_replace_add_balance_and_resize_through_a_running_mount_while_files_are_written() {
    if !fuse_mount::require("relocation", &[]) || !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("reloc-online");
    let d: Vec<PathBuf> = (0..5).map(|k| s.join(format!("d{k}.img"))).collect();
    for p in &d {
        fs::File::create(p).unwrap().set_len(400 * MIB).unwrap();
    }
    let p: Vec<&str> = d.iter().map(|x| x.to_str().unwrap()).collect();
    let o = butter(&[
        "mkfs", "-q", "-m", "raid1", "-d", "single", p[0], p[1], p[2],
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let m = ButterMount::start(
        &d[0],
        &s.dir("bm"),
        &["-o", "uring=off", "--device", p[1], "--device", p[2]],
        &s.join("bm.log"),
    );
    // Something on device 2 first, so that removing it moves data.
    fs::create_dir(m.path().join("before")).unwrap();
    for k in 0..40u64 {
        let data: Vec<u8> = (0..300_000u64).map(|x| (x * 7 + k) as u8).collect();
        fs::write(m.path().join(format!("before/f{k}")), data).unwrap();
    }
    let dir = m.path().join("during");
    fs::create_dir(&dir).unwrap();
    let writer = {
        let dir = dir.clone();
        std::thread::spawn(move || {
            for k in 0..400u64 {
                let data: Vec<u8> = (0..100_000u64).map(|x| (x * 13 + k) as u8).collect();
                fs::write(dir.join(format!("w{k}")), data).expect("a write during relocation");
            }
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(200));
    let mnt = m.path().to_str().unwrap().to_string();
    let o = butter(&["device", "remove", &mnt, "2"]);
    assert!(o.status.success(), "{}", text(&o));
    // The device the mount was made from, replaced while the mount goes on.
    let o = butter(&["device", "replace", &mnt, p[0], p[3]]);
    assert!(o.status.success(), "{}", text(&o));
    let o = butter(&["device", "add", &mnt, p[4]]);
    assert!(o.status.success(), "{}", text(&o));
    let o = butter(&["balance", "start", "-dconvert=raid1", &mnt]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("Done, had to relocate"), "{}", text(&o));
    // Resize through the mount: device 4 (d3) shrinks, its file cut; device 5 (d4) grows,
    // its file extended.
    let o = butter(&["filesystem", "resize", &mnt, "4:-100M"]);
    assert!(o.status.success(), "{}", text(&o));
    let o = butter(&["filesystem", "resize", &mnt, "5:+100M"]);
    assert!(o.status.success(), "{}", text(&o));
    writer.join().expect("the writer thread");
    let want = take(m.path());
    m.unmount();
    assert_eq!(fs::metadata(&d[3]).unwrap().len(), 300 * MIB, "d3 cut");
    assert_eq!(fs::metadata(&d[4]).unwrap().len(), 500 * MIB, "d4 extended");
    let dump_super = |p: &Path| {
        let o = kernel::run_output(
            Command::new("btrfs")
                .args(["inspect-internal", "dump-super"])
                .arg(p),
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    for gone in [&d[0], &d[1]] {
        assert!(
            !dump_super(gone).contains("_BHRfS_M [match]"),
            "removed device {} still has a btrfs superblock",
            gone.display()
        );
    }
    // The devices that joined through the mount hold chunks: the mount used them at once.
    for (joined, size) in [(&d[3], 300 * MIB), (&d[4], 500 * MIB)] {
        let sb = dump_super(joined);
        let field = |name: &str| {
            sb.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        assert!(
            field("dev_item.bytes_used").is_some_and(|u| u > 0),
            "{} holds no chunk:\n{sb}",
            joined.display()
        );
        assert_eq!(
            field("dev_item.total_bytes"),
            Some(size),
            "{} after the resize:\n{sb}",
            joined.display()
        );
    }
    let left = vec![d[2].clone(), d[3].clone(), d[4].clone()];
    both_checks(&left, "after removal and balance through the mount");
    let (got, df) = kernel_view(&left, &s, "k");
    manifest::assert_same(
        &want,
        &got,
        &CompareOpts {
            atime: false,
            ..CompareOpts::fuse()
        },
        "the mount's files through the kernel",
    );
    assert!(
        df.contains("Data, RAID1") && !df.contains("Data, single"),
        "{df}"
    );
}
