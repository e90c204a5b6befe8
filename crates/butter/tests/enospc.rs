//! Running out of space.
//!
//! On the smallest image mkfs accepts, writing files until the device is full must end in
//! `Error::NoSpace` (ENOSPC): no panic, no abort, no corruption. What was committed before
//! stays intact, a commit succeeds after the ENOSPC, butter's checker is clean and
//! `btrfs check` passes. Deleting files and committing makes the space usable again. The same
//! holds when metadata runs out (many files with xattrs, no data).

mod crash_support;

use butter::error::Error;
use butter::fs::{Fs, Inode};
use butter::internals::RamDevice;
use butter::io::device::BlockDevice;
use butter::mkfs::{min_device_size, Profile};
use crash_support::*;
use std::sync::Arc;
use std::time::Instant;

const FILE_LEN: usize = 1 << 20;
const REFILL_STEP: usize = 2;

/// Checks the device: clean for butter and (when installed) `btrfs check`, and shows `want`.
fn verify_device(dev: &RamDevice, want: &Manifest, what: &str) {
    let img = dev.durable_bytes();
    assert!(
        img == dev.live_bytes(),
        "{what}: unflushed writes after commit"
    );
    let d: Arc<dyn BlockDevice> = Arc::new(RamDevice::new(img.clone()));
    verify_image(d, &[("expected", want)], what).unwrap_or_else(|e| panic!("{e}"));
    if have_btrfs_progs() {
        btrfs_check(&img, what).unwrap_or_else(|e| panic!("{e}"));
    } else {
        eprintln!("btrfs-progs missing: skipping btrfs check");
    }
}

fn expect_enospc(e: &Error, what: &str) {
    assert!(
        matches!(e, Error::NoSpace(_)),
        "{what}: expected NoSpace, got {e:?}"
    );
    assert_eq!(e.errno(), 28, "{what}: errno");
}

/// Writes `FILE_LEN` files named `{prefix}{i}` into `dir` until one fails; commits every 4
/// files. Returns the number written completely and the error.
fn fill_data(fs: &Fs, dir: Inode, prefix: &str, limit: usize) -> (usize, Option<Error>) {
    for i in 0..limit {
        let name = format!("{prefix}{i}");
        let r = fs
            .create(dir, name.as_bytes(), 0o644, OWNER)
            .and_then(|ino| fs.write(ino, 0, &content(i as u64, FILE_LEN)));
        match r {
            Ok(n) => assert_eq!(n, FILE_LEN, "short write without an error"),
            Err(e) => return (i, Some(e)),
        }
        if i % 4 == 3 {
            if let Err(e) = fs.commit() {
                return (i + 1, Some(e));
            }
        }
    }
    (limit, None)
}

/// The file being written when ENOSPC hit: whatever it shows must be a prefix of what was
/// being written (no garbage, no hole claimed as data).
fn check_partial(fs: &Fs, dir: Inode, name: &str, seed: u64) {
    let Some(e) = fs.lookup(dir, name.as_bytes()).unwrap() else {
        return;
    };
    let size = fs.stat(e.target).unwrap().size as usize;
    assert!(size <= FILE_LEN, "{name}: size {size} after ENOSPC");
    let data = fs.read(e.target, 0, size).unwrap();
    assert!(
        data == content(seed, FILE_LEN)[..size],
        "{name}: content after ENOSPC is not a prefix of what was written (size {size})"
    );
}

fn data_enospc(metadata: Profile, data: Profile, tag: &str, refill: bool) {
    let t = Instant::now();
    let size = min_device_size(metadata, data);
    let dev = Arc::new(RamDevice::new(fresh_image(size, metadata, data)));
    let fs = Fs::open_device_rw(dev.clone()).expect("open fresh image");
    let root = fs.root_inode();
    let dir = fs.mkdir(root, b"fill", 0o755, OWNER).unwrap();
    fs.commit().unwrap();

    let limit = (size as usize / FILE_LEN) + 8;
    let (n, err) = fill_data(&fs, dir, "f", limit);
    let err = err.unwrap_or_else(|| panic!("{tag}: wrote {limit} MiB into {size} bytes"));
    expect_enospc(&err, &format!("{tag}: data fill"));
    eprintln!(
        "{tag}: {} MiB image, ENOSPC after {n} files of 1 MiB ({err})",
        size >> 20
    );
    assert!(n as u64 * 4 >= size >> 20, "{tag}: only {n} MiB fit");
    // Not aborted: the filesystem still takes operations; a commit succeeds.
    check_partial(&fs, dir, &format!("f{n}"), n as u64);
    fs.commit()
        .unwrap_or_else(|e| panic!("{tag}: commit after ENOSPC: {e}"));
    // More data still fails cleanly, small metadata changes work.
    let extra = fs.create(dir, b"extra", 0o644, OWNER).unwrap();
    let e = fs.write(extra, 0, &content(7, 4 * FILE_LEN)).unwrap_err();
    expect_enospc(&e, &format!("{tag}: second write"));
    fs.commit().unwrap();
    let full = manifest(&fs).unwrap();
    for i in 0..n {
        let e = &full[&format!("/fill/f{i}")];
        assert_eq!(e.size, FILE_LEN as u64, "{tag}: f{i}");
    }
    drop(fs);
    verify_device(&dev, &full, &format!("{tag}-full"));
    if !refill {
        eprintln!("{tag}: {:.1}s", t.elapsed().as_secs_f64());
        return;
    }

    // Free the space: delete every other file, commit, and write as much again.
    let fs = Fs::open_device_rw(dev.clone()).unwrap();
    let dir = fs.resolve_in(fs.root_inode(), b"fill").unwrap();
    let mut freed = 0;
    for i in (0..n).step_by(REFILL_STEP) {
        fs.unlink(dir, format!("f{i}").as_bytes()).unwrap();
        freed += 1;
    }
    fs.unlink(dir, format!("f{n}").as_bytes()).ok();
    fs.unlink(dir, b"extra").unwrap();
    fs.commit().unwrap();
    let again = freed * 9 / 10;
    let (m, err) = fill_data(&fs, dir, "g", again);
    assert!(
        err.is_none(),
        "{tag}: after freeing {freed} MiB, only {m} of {again} MiB could be written: {err:?}"
    );
    fs.commit().unwrap();
    let after = manifest(&fs).unwrap();
    drop(fs);
    verify_device(&dev, &after, &format!("{tag}-refill"));
    eprintln!(
        "{tag}: freed {freed} MiB, rewrote {m} MiB; {:.1}s",
        t.elapsed().as_secs_f64()
    );
}

#[test]
fn data_enospc_single() {
    data_enospc(Profile::Single, Profile::Single, "enospc-single", false);
}

#[test]
fn data_enospc_dup_metadata() {
    data_enospc(Profile::Dup, Profile::Single, "enospc-dup", false);
}

/// Fill, then delete every other file and write as much again. Deleting cuts checksum items
/// and hits the leaf split bug of `src/tests/crash.rs`'s `csum_insert_before_full_leaf_item` (cow.rs):
/// the commit aborts with "key not greater than the previous key" in the csum tree.
#[test]
fn data_enospc_single_refill() {
    data_enospc(
        Profile::Single,
        Profile::Single,
        "enospc-single-refill",
        true,
    );
}

#[test]
fn data_enospc_dup_metadata_refill() {
    data_enospc(Profile::Dup, Profile::Single, "enospc-dup-refill", true);
}

/// Metadata runs out: empty files with large xattrs until ENOSPC.
#[test]
fn metadata_enospc() {
    let t = Instant::now();
    let (metadata, data) = (Profile::Single, Profile::Single);
    let size = min_device_size(metadata, data);
    let dev = Arc::new(RamDevice::new(fresh_image(size, metadata, data)));
    let fs = Fs::open_device_rw(dev.clone()).expect("open fresh image");
    let root = fs.root_inode();
    let mut dirs = Vec::new();
    for d in 0..16 {
        dirs.push(
            fs.mkdir(root, format!("m{d}").as_bytes(), 0o755, OWNER)
                .unwrap(),
        );
    }
    fs.commit().unwrap();
    let value = content(3, 3000);
    let mut made = 0usize;
    let mut err = None;
    'outer: for i in 0..1_000_000usize {
        let dir = dirs[i % dirs.len()];
        let name = format!("x{i:07}");
        let r = fs
            .create(dir, name.as_bytes(), 0o644, OWNER)
            .and_then(|ino| fs.setxattr(ino, b"user.big", &value, 0));
        match r {
            Ok(()) => made += 1,
            Err(e) => {
                err = Some(e);
                break 'outer;
            }
        }
        if i % 1000 == 999 {
            if let Err(e) = fs.commit() {
                err = Some(e);
                break;
            }
        }
    }
    let err = err.expect("metadata never ran out");
    expect_enospc(&err, "metadata fill");
    eprintln!("metadata: ENOSPC after {made} files with 3000-byte xattrs ({err})");
    fs.commit()
        .unwrap_or_else(|e| panic!("commit after metadata ENOSPC: {e}"));
    let e = fs
        .mkdir(root, b"one-more-dir", 0o755, OWNER)
        .map(|_| ())
        .and_then(|()| fs.commit());
    if let Err(e) = &e {
        expect_enospc(e, "mkdir when metadata is full");
    }
    let full = manifest(&fs).unwrap();
    assert!(
        full.len() >= made,
        "{} paths, {made} files made",
        full.len()
    );
    drop(fs);
    verify_device(&dev, &full, "enospc-metadata-full");

    // Deleting files works from the reserve (it commits to get COWed blocks back), and frees
    // metadata for new ones. Deleting the older half empties whole leaves of inode and xattr
    // items; directory leaves only get sparser (new names do not necessarily land there), so
    // expect a fraction of the deleted count back, and ENOSPC (not a failure) at the end.
    let fs = Fs::open_device_rw(dev.clone()).unwrap();
    let deleted = made / 2;
    for i in 0..deleted {
        let dir = dirs[i % dirs.len()];
        fs.unlink(dir, format!("x{i:07}").as_bytes())
            .unwrap_or_else(|e| panic!("unlink x{i:07}: {e}"));
        if i % 2000 == 1999 {
            fs.commit().unwrap();
        }
    }
    fs.commit().unwrap();
    let mut again = 0;
    for i in 0..made {
        let dir = dirs[i % dirs.len()];
        let r = fs
            .create(dir, format!("y{i:07}").as_bytes(), 0o644, OWNER)
            .and_then(|ino| fs.setxattr(ino, b"user.big", &value, 0));
        match r {
            Ok(()) => again += 1,
            Err(e) => {
                expect_enospc(&e, "metadata refill");
                break;
            }
        }
        if i % 1000 == 999 {
            fs.commit().unwrap();
        }
    }
    assert!(
        again * 4 >= deleted,
        "after deleting {deleted} files only {again} could be made again"
    );
    fs.commit().unwrap();
    let after = manifest(&fs).unwrap();
    drop(fs);
    verify_device(&dev, &after, "enospc-metadata-refill");
    eprintln!(
        "metadata: deleted {deleted}, recreated {again}; {:.1}s",
        t.elapsed().as_secs_f64()
    );
}
