//! The byte-identical image check (a guardrail for moving the engine's code around): a fixed
//! mkfs, then a scripted workload of writes, fsyncs (the log tree) and commits on the RAM
//! device, hashed at three points. A move that should change no behaviour must leave the
//! hashes as they are; a change that means to change bytes updates `GOLDEN` in the same commit
//! and says why there.
//!
//! `IMAGE_IDENTITY_PRINT=1 cargo test --release --test image_identity -- --nocapture` prints
//! the hashes.

mod crash_support;

use butter::format::items::Timespec;
use butter::fs::{Fs, Inode};
use butter::inode::namespace::{Owner, SetAttr};
use butter::internals::RamDevice;
use butter::mkfs::Profile;
use crash_support::{btrfs_check, butter_check, content, fresh_image};
use sha2::{Digest, Sha256};
use std::sync::Arc;

/// (after the fsyncs, with a log; after the first commit; after the close) as hex SHA-256.
const GOLDEN: [&str; 3] = [
    "675b55a430634d2f3ee6503d10e1993ff11b1ceb2701b21039b72cd07702abad",
    "d7b814c8bac4aca74c33169e2dce9485099a466afca86c3353200ebf43b390af",
    "e6850d792fe6370ea16ae46c58040a73b2111398888f9b2b102419371f33d07d",
];

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn hash(dev: &RamDevice) -> String {
    hex(&Sha256::digest(dev.durable_bytes()))
}

/// The workload; returns the three hashes and the final image.
fn run() -> ([String; 3], Vec<u8>) {
    let dev = Arc::new(RamDevice::new(fresh_image(
        256 << 20,
        Profile::Dup,
        Profile::Single,
    )));
    let fs = Fs::open_device_rw(dev.clone()).expect("open");
    let me = Owner {
        uid: 1000,
        gid: 1000,
    };
    let root = fs.root_inode();
    let d = fs.mkdir(root, b"dir", 0o755, me).unwrap();
    let sub = fs.mkdir(d, b"sub", 0o700, me).unwrap();
    let mut files: Vec<Inode> = Vec::new();
    for i in 0..40u64 {
        let parent = if i % 3 == 0 { sub } else { d };
        let f = fs
            .create(parent, format!("file-{i:03}").as_bytes(), 0o644, me)
            .unwrap();
        let len = match i % 4 {
            0 => 300,
            1 => 5000,
            2 => 70 << 10,
            _ => 600 << 10,
        };
        fs.write(f, 0, &content(i, len)).unwrap();
        files.push(f);
    }
    fs.commit().unwrap();
    // Changes after the commit, some fsynced: the log tree.
    for (i, &f) in files.iter().enumerate().take(12) {
        fs.write(f, 4096 * i as u64, &content(100 + i as u64, 9000))
            .unwrap();
        if i % 2 == 0 {
            fs.fsync(f, false).unwrap();
        }
    }
    let link = fs.create(d, b"to-link", 0o600, me).unwrap();
    fs.write(link, 0, b"linked").unwrap();
    fs.link(link, sub, b"second-name").unwrap();
    fs.rename(d, b"file-001", sub, b"moved", 0).unwrap();
    fs.unlink(d, b"file-002").unwrap();
    fs.symlink(d, b"sym", b"../dir/file-004", me).unwrap();
    fs.setxattr(files[4], b"user.k", b"value", 0).unwrap();
    fs.truncate(files[7], 1234).unwrap();
    fs.fallocate(files[5], 0, 1 << 20, 256 << 10).unwrap();
    fs.setattr(
        files[8],
        &SetAttr {
            mode: Some(0o600),
            mtime: Some(Timespec {
                sec: 1_600_000_000,
                nsec: 5,
            }),
            ..Default::default()
        },
    )
    .unwrap();
    fs.fsync(link, false).unwrap();
    fs.fsync(files[4], false).unwrap();
    let after_fsync = hash(&dev);
    fs.commit().unwrap();
    let after_commit = hash(&dev);
    for (i, &f) in files.iter().enumerate().skip(20).take(10) {
        fs.write(f, 0, &content(200 + i as u64, 40 << 10)).unwrap();
    }
    fs.unlink(sub, b"moved").unwrap();
    fs.commit().unwrap();
    drop(fs);
    // A second session on the same image.
    let fs = Fs::open_device_rw(dev.clone()).expect("reopen");
    let f = fs
        .create(fs.root_inode(), b"second-session", 0o644, me)
        .unwrap();
    fs.write(f, 0, &content(999, 200 << 10)).unwrap();
    fs.commit().unwrap();
    drop(fs);
    ([after_fsync, after_commit, hash(&dev)], dev.durable_bytes())
}

#[test]
fn the_scripted_workload_writes_the_same_bytes() {
    let (a, image) = run();
    let (b, _) = run();
    // The image the workload leaves is sound, to both checkers.
    let fs = Fs::open_device(Arc::new(RamDevice::new(image.clone()))).unwrap();
    butter_check(&fs).unwrap();
    btrfs_check(&image, "image-identity").unwrap();
    assert_eq!(
        a, b,
        "the same workload wrote different bytes twice in one process"
    );
    if std::env::var_os("IMAGE_IDENTITY_PRINT").is_some() || GOLDEN[0] == "unset" {
        println!("GOLDEN: {a:#?}");
    }
    assert_eq!(
        [a[0].as_str(), a[1].as_str(), a[2].as_str()],
        GOLDEN,
        "the image bytes changed: if the change is intended, update GOLDEN and say why in the \
         commit"
    );
}
