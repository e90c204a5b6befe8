//! Reads images made by the real mkfs.btrfs (`--rootdir`, no root needed) and compares every
//! file with its source; checks tree shape, readahead and DUP fallback on the engine directly.

use butter::ctree::{Root, TreeIter};
use butter::format::*;
use butter::fs::{Fs, Inode};
use butter::internals::RamDevice;
use butter::io::device::BlockDevice;
use butter::io::disk_io::Readahead;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

fn require_mkfs() -> bool {
    let ok = Command::new("mkfs.btrfs")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok && std::env::var_os("CI").is_some() {
        panic!("mkfs.btrfs is required in CI (install btrfs-progs)");
    }
    if !ok {
        eprintln!("skipping: mkfs.btrfs not installed");
    }
    ok
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("butter-read-basic-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Deterministic content: `n` bytes from a seed.
fn content(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    (0..n)
        .map(|i| {
            if i % 4096 < 2048 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            } else {
                b'a' + (i % 26) as u8
            }
        })
        .collect()
}

fn make_tree(src: &Path, files: usize) -> BTreeMap<String, Vec<u8>> {
    let mut m = BTreeMap::new();
    for i in 0..files {
        let dir = format!("d{}/e{}", i % 7, i % 3);
        std::fs::create_dir_all(src.join(&dir)).unwrap();
        let size = match i % 5 {
            0 => 0,
            1 => 100 + i,
            2 => 5000 + i * 7,
            3 => 70_000 + i,
            _ => 300_000 + i * 13,
        };
        let rel = format!("{dir}/file-{i:05}-{}", "x".repeat(i % 40));
        let data = content(i as u64, size);
        std::fs::write(src.join(&rel), &data).unwrap();
        m.insert(rel, data);
    }
    std::os::unix::fs::symlink("d0/e0", src.join("link")).unwrap();
    m
}

fn mkfs(img: &Path, src: &Path, args: &[&str]) {
    let f = std::fs::File::create(img).unwrap();
    f.set_len(512 << 20).unwrap();
    let out = Command::new("mkfs.btrfs")
        .args(["-q", "-f"])
        .args(args)
        .arg("--rootdir")
        .arg(src)
        .arg(img)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "mkfs.btrfs failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn read_all(fs: &Fs, ino: Inode, size: u64) -> Vec<u8> {
    let mut v = Vec::new();
    while (v.len() as u64) < size {
        let b = fs.read(ino, v.len() as u64, 128 * 1024).unwrap();
        assert!(!b.is_empty());
        v.extend_from_slice(&b);
    }
    v
}

fn check_image(img: &Path, expect: &BTreeMap<String, Vec<u8>>) -> Fs {
    let fs = Fs::open(img).unwrap();
    for (rel, data) in expect {
        let ino = fs
            .core()
            .resolve(rel)
            .unwrap_or_else(|e| panic!("{rel}: {e}"));
        let st = fs.stat(ino).unwrap();
        assert!(st.is_reg(), "{rel}");
        assert_eq!(st.size, data.len() as u64, "{rel}");
        assert!(
            read_all(&fs, ino, st.size) == *data,
            "content of {rel} differs"
        );
        // Unaligned reads inside the file.
        if data.len() > 10_000 {
            let b = fs.read(ino, 4097, 9000).unwrap();
            assert_eq!(&b[..], &data[4097..4097 + 9000], "{rel} unaligned");
        }
    }
    let l = fs.core().resolve("link").unwrap();
    assert_eq!(fs.readlink(l).unwrap(), b"d0/e0");
    // readdir agrees with lookup, in index order.
    let d = fs.core().resolve("d1/e1").unwrap();
    let ents = fs.readdir(d, 0, 0).unwrap();
    assert!(!ents.is_empty());
    assert!(ents.windows(2).all(|w| w[0].index < w[1].index));
    for e in &ents {
        assert_eq!(fs.lookup(d, &e.name).unwrap().unwrap().target, e.target);
    }
    // Resuming readdir from a cookie gives the rest.
    let rest = fs.readdir(d, ents[0].index, 0).unwrap();
    assert_eq!(rest.len(), ents.len() - 1);
    fs
}

#[test]
fn reads_mkfs_rootdir_images_in_several_variants() {
    if !require_mkfs() {
        return;
    }
    let t = tmpdir("variants");
    let src = t.join("src");
    let expect = make_tree(&src, 300);
    for (name, args) in [
        ("default", vec![]),
        ("node4k", vec!["--nodesize", "4096"]),
        ("node64k", vec!["--nodesize", "65536"]),
        ("xxhash", vec!["--csum", "xxhash"]),
        ("sha256", vec!["--csum", "sha256"]),
        ("blake2", vec!["--csum", "blake2"]),
        ("holes", vec!["-O", "^no-holes"]),
        ("fat", vec!["-O", "^skinny-metadata"]),
    ] {
        let img = t.join(format!("{name}.img"));
        mkfs(&img, &src, &args);
        check_image(&img, &expect);
        std::fs::remove_file(&img).unwrap();
    }
    std::fs::remove_dir_all(&t).unwrap();
}

/// Collects (level of root) for every tree in the root tree.
fn root_levels(fs: &Fs) -> BTreeMap<u64, u8> {
    let mut it = TreeIter::new(
        fs.disk().clone(),
        fs.core().tree_root(),
        Key::MIN,
        Readahead::None,
    )
    .unwrap();
    let mut m = BTreeMap::new();
    while let Some(item) = it.next_item().unwrap() {
        if item.key.ty == ROOT_ITEM_KEY {
            let ri = butter::format::items::RootItem::parse(item.data()).unwrap();
            m.insert(item.key.objectid, ri.level);
        }
    }
    m
}

#[test]
fn deep_trees_and_forward_always_readahead() {
    if !require_mkfs() {
        return;
    }
    let t = tmpdir("deep");
    let src = t.join("src");
    // Many small non-inline files at nodesize 4 KiB: fs tree and extent tree grow to level 2.
    std::fs::create_dir_all(src.join("many")).unwrap();
    for i in 0..12000 {
        std::fs::write(
            src.join(format!("many/f{i}")),
            content(i, 4096 + (i as usize % 3)),
        )
        .unwrap();
    }
    let img = t.join("deep.img");
    mkfs(&img, &src, &["--nodesize", "4096"]);
    let fs = Fs::open(&img).unwrap();
    let levels = root_levels(&fs);
    assert!(levels[&FS_TREE_OBJECTID] >= 2, "fs tree level {:?}", levels);
    assert!(
        levels[&EXTENT_TREE_OBJECTID] >= 2,
        "extent tree level {:?}",
        levels
    );

    // A whole-tree walk with FORWARD_ALWAYS issues readahead; every item comes in key order.
    let ri = fs.find_root_item(FS_TREE_OBJECTID).unwrap().unwrap();
    let root = Root {
        id: FS_TREE_OBJECTID,
        bytenr: ri.bytenr,
        level: ri.level,
        generation: ri.generation,
    };
    let fresh = Fs::open(&img).unwrap();
    let mut it = TreeIter::new(
        fresh.disk().clone(),
        root,
        Key::MIN,
        Readahead::ForwardAlways,
    )
    .unwrap();
    let mut n = 0;
    while it.next_item().unwrap().is_some() {
        n += 1;
    }
    assert!(n > 12000 * 4);
    let ra = fresh
        .disk()
        .stats
        .readahead_queued
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(ra > 0, "FORWARD_ALWAYS issued no readahead");

    // Walking backwards with BACK readahead visits the same items in reverse order.
    let back = Fs::open(&img).unwrap();
    let (mut path, _) =
        butter::ctree::search_slot(back.disk(), &root, &Key::MAX, Readahead::Back).unwrap();
    let mut m = 0;
    let mut last: Option<Key> = None;
    while butter::ctree::prev_item(back.disk(), &mut path).unwrap() {
        let k = path.item().unwrap().key;
        assert!(
            last.is_none_or(|l| k < l),
            "keys must decrease walking backwards"
        );
        last = Some(k);
        m += 1;
    }
    assert_eq!(m, n, "backward walk saw a different number of items");
    let ra = back
        .disk()
        .stats
        .readahead_queued
        .load(std::sync::atomic::Ordering::Relaxed);
    assert!(ra > 0, "BACK issued no readahead");

    let dir = fs.core().resolve("many").unwrap();
    let ents = fs.readdir(dir, 0, 0).unwrap();
    assert_eq!(ents.len(), 12000);
    let e = fs.lookup(dir, b"f11999").unwrap().unwrap();
    assert_eq!(
        fs.read(e.target, 0, 8192).unwrap(),
        content(11999, 4096 + 11999 % 3)
    );
    std::fs::remove_dir_all(&t).unwrap();
}

#[test]
fn damaged_primary_copy_reads_the_dup_mirror() {
    if !require_mkfs() {
        return;
    }
    let t = tmpdir("dup");
    let src = t.join("src");
    let expect = make_tree(&src, 60);
    let img = t.join("dup.img");
    mkfs(&img, &src, &[]);
    let bytes = std::fs::read(&img).unwrap();
    let fs = Fs::open(&img).unwrap();
    // Damage copy 0 of the fs tree root block; copy 1 (metadata is DUP) must be used.
    let ri = fs.find_root_item(FS_TREE_OBJECTID).unwrap().unwrap();
    let copies = fs.disk().chunk_map().map(ri.bytenr, 4096).unwrap();
    assert_eq!(copies.len(), 2, "metadata should be DUP");
    let mut bad = bytes.clone();
    bad[copies[0].physical as usize + 200] ^= 0xff;
    let dev: Arc<dyn BlockDevice> = Arc::new(RamDevice::new(bad.clone()));
    let fs2 = Fs::open_device(dev).unwrap();
    for (rel, data) in &expect {
        let ino = fs2.core().resolve(rel).unwrap();
        assert_eq!(read_all(&fs2, ino, data.len() as u64), *data);
    }
    // Both copies bad: a typed checksum error naming the block.
    bad[copies[1].physical as usize + 200] ^= 0xff;
    let fs3 =
        Fs::open_device(Arc::new(RamDevice::new(bad))).map(|f| f.core().resolve("d0").map(|_| ()));
    let err = match fs3 {
        Err(e) | Ok(Err(e)) => e.to_string(),
        Ok(Ok(())) => panic!("read through two damaged copies"),
    };
    assert!(err.contains(&format!("block {}", ri.bytenr)), "{err}");
    std::fs::remove_dir_all(&t).unwrap();
}
