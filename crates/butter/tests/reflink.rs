//! Reflink through the library (`Fs::clone_range`): a range of one file cloned into another
//! file, another subvolume and elsewhere in the same file shares its data extents (free data
//! space does not go down by the bytes cloned), reads back byte for byte before and after a
//! commit and a reopen, keeps the clone's bytes when the source is overwritten afterwards,
//! refuses unaligned and overlapping ranges, and leaves an image both checkers pass.

mod crash_support;

use butter::fs::Fs;
use butter::inode::namespace::Owner;
use butter::internals::RamDevice;
use butter::mkfs::Profile;
use butter::Error;
use crash_support::{btrfs_check, butter_check, content, fresh_image};
use std::sync::Arc;

const MIB: u64 = 1 << 20;

fn read_all(fs: &Fs, ino: butter::fs::Inode) -> Vec<u8> {
    let size = fs.stat(ino).unwrap().size;
    fs.read(ino, 0, size as usize).unwrap()
}

#[test]
fn clones_share_extents_and_read_back() {
    let dev = Arc::new(RamDevice::new(fresh_image(
        256 << 20,
        Profile::Dup,
        Profile::Single,
    )));
    let fs = Fs::open_device_rw(dev.clone()).unwrap();
    let me = Owner::default();
    let top = fs.root_inode();
    let a_data = content(1, (3 * MIB + 1000) as usize);
    let a = fs.create(top, b"a", 0o644, me).unwrap();
    fs.write(a, 0, &a_data).unwrap();
    let sub = fs.create_subvolume(top, b"sub", 0o755, me, None).unwrap();
    let b = fs.create(top, b"b", 0o644, me).unwrap();
    let c = fs.create(sub, b"c", 0o644, me).unwrap();
    fs.commit().unwrap();
    let free_before = fs.statfs().unwrap().free;

    // The whole file, its unaligned tail included.
    assert_eq!(
        fs.clone_range(a, 0, b, 0, u64::MAX >> 2).unwrap(),
        a_data.len() as u64
    );
    // One MiB into another subvolume, after a hole.
    assert_eq!(fs.clone_range(a, MIB, c, 4096, MIB).unwrap(), MIB);
    // Within the same file, past its end.
    assert_eq!(fs.clone_range(a, 0, a, 8 * MIB, MIB).unwrap(), MIB);
    fs.commit().unwrap();
    let free_after = fs.statfs().unwrap().free;
    assert!(
        free_before - free_after < MIB / 2,
        "5 MiB cloned used {} bytes of data space: the extents are not shared",
        free_before - free_after
    );

    // Refused: unaligned offsets, a range onto itself, a directory.
    for (r, what) in [
        (fs.clone_range(a, 100, b, 0, 4096), "unaligned source"),
        (fs.clone_range(a, 0, b, 100, 4096), "unaligned destination"),
        (fs.clone_range(a, 0, a, 4096, MIB), "overlapping"),
        (fs.clone_range(a, 0, top, 0, 4096), "into a directory"),
    ] {
        assert!(matches!(r, Err(Error::Invalid(_))), "{what}: {r:?}");
    }

    // The source overwritten afterwards: the clones keep the old bytes.
    fs.write(a, MIB, &content(9, 8192)).unwrap();
    fs.commit().unwrap();

    let check = |fs: &Fs| {
        assert_eq!(read_all(fs, b), a_data, "b");
        let c_bytes = read_all(fs, c);
        assert_eq!(c_bytes.len() as u64, 4096 + MIB);
        assert!(c_bytes[..4096].iter().all(|&x| x == 0), "c's hole");
        assert!(
            c_bytes[4096..] == a_data[MIB as usize..2 * MIB as usize],
            "c"
        );
        let a_now = read_all(fs, a);
        assert_eq!(a_now.len() as u64, 9 * MIB);
        assert!(
            a_now[8 * MIB as usize..] == a_data[..MIB as usize],
            "a's own clone"
        );
        assert!(
            a_now[MIB as usize..MIB as usize + 8192] == content(9, 8192)[..],
            "a"
        );
    };
    check(&fs);
    drop(fs);
    let img = dev.durable_bytes();
    let fs = Fs::open_device(Arc::new(RamDevice::new(img.clone()))).unwrap();
    assert_eq!(fs.resolve_in(fs.root_inode(), b"b").unwrap(), b);
    assert_eq!(fs.resolve_in(fs.root_inode(), b"sub/c").unwrap(), c);
    check(&fs);
    butter_check(&fs).unwrap();
    btrfs_check(&img, "reflink").unwrap();
}

/// A clone right after writes that are still gathered in memory (delayed allocation) or in
/// flight clones those bytes too: the source's pending writes are completed first.
#[test]
fn a_clone_takes_writes_not_yet_in_the_trees() {
    let dev = Arc::new(RamDevice::new(fresh_image(
        128 << 20,
        Profile::Dup,
        Profile::Single,
    )));
    let fs = Fs::open_device_rw(dev.clone()).unwrap();
    let me = Owner::default();
    let top = fs.root_inode();
    let x = fs.create(top, b"x", 0o644, me).unwrap();
    let y = fs.create(top, b"y", 0o644, me).unwrap();
    // Small appends (gathered in memory), then one large write (its data written out of
    // the writer lock, its extent pending).
    let mut want = Vec::new();
    for i in 0..8u64 {
        let part = content(100 + i, 20_000);
        fs.write(x, want.len() as u64, &part).unwrap();
        want.extend_from_slice(&part);
    }
    let big = content(200, 2 * MIB as usize);
    fs.write(x, want.len() as u64, &big).unwrap();
    want.extend_from_slice(&big);
    assert_eq!(
        fs.clone_range(x, 0, y, 0, want.len() as u64).unwrap(),
        want.len() as u64
    );
    assert!(read_all(&fs, y) == want, "the clone misses pending writes");
    fs.commit().unwrap();
    drop(fs);
    let img = dev.durable_bytes();
    let fs = Fs::open_device(Arc::new(RamDevice::new(img.clone()))).unwrap();
    assert!(read_all(&fs, y) == want, "after a reopen");
    butter_check(&fs).unwrap();
    btrfs_check(&img, "reflink-pending").unwrap();
}
