//! Errors by kind, not by text: what a front end maps to an errno is the variant.
//! - a hard link or rename between subvolumes is `Error::CrossSubvolume` (EXDEV), and the
//!   filesystem goes on;
//! - the image afterwards is clean to the checker.

use butter::device::RamDevice;
use butter::fs::Fs;
use butter::fs_write::Owner;
use butter::mkfs::{mkfs, MkfsOptions};
use butter::Error;
use std::sync::Arc;

#[test]
fn link_and_rename_across_subvolumes_are_exdev() {
    std::env::set_var("BUTTER_FIXED_TIME", "1700000000");
    let size = 256u64 << 20;
    let dev = Arc::new(RamDevice::new(vec![0u8; size as usize]));
    let opts = MkfsOptions {
        size,
        fsid: Some(*b"butter-exdev-tst"),
        time: Some(1_700_000_000),
        ..MkfsOptions::default()
    };
    mkfs(dev.as_ref(), &opts).unwrap();
    let fs = Fs::open_device_rw(dev.clone()).unwrap();
    let me = Owner { uid: 0, gid: 0 };
    let top = fs.root_inode();
    let sub = fs.create_subvolume(top, b"sub", 0o755, me, None).unwrap();
    let f = fs.create(top, b"f", 0o644, me).unwrap();
    let e = fs.link(f, sub, b"g").unwrap_err();
    assert!(matches!(e, Error::CrossSubvolume(_)), "link: {e:?}");
    assert_eq!(e.errno(), 18, "EXDEV");
    let e = fs.rename(top, b"f", sub, b"g", 0).unwrap_err();
    assert!(matches!(e, Error::CrossSubvolume(_)), "rename: {e:?}");
    // The filesystem goes on: the same rename within one subvolume works.
    fs.rename(top, b"f", top, b"h", 0).unwrap();
    fs.commit().unwrap();
    drop(fs);
    let fs = Fs::open_device(Arc::new(RamDevice::new(dev.durable_bytes()))).unwrap();
    let rep = butter::check::check(&fs, &mut |_| {}).unwrap();
    assert!(rep.is_clean(), "butter check: {:?}", rep.findings);
}
