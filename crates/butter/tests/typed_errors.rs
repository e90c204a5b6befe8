//! Errors by kind, not by text: what a front end maps to an errno is the variant.
//! - a hard link or rename between subvolumes is `Error::CrossSubvolume` (EXDEV), and the
//!   filesystem goes on;
//! - the image afterwards is clean to the checker.

mod crash_support;

use butter::fs::Fs;
use butter::inode::namespace::Owner;
use butter::internals::RamDevice;
use butter::mkfs::Profile;
use butter::Error;
use crash_support::{butter_check, fresh_image};
use std::sync::Arc;

#[test]
fn link_and_rename_across_subvolumes_are_exdev() {
    let dev = Arc::new(RamDevice::new(fresh_image(
        256 << 20,
        Profile::Dup,
        Profile::Single,
    )));
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
    butter_check(&fs).unwrap();
}
