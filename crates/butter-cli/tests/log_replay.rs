//! Fsync log replay against the kernel's.
//!
//! Each scenario: the kernel writes a base state on a loop mount (`commit=600`, so no
//! transaction commits on its own), remounts it, then makes the scenario's changes and fsyncs.
//! The image file is copied right then, while still mounted: the copy is a crash image with an
//! fsync log (its superblock's log_root is checked). Copy A is mounted by the kernel, which
//! replays the log; copy B is opened read-write by butter, which replays and commits. Then:
//! butter's view of B equals the kernel's view of A, the kernel's view of B (mounted after
//! butter's replay) equals it too, `btrfs check --readonly` and butter's checker pass on B.
//!
//! Needs root and loop devices (`CI` set: missing privileges fail instead of skipping).

mod common;

use butter::fs::{Fs, OpenOpts};
use common::butter_target::manifest_of;
use common::fsync::{
    copy_sparse, fallocate, fsync_path as fsync, kernel_manifest, kernel_views_compare_opts,
    log_root_of, open_rw, pattern, removexattr, replay_compare_opts as compare_opts, setxattr,
    write_file,
};
use common::kernel::*;
use common::manifest;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Builds the crash image: `setup` runs and is synced, then `ops` (which fsyncs) runs and the
/// image is copied while mounted. Returns the crash image path.
fn crash_image(scratch: &ScratchDir, setup: &dyn Fn(&Path), ops: &dyn Fn(&Path)) -> PathBuf {
    crash_image_opts(scratch, &[], "", setup, ops)
}

fn crash_image_opts(
    scratch: &ScratchDir,
    mkfs_args: &[&str],
    extra: &str,
    setup: &dyn Fn(&Path),
    ops: &dyn Fn(&Path),
) -> PathBuf {
    let opts = format!("commit=600,noatime{extra}");
    let img = scratch.join("img");
    mkfs_btrfs(&img, 256 << 20, mkfs_args);
    let crash = scratch.join("crash");
    {
        let m = LoopMount::btrfs(&img, &scratch.dir("m0"), &opts);
        setup(m.path());
        m.unmount();
        // A fresh mount: the base state is committed and nothing else is pending. (With a
        // `sync` instead, the kernel 6.18 here often commits at the fsync instead of logging.)
        let m = LoopMount::btrfs(&img, &scratch.dir("m0"), &opts);
        ops(m.path());
        copy_sparse(&img, &crash);
        m.unmount();
    }
    assert_ne!(
        log_root_of(&crash),
        0,
        "the crash image has no fsync log (the scenario did not fsync after its changes?)"
    );
    crash
}

/// A file butter writes after its replay.
const AFTER: &str = "written-after-replay";

fn run_scenario(name: &str, setup: &dyn Fn(&Path), ops: &dyn Fn(&Path)) {
    run_scenario_opts(name, "", setup, ops)
}

/// `extra`: more mount options for the kernel's writes (",compress=zstd").
fn run_scenario_opts(name: &str, extra: &str, setup: &dyn Fn(&Path), ops: &dyn Fn(&Path)) {
    run_scenario_on(name, &[], extra, setup, ops)
}

/// [`run_scenario_opts`] on an image mkfs.btrfs makes with `mkfs_args`.
fn run_scenario_on(
    name: &str,
    mkfs_args: &[&str],
    extra: &str,
    setup: &dyn Fn(&Path),
    ops: &dyn Fn(&Path),
) {
    if !require_privileges() {
        return;
    }
    let scratch = ScratchDir::new(&format!("logreplay-{name}"));
    let crash = crash_image_opts(&scratch, mkfs_args, extra, setup, ops);
    let a = scratch.join("a.img");
    let b = scratch.join("b.img");
    copy_sparse(&crash, &a);
    copy_sparse(&crash, &b);
    // The kernel replays copy A.
    let want = kernel_manifest(&a, &scratch.dir("ma"), "noatime");
    // butter replays copy B.
    {
        let fs = Fs::open_rw(&b).unwrap_or_else(|e| panic!("{name}: butter open_rw: {e}"));
        fs.commit()
            .unwrap_or_else(|e| panic!("{name}: commit: {e}"));
        let got = manifest_of(&fs, fs.root_inode());
        manifest::assert_same(
            &want,
            &got,
            &compare_opts(),
            &format!("{name}: kernel replay vs butter replay"),
        );
    }
    assert_eq!(log_root_of(&b), 0, "{name}: butter left log_root set");
    let (ok, text) = btrfs_check(&b);
    assert!(ok, "{name}: btrfs check after butter's replay:\n{text}");
    // A fresh read-only open sees the same.
    {
        let fs = Fs::open(&b).unwrap_or_else(|e| panic!("{name}: reopen: {e}"));
        let got = manifest_of(&fs, fs.root_inode());
        manifest::assert_same(&want, &got, &compare_opts(), &format!("{name}: reopened"));
        let report = fs
            .check(Default::default(), &mut |_| {})
            .unwrap_or_else(|e| panic!("{name}: butter check: {e}"));
        let bad: Vec<_> = report
            .findings
            .iter()
            .filter(|f| f.severity != butter::check::Severity::Warning)
            .collect();
        assert!(
            bad.is_empty(),
            "{name}: butter check after replay: {bad:#?}"
        );
    }
    // butter writes more after its replay: nothing may land on what the log referenced.
    {
        let fs = Fs::open_rw(&b).unwrap_or_else(|e| panic!("{name}: reopen read-write: {e}"));
        let owner = butter::inode::namespace::Owner { uid: 0, gid: 0 };
        let ino = fs
            .create(fs.root_inode(), AFTER.as_bytes(), 0o644, owner)
            .unwrap();
        for i in 0..32u64 {
            fs.write(ino, i * 65536, &pattern(65536, i as u8)).unwrap();
        }
        fs.commit().unwrap();
    }
    // The kernel sees the same on B.
    let mut kb = kernel_manifest(&b, &scratch.dir("mb"), "ro,noatime");
    let after = kb
        .entries
        .remove(Path::new(AFTER))
        .expect("the file written after replay");
    assert_eq!(after.size, 32 * 65536);
    if let Some(root) = kb.entries.get_mut(Path::new("")) {
        if let Some(names) = root.names.as_mut() {
            names.retain(|n| n != AFTER.as_bytes());
        }
    }
    manifest::assert_same(
        &want,
        &kb,
        &kernel_views_compare_opts(),
        &format!("{name}: kernel view of A vs kernel view of B after butter's replay"),
    );
    let (ok, text) = btrfs_check(&b);
    assert!(ok, "{name}: btrfs check after butter wrote more:\n{text}");
}

// ---------------------------------------------------------------------------------------------
// Scenarios

#[test]
fn new_file() {
    run_scenario(
        "new-file",
        &|m| {
            fs::create_dir(m.join("d")).unwrap();
            write_file(&m.join("d/old"), 100, 1);
        },
        &|m| {
            write_file(&m.join("d/new"), 20000, 2);
            write_file(&m.join("d/small"), 300, 3);
            fsync(&m.join("d/new"));
            fsync(&m.join("d/small"));
        },
    );
}

#[test]
fn append() {
    run_scenario("append", &|m| write_file(&m.join("f"), 10000, 4), &|m| {
        let mut f = OpenOptions::new().append(true).open(m.join("f")).unwrap();
        f.write_all(&pattern(50000, 5)).unwrap();
        f.sync_all().unwrap();
    });
}

#[test]
fn overwrite_middle() {
    run_scenario(
        "overwrite",
        &|m| write_file(&m.join("f"), 120 << 10, 6),
        &|m| {
            let f = open_rw(&m.join("f"));
            f.write_all_at(&pattern(8192, 7), 65536).unwrap();
            f.write_all_at(&pattern(100, 8), 100000).unwrap();
            f.sync_all().unwrap();
        },
    );
}

#[test]
fn punch_hole() {
    run_scenario("punch", &|m| write_file(&m.join("f"), 120 << 10, 9), &|m| {
        let f = open_rw(&m.join("f"));
        fallocate(
            &f,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            16384,
            65536,
        );
        f.sync_all().unwrap();
    });
}

#[test]
fn truncate_down() {
    run_scenario(
        "truncdown",
        &|m| {
            write_file(&m.join("f"), 120 << 10, 10);
            write_file(&m.join("g"), 120 << 10, 11);
        },
        &|m| {
            let f = open_rw(&m.join("f"));
            f.set_len(5000).unwrap();
            f.sync_all().unwrap();
            let g = open_rw(&m.join("g"));
            g.set_len(70000).unwrap();
            g.sync_all().unwrap();
        },
    );
}

#[test]
fn truncate_up() {
    run_scenario("truncup", &|m| write_file(&m.join("f"), 10000, 12), &|m| {
        let f = open_rw(&m.join("f"));
        f.set_len(300000).unwrap();
        f.sync_all().unwrap();
    });
}

#[test]
fn prealloc() {
    run_scenario("prealloc", &|m| write_file(&m.join("g"), 8192, 13), &|m| {
        let f = File::create(m.join("f")).unwrap();
        fallocate(&f, 0, 0, 1 << 20);
        f.write_all_at(&pattern(4096, 14), 8192).unwrap();
        f.sync_all().unwrap();
        let g = open_rw(&m.join("g"));
        fallocate(&g, libc::FALLOC_FL_KEEP_SIZE, 8192, 65536);
        g.sync_all().unwrap();
    });
}

#[test]
fn rename_fsync_file() {
    run_scenario(
        "rename-file",
        &|m| {
            fs::create_dir(m.join("d")).unwrap();
            fs::create_dir(m.join("e")).unwrap();
            write_file(&m.join("d/a"), 5000, 15);
            write_file(&m.join("d/b"), 5000, 16);
        },
        &|m| {
            // (A rename into another directory followed by an fsync of the file makes this
            // kernel commit the transaction instead of logging.)
            fs::rename(m.join("d/a"), m.join("d/a2")).unwrap();
            fsync(&m.join("d/a2"));
        },
    );
}

#[test]
fn rename_fsync_dir() {
    run_scenario(
        "rename-dir",
        &|m| {
            fs::create_dir(m.join("d")).unwrap();
            fs::create_dir(m.join("e")).unwrap();
            write_file(&m.join("d/a"), 5000, 17);
            write_file(&m.join("d/c"), 50, 18);
        },
        &|m| {
            fs::rename(m.join("d/a"), m.join("e/a")).unwrap();
            fsync(&m.join("e"));
        },
    );
}

#[test]
fn rename_in_dir_fsync_dir() {
    run_scenario(
        "rename-in-dir",
        &|m| {
            fs::create_dir(m.join("d")).unwrap();
            write_file(&m.join("d/a"), 5000, 17);
            write_file(&m.join("d/c"), 50, 18);
        },
        &|m| {
            fs::rename(m.join("d/c"), m.join("d/c2")).unwrap();
            fs::rename(m.join("d/a"), m.join("d/z")).unwrap();
            fsync(&m.join("d"));
        },
    );
}

#[test]
fn link_fsync() {
    run_scenario(
        "link",
        &|m| {
            fs::create_dir(m.join("d")).unwrap();
            write_file(&m.join("d/a"), 3000, 19);
        },
        &|m| {
            fs::hard_link(m.join("d/a"), m.join("d/b")).unwrap();
            fs::hard_link(m.join("d/a"), m.join("c")).unwrap();
            fsync(&m.join("d/a"));
        },
    );
}

#[test]
fn unlink_fsync_dir() {
    run_scenario(
        "unlink",
        &|m| {
            fs::create_dir(m.join("d")).unwrap();
            for i in 0..5 {
                write_file(&m.join(format!("d/f{i}")), 1000 * (i + 1), 20 + i as u8);
            }
            fs::hard_link(m.join("d/f3"), m.join("f3link")).unwrap();
        },
        &|m| {
            fs::remove_file(m.join("d/f1")).unwrap();
            fs::remove_file(m.join("d/f3")).unwrap();
            fsync(&m.join("d"));
        },
    );
}

#[test]
fn dir_create_delete() {
    run_scenario(
        "dir-churn",
        &|m| {
            fs::create_dir(m.join("d")).unwrap();
            write_file(&m.join("d/x"), 100, 30);
            write_file(&m.join("d/y"), 9000, 31);
        },
        &|m| {
            write_file(&m.join("d/n1"), 100, 32);
            write_file(&m.join("d/n2"), 7000, 33);
            fs::create_dir(m.join("d/sub")).unwrap();
            write_file(&m.join("d/sub/z"), 10, 34);
            // The kernel logs new subdirectories recursively.
            fs::create_dir(m.join("d/sub/deeper")).unwrap();
            write_file(&m.join("d/sub/deeper/w"), 70_000, 35);
            fs::create_dir(m.join("d/sub/deeper/empty")).unwrap();
            std::os::unix::fs::symlink("n2", m.join("d/ln")).unwrap();
            fs::remove_file(m.join("d/x")).unwrap();
            fs::remove_file(m.join("d/n1")).unwrap();
            fsync(&m.join("d"));
        },
    );
}

#[test]
fn xattrs() {
    run_scenario(
        "xattr",
        &|m| {
            write_file(&m.join("f"), 100, 35);
            setxattr(&m.join("f"), "user.a", b"one");
            setxattr(&m.join("f"), "user.b", b"two");
        },
        &|m| {
            setxattr(&m.join("f"), "user.c", b"three");
            setxattr(&m.join("f"), "user.b", b"changed");
            removexattr(&m.join("f"), "user.a");
            fsync(&m.join("f"));
        },
    );
}

#[test]
fn subvolume_and_snapshot() {
    run_scenario(
        "subvol",
        &|m| {
            sh(
                "btrfs",
                &[
                    "subvolume".as_ref(),
                    "create".as_ref(),
                    m.join("sv").as_os_str(),
                ],
            );
            write_file(&m.join("sv/f"), 20000, 36);
            sh(
                "btrfs",
                &[
                    "subvolume".as_ref(),
                    "snapshot".as_ref(),
                    m.join("sv").as_os_str(),
                    m.join("snap").as_os_str(),
                ],
            );
        },
        &|m| {
            let mut f = OpenOptions::new()
                .append(true)
                .open(m.join("snap/f"))
                .unwrap();
            f.write_all(&pattern(9000, 37)).unwrap();
            f.sync_all().unwrap();
            write_file(&m.join("sv/g"), 5000, 38);
            fsync(&m.join("sv/g"));
        },
    );
}

fn many_files_ops(m: &Path) {
    for i in 0..150 {
        let p = m.join(format!("d/file-with-a-longer-name-{i:04}"));
        write_file(&p, 500 + i * 37, i as u8);
        fsync(&p);
    }
}

#[test]
fn many_files() {
    run_scenario(
        "many",
        &|m| fs::create_dir(m.join("d")).unwrap(),
        &many_files_ops,
    );
}

/// The same on a block-group-tree image (mkfs.btrfs's default since 6.19): butter's replay
/// and its writes after it keep the block group items in tree 11.
#[test]
fn many_files_block_group_tree() {
    run_scenario_on(
        "many-bgt",
        &["-O", "block-group-tree"],
        "",
        &|m| fs::create_dir(m.join("d")).unwrap(),
        &many_files_ops,
    );
}

#[test]
fn compressed() {
    run_scenario_opts(
        "compressed",
        ",compress=zstd",
        &|m| write_file(&m.join("f"), 20000, 42),
        &|m| {
            let text: Vec<u8> = b"compressible text "
                .iter()
                .cycle()
                .take(300000)
                .copied()
                .collect();
            fs::write(m.join("g"), &text).unwrap();
            fsync(&m.join("g"));
            let f = open_rw(&m.join("f"));
            f.write_all_at(&text[..12288], 4096).unwrap();
            f.sync_all().unwrap();
        },
    );
}

#[test]
fn rmdir_fsync_parent() {
    run_scenario(
        "rmdir",
        &|m| {
            fs::create_dir_all(m.join("d/sub")).unwrap();
            fs::create_dir_all(m.join("d/keep")).unwrap();
            write_file(&m.join("d/keep/f"), 100, 43);
        },
        &|m| {
            fs::remove_dir(m.join("d/sub")).unwrap();
            write_file(&m.join("d/new"), 100, 44);
            fsync(&m.join("d"));
        },
    );
}

#[test]
fn rename_over_existing() {
    run_scenario(
        "rename-over",
        &|m| {
            fs::create_dir(m.join("d")).unwrap();
            write_file(&m.join("d/a"), 5000, 45);
            write_file(&m.join("d/b"), 7000, 46);
        },
        &|m| {
            fs::rename(m.join("d/a"), m.join("d/b")).unwrap();
            fsync(&m.join("d/b"));
        },
    );
}

/// The atomic replace, across directories and within one: a temporary file fsynced,
/// renamed over the target, the directory fsynced.
#[test]
fn atomic_replace_fsync_dir() {
    run_scenario(
        "atomic-replace",
        &|m| {
            fs::create_dir(m.join("d")).unwrap();
            fs::create_dir(m.join("tmp")).unwrap();
            write_file(&m.join("d/config"), 5000, 65);
            write_file(&m.join("d/state"), 9000, 68);
            write_file(&m.join("d/other"), 700, 66);
        },
        &|m| {
            write_file(&m.join("d/config.tmp"), 5500, 67);
            fsync(&m.join("d/config.tmp"));
            fs::rename(m.join("d/config.tmp"), m.join("d/config")).unwrap();
            write_file(&m.join("tmp/state"), 12000, 69);
            fsync(&m.join("tmp/state"));
            fs::rename(m.join("tmp/state"), m.join("d/state")).unwrap();
            fsync(&m.join("d"));
        },
    );
}

/// Enough extents that the log tree needs more than one leaf.
#[test]
fn many_extents() {
    run_scenario(
        "many-extents",
        &|m| write_file(&m.join("small"), 10, 47),
        &|m| {
            let f = File::create(m.join("f")).unwrap();
            for i in 0..1500u64 {
                f.write_all_at(&pattern(4096, i as u8), i * 8192).unwrap();
            }
            f.sync_all().unwrap();
        },
    );
}

/// The second fsync of an inode in one transaction takes the kernel's fast path (only what
/// changed since the first is logged); xattrs the log does not repeat must survive.
#[test]
fn repeated_fsync() {
    run_scenario(
        "repeated",
        &|m| {
            write_file(&m.join("f"), 6000, 53);
            setxattr(&m.join("f"), "user.keep", b"kept");
        },
        &|m| {
            let mut f = OpenOptions::new().append(true).open(m.join("f")).unwrap();
            f.write_all(&pattern(9000, 54)).unwrap();
            f.sync_all().unwrap();
            f.write_all(&pattern(5000, 55)).unwrap();
            f.sync_all().unwrap();
            let g = open_rw(&m.join("f"));
            g.write_all_at(&pattern(100, 56), 10).unwrap();
            g.sync_all().unwrap();
        },
    );
}

/// A read-only open of a log image shows the replayed view and writes nothing; `nologreplay`
/// shows the committed state.
#[test]
fn read_only_open_replays_in_memory() {
    if !require_privileges() {
        return;
    }
    let scratch = ScratchDir::new("logreplay-ro");
    let crash = crash_image(&scratch, &|m| write_file(&m.join("old"), 100, 40), &|m| {
        write_file(&m.join("new"), 30000, 41);
        fsync(&m.join("new"));
    });
    let before = fs::read(&crash).unwrap();
    let a = scratch.join("a.img");
    copy_sparse(&crash, &a);
    let want = kernel_manifest(&a, &scratch.dir("ma"), "noatime");
    {
        let fs = Fs::open(&crash).unwrap_or_else(|e| panic!("read-only open: {e}"));
        assert!(!fs.is_writable());
        let got = manifest_of(&fs, fs.root_inode());
        manifest::assert_same(
            &want,
            &got,
            &compare_opts(),
            "read-only open vs kernel replay",
        );
        let e = fs
            .lookup(fs.root_inode(), b"new")
            .unwrap()
            .expect("new is visible");
        assert_eq!(fs.read(e.target, 0, 30000).unwrap(), pattern(30000, 41));
    }
    {
        let fs = Fs::open_opts(&crash, OpenOpts::nologreplay()).unwrap();
        assert!(fs.lookup(fs.root_inode(), b"new").unwrap().is_none());
        assert!(fs.lookup(fs.root_inode(), b"old").unwrap().is_some());
    }
    assert!(
        fs::read(&crash).unwrap() == before,
        "a read-only open changed the image"
    );
}

/// Damaged logs (bytes changed inside log blocks, checksums fixed up so the damage reaches the
/// parser): opening gives a typed error or a replay, never a panic.
#[test]
fn corrupt_log_never_panics() {
    if !require_privileges() {
        return;
    }
    let scratch = ScratchDir::new("logreplay-corrupt");
    let crash = crash_image(
        &scratch,
        &|m| {
            fs::create_dir(m.join("d")).unwrap();
            write_file(&m.join("d/a"), 5000, 50);
            write_file(&m.join("d/b"), 100, 51);
        },
        &|m| {
            write_file(&m.join("d/new"), 20000, 52);
            setxattr(&m.join("d/new"), "user.x", b"value");
            fs::hard_link(m.join("d/a"), m.join("d/a2")).unwrap();
            fs::remove_file(m.join("d/b")).unwrap();
            fsync(&m.join("d/new"));
            fsync(&m.join("d"));
        },
    );
    // The log's blocks.
    let blocks = {
        let dev = butter::io::device::FileDevice::open(&crash, false).unwrap();
        butter::internals::log_blocks(std::sync::Arc::new(dev)).unwrap()
    };
    assert!(!blocks.is_empty(), "the crash image has no fsync log");
    let pristine = fs::read(&crash).unwrap();
    let work = scratch.join("work.img");
    let iterations: u64 = std::env::var("BUTTER_LOG_FUZZ")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let mut seed = 0x2545F4914F6CDD1Du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut outcomes = [0usize; 3];
    for i in 0..iterations {
        let bytenr = blocks[(next() % blocks.len() as u64) as usize];
        let (r1, r2, r3) = (next(), next(), next());
        let mut v = (r3 & 0xff) as u8;
        if v == 0 {
            v = 1;
        }
        if i == 0 {
            fs::write(&work, &pristine).unwrap();
        }
        // Flip one byte of the block, reseal it and write every copy; `undo` puts it back.
        let mut off = 0;
        let dev = butter::io::device::FileDevice::open(&work, true).unwrap();
        let undo = butter::internals::rewrite_block(std::sync::Arc::new(dev), bytenr, |block| {
            let ns = block.len();
            let nritems = u32::from_le_bytes(block[96..100].try_into().unwrap()) as usize;
            let used = 101 + nritems * 25;
            // Mostly item headers and the item data at the end of the leaf.
            off = if r1 % 2 == 0 {
                32 + (r2 as usize % (used - 32))
            } else {
                ns - 1 - (r2 as usize % 2048)
            };
            block[off] ^= v;
        })
        .unwrap();
        // A read-write open changes more than the damaged block, so the whole image is
        // restored after one.
        let rw = i % 20 == 0;
        let r = std::panic::catch_unwind(|| {
            if rw {
                Fs::open_rw(&work).and_then(|fs| {
                    fs.commit()?;
                    // Whatever was replayed must read back.
                    walk_bounded(&fs)
                })
            } else {
                Fs::open(&work).and_then(|fs| walk_bounded(&fs))
            }
        });
        if rw {
            fs::write(&work, &pristine).unwrap();
        } else {
            let f = OpenOptions::new().write(true).open(&work).unwrap();
            for (p, bytes) in &undo {
                f.write_all_at(bytes, *p).unwrap();
            }
        }
        match r {
            Ok(Ok(())) => outcomes[0] += 1,
            Ok(Err(e)) => {
                outcomes[1] += 1;
                let s = e.to_string();
                if matches!(
                    e,
                    butter::Error::Corrupt { .. } | butter::Error::BadChecksum { .. }
                ) {
                    assert!(
                        s.contains("log"),
                        "iteration {i}: error without a hint: {s}"
                    );
                }
                if outcomes[1] == 1 {
                    eprintln!("first refusal: {s}");
                }
            }
            Err(_) => {
                panic!("iteration {i}: a damaged log (block byte {off} ^ {v:#x}, rw {rw}) panicked")
            }
        }
    }
    outcomes[2] = iterations as usize;
    eprintln!(
        "damaged logs: {} replayed, {} refused with an error, of {}",
        outcomes[0], outcomes[1], outcomes[2]
    );
}

/// Reads every directory, inode, xattr and the first 64 KiB of every file (a damaged log can
/// give a file any size; reading all of it is not the point).
fn walk_bounded(fs: &Fs) -> butter::Result<()> {
    let mut stack = vec![fs.root_inode()];
    let mut seen = std::collections::HashSet::new();
    while let Some(dir) = stack.pop() {
        if !seen.insert(dir) || seen.len() > 10_000 {
            continue;
        }
        let mut after = 0;
        loop {
            let entries = fs.readdir(dir, after, 256)?;
            let Some(last) = entries.last() else { break };
            after = last.index;
            for e in &entries {
                let st = fs.stat(e.target)?;
                fs.xattrs(e.target)?;
                if st.is_dir() {
                    stack.push(e.target);
                } else if st.is_reg() {
                    fs.read(e.target, 0, 65536)?;
                } else if st.is_symlink() {
                    fs.readlink(e.target)?;
                }
            }
        }
    }
    Ok(())
}
