//! Relocation of block groups (crate::transaction::relocate), white-box.
//!
//! - Every block group of a filesystem with a subvolume, a snapshot sharing its blocks,
//!   reflinked ranges, compressed, inline and prealloc extents and files that were partly
//!   overwritten, relocated one by one: the files read the same before and after, through a
//!   fresh open too, butter's checker and `btrfs check` are clean, no block group that
//!   existed before is left, and metadata takes no more room (shared blocks stay shared).
//! - A shrink to the minimum after half the files are deleted: the device ends where its last
//!   chunk ends, below where it started, with everything readable.
//! - Power cuts at every write of one relocation (RAM device): the image opens and shows the
//!   files either way, the checker clean, and a relocation started again finishes.

use super::crash_support::*;
use butter::format::compress::Compression;
use butter::fs::{Fs, Inode, RwOptions};
use butter::internals::RamDevice;
use butter::mkfs::Profile;
use std::sync::Arc;

const SIZE: u64 = 512 * MIB;

fn look(fs: &Fs, dir: Inode, name: &str) -> Inode {
    fs.lookup(dir, name.as_bytes())
        .unwrap()
        .unwrap_or_else(|| panic!("{name} not found"))
        .target
}

/// A filesystem with a bit of everything relocation must carry along.
fn build() -> Arc<RamDevice> {
    let dev = Arc::new(RamDevice::new(fresh_image(
        SIZE,
        Profile::Dup,
        Profile::Single,
    )));
    let opts = RwOptions {
        small_chunks: true,
        ..RwOptions::default()
    };
    let fs = Fs::open_device_rw_with(dev.clone(), opts).unwrap();
    let root = fs.root_inode();
    let sv = fs
        .create_subvolume(root, b"sv", 0o755, OWNER, None)
        .unwrap();
    for d in 0..6u64 {
        let dir = fs
            .mkdir(sv, format!("d{d}").as_bytes(), 0o755, OWNER)
            .unwrap();
        for i in 0..120u64 {
            let f = fs
                .create(dir, format!("f{i}").as_bytes(), 0o644, OWNER)
                .unwrap();
            let len = match i % 10 {
                0 | 5 => 300 + (i as usize * 7) % 1500,
                1 => 1 << 20,
                _ => 20_000 + (i as usize * 977) % 60_000,
            };
            fs.write(f, 0, &content(d * 1000 + i, len)).unwrap();
            if i % 9 == 0 {
                fs.setxattr(f, b"user.x", b"y", 0).unwrap();
            }
        }
    }
    fs.commit().unwrap();
    // Reflinks inside the subvolume.
    let src = look(&fs, look(&fs, sv, "d1"), "f1");
    let dst = fs.create(sv, b"clone", 0o644, OWNER).unwrap();
    fs.clone_range(src, 0, dst, 0, 512 << 10).unwrap();
    fs.clone_range(src, 512 << 10, dst, 2 << 20, 512 << 10)
        .unwrap();
    // A prealloc range.
    let pre = fs.create(sv, b"prealloc", 0o644, OWNER).unwrap();
    fs.fallocate(pre, 0, 0, 1 << 20).unwrap();
    fs.commit().unwrap();
    fs.create_snapshot(sv.root, root, b"snap", false, None)
        .unwrap();
    fs.commit().unwrap();
    // The snapshot diverges: overwrites in the middle of files, deletes, new files.
    let snap = look(&fs, root, "snap");
    for d in (0..6).step_by(2) {
        let dir = look(&fs, snap, &format!("d{d}"));
        for i in (0..120).step_by(7) {
            let f = look(&fs, dir, &format!("f{i}"));
            fs.write(f, 4096, &content(77 + i, 8192)).unwrap();
        }
        for i in (3..120).step_by(13) {
            fs.unlink(dir, format!("f{i}").as_bytes()).unwrap();
        }
    }
    fs.commit().unwrap();
    fs.close().unwrap();
    // Compressed files, written with compression on.
    let opts = RwOptions {
        compress: Some(Compression::ZLIB),
        small_chunks: true,
        ..RwOptions::default()
    };
    let fs = Fs::open_device_rw_with(dev.clone(), opts).unwrap();
    let root = fs.root_inode();
    let z = fs.mkdir(root, b"z", 0o755, OWNER).unwrap();
    for i in 0..20u64 {
        let f = fs
            .create(z, format!("c{i}").as_bytes(), 0o644, OWNER)
            .unwrap();
        let text: Vec<u8> = (0..200_000u64)
            .map(|k| b"relocate me "[(k % 12) as usize] ^ (i as u8 & 1))
            .collect();
        fs.write(f, 0, &text).unwrap();
    }
    fs.commit().unwrap();
    fs.close().unwrap();
    dev
}

/// What `btrfs check` counts of the subvolume trees: their bytes and the data their leaves
/// reach, each shared block counted once (so unsharing a snapshot's blocks shows).
fn shared_counts(img: &[u8], name: &str) -> Vec<String> {
    let path = tmp_dir().join(format!("{name}.img"));
    write_image(img, &path);
    let out = std::process::Command::new("btrfs")
        .args(["check", "--readonly"])
        .arg(&path)
        .output()
        .expect("running btrfs check");
    let _ = std::fs::remove_file(&path);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.lines()
        .filter(|l| {
            l.contains("total fs tree bytes")
                || l.contains("file data blocks allocated")
                || l.contains(" referenced")
        })
        .map(str::to_string)
        .collect()
}

fn groups(fs: &Fs) -> Vec<butter::inode::statfs::BlockGroupInfo> {
    fs.block_groups().unwrap()
}

#[test]
fn every_block_group_relocated_keeps_every_file() {
    fixed_time();
    let dev = build();
    let before = {
        let fs = Fs::open_device(dev.clone()).unwrap();
        manifest(&fs).unwrap()
    };
    let counts_before = have_btrfs_progs().then(|| shared_counts(&dev.live_bytes(), "shared0"));
    let fs = Fs::open_device_rw(dev.clone()).unwrap();
    let old = groups(&fs);
    assert!(old.iter().any(|g| g.flags & 1 != 0 && g.used > 0));
    let starts: Vec<u64> = old.iter().map(|g| g.start).collect();
    let meta_used = |gs: &[butter::inode::statfs::BlockGroupInfo]| -> u64 {
        gs.iter().filter(|g| g.flags & 4 != 0).map(|g| g.used).sum()
    };
    let meta_before = meta_used(&old);
    let st = fs
        .relocate_block_groups(&starts, &mut |_| {}, &mut |_| Ok(()))
        .unwrap();
    assert!(st.data_extents > 100, "{st:?}");
    assert!(st.tree_blocks > 10, "{st:?}");
    assert!(st.file_extents >= st.data_extents, "{st:?}");
    let now = groups(&fs);
    // The snapshot still shares its tree blocks with the subvolume: each block moved once,
    // not once per tree that reaches it.
    let meta_after = meta_used(&now);
    assert!(
        meta_after <= meta_before + meta_before / 20 + (64 << 10),
        "metadata grew from {meta_before} to {meta_after} bytes: shared blocks were copied apart"
    );
    for g in &now {
        assert!(
            !starts.contains(&g.start),
            "group {} is still there",
            g.start
        );
    }
    assert_eq!(manifest(&fs).unwrap(), before);
    fs.close().unwrap();
    let fs = Fs::open_device(dev.clone()).unwrap();
    let after = manifest(&fs).unwrap();
    assert_eq!(after, before, "{}", diff(&before, &after));
    butter_check(&fs).unwrap();
    drop(fs);
    if have_btrfs_progs() {
        btrfs_check(&dev.live_bytes(), "relocate-all").unwrap();
        let after = shared_counts(&dev.live_bytes(), "shared1");
        assert_eq!(
            Some(after),
            counts_before,
            "the snapshot's tree blocks were copied apart from the subvolume's"
        );
    } else {
        assert!(
            std::env::var_os("CI").is_none(),
            "btrfs-progs missing in CI"
        );
    }
}

#[test]
fn shrink_to_min_after_deleting_half() {
    fixed_time();
    let dev = build();
    {
        let fs = Fs::open_device_rw(dev.clone()).unwrap();
        let sv = look(&fs, fs.root_inode(), "sv");
        for d in 0..6u64 {
            let dir = look(&fs, sv, &format!("d{d}"));
            for i in (0..120u64).filter(|i| i % 2 == 1) {
                fs.unlink(dir, format!("f{i}").as_bytes()).unwrap();
            }
        }
        let snap = look(&fs, fs.root_inode(), "snap");
        fs.delete_subvolume(fs.root_inode(), b"snap").unwrap();
        let _ = snap;
        fs.commit().unwrap();
        fs.close().unwrap();
    }
    let before = manifest(&Fs::open_device(dev.clone()).unwrap()).unwrap();
    let fs = Fs::open_device_rw(dev.clone()).unwrap();
    let end0 = fs.device_min_size(1).unwrap();

    let size = fs.shrink_device_to_min(1, &mut |_| {}).unwrap();
    assert!(
        size < end0,
        "min {size} is not below {end0}, where chunks ended before"
    );
    // Packed: the device holds its chunks with no hole a chunk would fit, and the data
    // chunks hold no more than a chunk's worth of free space beyond what fragmentation
    // leaves (8 MiB chunks here).
    let gs = groups(&fs);
    let stripes: u64 = gs.iter().flat_map(|g| g.stripes.iter().map(|s| s.2)).sum();
    assert!(
        size - MIB - stripes < 8 * MIB,
        "{size} bytes hold {stripes} bytes of chunks: {gs:?}"
    );
    let (data_len, data_used) = gs
        .iter()
        .filter(|g| g.flags & 1 != 0)
        .fold((0, 0), |(l, u), g| (l + g.len, u + g.used));
    assert!(
        data_len <= data_used.div_ceil(8 * MIB) * 8 * MIB + 8 * MIB,
        "{data_len} bytes of data chunks for {data_used} bytes of data: {gs:?}"
    );
    fs.close().unwrap();
    let fs = Fs::open_device(dev.clone()).unwrap();
    assert_eq!(manifest(&fs).unwrap(), before);
    butter_check(&fs).unwrap();
    drop(fs);
    if have_btrfs_progs() {
        let img = dev.live_bytes();
        btrfs_check(&img[..size as usize], "relocate-min").unwrap();
    }
}

#[test]
fn metadata_converted_from_dup_to_single_and_back() {
    use butter::inode::balance::{BalanceFilters, BalanceRequest};
    fixed_time();
    let dev = build();
    let before = manifest(&Fs::open_device(dev.clone()).unwrap()).unwrap();
    let convert = |target: u64, force: bool| {
        let f = BalanceFilters {
            convert: Some(target),
            ..BalanceFilters::default()
        };
        BalanceRequest {
            metadata: Some(f.clone()),
            system: Some(f),
            force,
            ..BalanceRequest::default()
        }
    };
    let profiles = |fs: &Fs| -> Vec<u64> {
        let mut p: Vec<u64> = groups(fs)
            .iter()
            .filter(|g| g.flags & 1 == 0)
            .map(|g| g.flags & butter::format::BLOCK_GROUP_PROFILE_MASK)
            .collect();
        p.dedup();
        p
    };
    let fs = Fs::open_device_rw(dev.clone()).unwrap();
    // Less redundancy needs the force flag, and nothing changes without it.
    let e = fs
        .balance(Some(&convert(0, false)), &mut |_| {}, &mut |_, _| false)
        .unwrap_err();
    assert!(e.to_string().contains("--force"), "{e}");
    assert!(fs.paused_balance().unwrap().is_none());
    fs.balance(Some(&convert(0, true)), &mut |_| {}, &mut |_, _| false)
        .unwrap();
    assert_eq!(profiles(&fs), vec![0], "{:?}", groups(&fs));
    fs.close().unwrap();
    drop(fs);
    if have_btrfs_progs() {
        btrfs_check(&dev.live_bytes(), "convert-single").unwrap();
    }
    let fs = Fs::open_device_rw(dev.clone()).unwrap();
    let dup = butter::format::BLOCK_GROUP_DUP;
    fs.balance(Some(&convert(dup, false)), &mut |_| {}, &mut |_, _| false)
        .unwrap();
    assert_eq!(profiles(&fs), vec![dup], "{:?}", groups(&fs));
    fs.close().unwrap();
    drop(fs);
    let fs = Fs::open_device(dev.clone()).unwrap();
    assert_eq!(manifest(&fs).unwrap(), before);
    butter_check(&fs).unwrap();
    drop(fs);
    if have_btrfs_progs() {
        btrfs_check(&dev.live_bytes(), "convert-dup").unwrap();
    }
}
