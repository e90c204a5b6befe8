//! fsync "direction one": butter writes and fsyncs, the power is cut right after the fsync
//! returns, and butter's replay and the kernel's replay of that image agree.
//!
//! Each scenario (the list of issue 5, mirroring log_replay.rs): a fresh mkfs.btrfs image; the
//! setup runs on a `butter mount` (`-o commit=3600`, so no periodic commit interferes) that is
//! then unmounted, which commits it (some setups also run `butter subvolume create/snapshot`
//! on the unmounted image). A new `butter mount` runs the scenario's operations with real
//! fsync(2)/fdatasync(2) calls. Right after the last fsync returns, the expected state of every
//! fsynced path is taken from the FUSE mount itself and the image file is copied (sparse):
//! that copy is the power cut. butter is then killed with SIGKILL, so it writes nothing more.
//!
//! The crash image is copied twice. Copy A is mounted read-write by the kernel, which replays
//! any log; copy B is opened read-write by butter, which replays and commits. Then:
//! - butter's view of B equals the kernel's view of A ([`replay_compare_opts`]: everything a
//!   FUSE view can reproduce except ctime, which a replay that drops a name sets to its own
//!   time);
//! - every fsynced path shows, in both replays, what the FUSE mount showed when its fsync
//!   returned: kind, mode, owner, size, link count, mtime, xattrs, content, symlink target and,
//!   for directories, the entry names (not atime/ctime, which a replay may move);
//! - `btrfs check --readonly` passes on A (after the kernel's replay) and on B (after butter's),
//!   butter's checker (library and `butter check`) passes on B;
//! - the kernel's read-only view of B equals its view of A (inode numbers included).
//!
//! Each scenario prints whether the crash image had an fsync log (superblock log_root != 0).
//! Until butter's log writer lands, `Fs::fsync` commits, so no log is written: the scenarios
//! where the log writer must take the fast log path call [`assert_used_log`] only when
//! [`EXPECT_LOG_WRITER`] is true.
//!
//! Needs root, /dev/fuse, loop devices, kernel btrfs and btrfs-progs: fails without them.

mod common;

use common::fsync::*;
use common::fuse_mount::{self, ButterMount};
use common::kernel::{mkfs_btrfs, sh, ScratchDir};
use common::manifest::{self, CompareOpts, Entry, Manifest, TakeOpts};
use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// True once butter's fsync writes the log tree instead of committing: the log writer's merge
/// flips this, and then the fast-path scenarios must leave a log in the crash image.
const EXPECT_LOG_WRITER: bool = true;

/// No periodic commit during a scenario: only the fsyncs may make anything durable.
const MOUNT_ARGS: &[&str] = &["-o", "commit=3600,noatime"];

const IMAGE_SIZE: u64 = 256 << 20;

/// One step of a scenario's setup.
enum Step<'a> {
    /// Runs on the unmounted image (e.g. `butter subvolume create`).
    Image(&'a dyn Fn(&Path)),
    /// Runs on a fresh `butter mount`, which is then unmounted (committing everything).
    Mounted(&'a dyn Fn(&Path)),
}

/// The scenario's view of the mount during its operations: fsync helpers that remember
/// which paths were fsynced.
struct Ctx {
    root: PathBuf,
    synced: Mutex<BTreeSet<PathBuf>>,
}

impl Ctx {
    fn p(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    fn note(&self, rel: &str) {
        self.synced
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(PathBuf::from(rel));
    }

    /// fsync(2) of `rel` (file or directory).
    fn fsync(&self, rel: &str) {
        fsync_path(&self.p(rel));
        self.note(rel);
    }

    /// fdatasync(2) of `rel`.
    fn fdatasync(&self, rel: &str) {
        fdatasync_path(&self.p(rel));
        self.note(rel);
    }

    /// fsync(2) through an already open descriptor.
    fn fsync_file(&self, f: &File, rel: &str) {
        f.sync_all().unwrap_or_else(|e| panic!("fsync {rel}: {e}"));
        self.note(rel);
    }
}

struct Scenario<'a> {
    name: &'a str,
    setup: Vec<Step<'a>>,
    ops: &'a (dyn Fn(&Ctx) + Sync),
    /// A fast fsync through the log tree is expected (see [`EXPECT_LOG_WRITER`]).
    fast_log: bool,
}

/// Asserts that the crash image has an fsync log: the fsyncs of `scenario` went through the
/// log tree rather than a transaction commit.
fn assert_used_log(img: &Path, scenario: &str) {
    assert_ne!(
        log_root_of(img),
        0,
        "{scenario}: the crash image has no fsync log: butter committed instead of logging"
    );
}

/// What must match between the FUSE view at fsync time and a replay, for an fsynced path.
fn synced_opts() -> CompareOpts {
    CompareOpts {
        atime: false,
        ctime: false,
        btime: false,
        dir_nlink: false,
        hardlinks: false,
        inode_numbers: false,
        subvolumes: false,
        ..CompareOpts::all()
    }
}

/// The attributes of one path on the FUSE mount.
fn fuse_entry(root: &Path, rel: &Path) -> Entry {
    let m = manifest::take(&root.join(rel), &TakeOpts::default());
    let e = m
        .entries
        .get(Path::new(""))
        .unwrap_or_else(|| panic!("FUSE view of {}: nothing", rel.display()))
        .clone();
    assert!(
        e.errors.is_empty(),
        "FUSE view of {}: {:?}",
        rel.display(),
        e.errors
    );
    e
}

/// `rel`'s entry alone, as a manifest for [`manifest::diff`].
fn single(root: &str, rel: &Path, e: Entry) -> Manifest {
    Manifest {
        root: PathBuf::from(root),
        entries: BTreeMap::from([(rel.to_path_buf(), e)]),
        skipped_mounts: Vec::new(),
    }
}

/// Every fsynced path in `replayed` shows what the FUSE mount showed.
fn check_synced(expected: &BTreeMap<PathBuf, Entry>, replayed: &Manifest, what: &str) {
    let mut problems = Vec::new();
    for (rel, want) in expected {
        match replayed.entries.get(rel) {
            None => problems.push(format!("{}: fsynced, but missing", rel.display())),
            Some(got) => problems.extend(manifest::diff(
                &single("fuse-at-fsync", rel, want.clone()),
                &single(what, rel, got.clone()),
                &synced_opts(),
            )),
        }
    }
    assert!(
        problems.is_empty(),
        "{what}: fsynced paths differ from the FUSE mount at fsync time (A = FUSE, B = \
         replay):\n{}",
        problems.join("\n")
    );
}

fn run(s: Scenario) {
    run_on(s, &[]);
}

/// [`run`] on an image mkfs.btrfs makes with `mkfs_args`.
fn run_on(s: Scenario, mkfs_args: &[&str]) {
    run_on_with(s, mkfs_args, MOUNT_ARGS);
}

/// [`run_on`] with the scenario's operations served by a mount with `ops_args` (the setup
/// mounts keep [`MOUNT_ARGS`]).
fn run_on_with(s: Scenario, mkfs_args: &[&str], ops_args: &[&str]) {
    let name = s.name;
    require_or_fail(&format!("fsync_matrix {name}"), true);
    let scratch = ScratchDir::new(&format!("fsync-matrix-{name}"));
    let img = scratch.join("img");
    mkfs_btrfs(&img, IMAGE_SIZE, mkfs_args);
    let mnt = scratch.dir("bmnt");
    for (i, step) in s.setup.iter().enumerate() {
        match step {
            Step::Image(f) => f(&img),
            Step::Mounted(f) => {
                let bm = ButterMount::start(
                    &img,
                    &mnt,
                    MOUNT_ARGS,
                    &scratch.join(format!("setup-{i}.log")),
                );
                f(bm.path());
                bm.unmount();
            }
        }
    }
    // The operations; then the power cut right after the last fsync.
    let crash = scratch.join("crash.img");
    let expected = {
        let bm = ButterMount::start(&img, &mnt, ops_args, &scratch.join("ops.log"));
        let ctx = Ctx {
            root: bm.path().to_path_buf(),
            synced: Mutex::new(BTreeSet::new()),
        };
        (s.ops)(&ctx);
        let synced = ctx.synced.into_inner().unwrap_or_else(|e| e.into_inner());
        assert!(!synced.is_empty(), "{name}: the scenario fsynced nothing");
        let expected: BTreeMap<PathBuf, Entry> = synced
            .iter()
            .map(|rel| (rel.clone(), fuse_entry(bm.path(), rel)))
            .collect();
        copy_sparse(&img, &crash);
        bm.kill9();
        expected
    };
    let log_root = log_root_of(&crash);
    eprintln!(
        "fsync_matrix {name}: crash image log_root {log_root} ({}), {} fsynced path(s)",
        if log_root != 0 {
            "an fsync log"
        } else {
            "no log: everything committed"
        },
        expected.len()
    );
    if s.fast_log && EXPECT_LOG_WRITER {
        assert_used_log(&crash, name);
    }

    let a = scratch.join("a.img");
    let b = scratch.join("b.img");
    copy_sparse(&crash, &a);
    copy_sparse(&crash, &b);
    // The kernel replays copy A.
    let want = kernel_manifest(&a, &scratch.dir("ma"), "noatime");
    let errors = want.errors();
    assert!(
        errors.is_empty(),
        "{name}: reading the kernel's replay failed:\n{}",
        errors.join("\n")
    );
    assert_btrfs_check(&a, &format!("{name}: after the kernel's replay"));
    check_synced(&expected, &want, &format!("{name}: kernel replay"));
    // butter replays copy B.
    let got = butter_replay_manifest(&b, name);
    manifest::assert_same(
        &want,
        &got,
        &replay_compare_opts(),
        &format!("{name}: kernel replay (A) vs butter replay (B)"),
    );
    check_synced(&expected, &got, &format!("{name}: butter replay"));
    assert_btrfs_check(&b, &format!("{name}: after butter's replay"));
    assert_butter_check_lib(&b, &format!("{name}: after butter's replay"));
    let (rc, out) = fuse_mount::butter_check(&b);
    assert_eq!(rc, 0, "{name}: butter check after butter's replay:\n{out}");
    // The kernel sees on B what it replayed on A.
    let kb = kernel_manifest(&b, &scratch.dir("mb"), "ro,noatime");
    manifest::assert_same(
        &want,
        &kb,
        &kernel_views_compare_opts(),
        &format!("{name}: kernel view of A vs kernel view of B after butter's replay"),
    );
}

// ---------------------------------------------------------------------------------------------
// Scenarios

#[test]
fn new_file() {
    run(Scenario {
        name: "new-file",
        setup: vec![Step::Mounted(&|m| {
            fs::create_dir(m.join("d")).unwrap();
            write_file(&m.join("d/old"), 100, 1);
        })],
        ops: &|c| {
            write_file(&c.p("d/new"), 20000, 2);
            write_file(&c.p("d/small"), 300, 3);
            c.fsync("d/new");
            c.fsync("d/small");
        },
        fast_log: true,
    });
}

#[test]
fn append() {
    run(Scenario {
        name: "append",
        setup: vec![Step::Mounted(&|m| write_file(&m.join("f"), 10000, 4))],
        ops: &|c| {
            let mut f = OpenOptions::new().append(true).open(c.p("f")).unwrap();
            f.write_all(&pattern(50000, 5)).unwrap();
            c.fsync_file(&f, "f");
        },
        fast_log: true,
    });
}

#[test]
fn overwrite_middle() {
    run(Scenario {
        name: "overwrite",
        setup: vec![Step::Mounted(&|m| write_file(&m.join("f"), 120 << 10, 6))],
        ops: &|c| {
            let f = open_rw(&c.p("f"));
            f.write_all_at(&pattern(8192, 7), 65536).unwrap();
            f.write_all_at(&pattern(100, 8), 100000).unwrap();
            c.fsync_file(&f, "f");
        },
        fast_log: true,
    });
}

/// fdatasync(2): data and size of an append and an overwrite.
#[test]
fn fdatasync_append_overwrite() {
    run(Scenario {
        name: "fdatasync",
        setup: vec![Step::Mounted(&|m| {
            write_file(&m.join("f"), 30000, 60);
            write_file(&m.join("g"), 5000, 61);
        })],
        ops: &|c| {
            let f = open_rw(&c.p("f"));
            f.write_all_at(&pattern(12000, 62), 4096).unwrap();
            f.sync_data().unwrap();
            c.note("f");
            let mut g = OpenOptions::new().append(true).open(c.p("g")).unwrap();
            g.write_all(&pattern(70000, 63)).unwrap();
            drop(g);
            c.fdatasync("g");
        },
        fast_log: true,
    });
}

#[test]
fn punch_hole() {
    run(Scenario {
        name: "punch",
        setup: vec![Step::Mounted(&|m| write_file(&m.join("f"), 120 << 10, 9))],
        ops: &|c| {
            let f = open_rw(&c.p("f"));
            fallocate(
                &f,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                16384,
                65536,
            );
            c.fsync_file(&f, "f");
        },
        fast_log: true,
    });
}

#[test]
fn truncate_down() {
    run(Scenario {
        name: "truncdown",
        setup: vec![Step::Mounted(&|m| {
            write_file(&m.join("f"), 120 << 10, 10);
            write_file(&m.join("g"), 120 << 10, 11);
        })],
        ops: &|c| {
            let f = open_rw(&c.p("f"));
            f.set_len(5000).unwrap();
            c.fsync_file(&f, "f");
            let g = open_rw(&c.p("g"));
            g.set_len(70000).unwrap();
            c.fsync_file(&g, "g");
        },
        fast_log: true,
    });
}

#[test]
fn truncate_up() {
    run(Scenario {
        name: "truncup",
        setup: vec![Step::Mounted(&|m| write_file(&m.join("f"), 10000, 12))],
        ops: &|c| {
            let f = open_rw(&c.p("f"));
            f.set_len(300000).unwrap();
            c.fsync_file(&f, "f");
        },
        fast_log: true,
    });
}

#[test]
fn prealloc() {
    run(Scenario {
        name: "prealloc",
        setup: vec![Step::Mounted(&|m| write_file(&m.join("g"), 8192, 13))],
        ops: &|c| {
            let f = File::create(c.p("f")).unwrap();
            fallocate(&f, 0, 0, 1 << 20);
            f.write_all_at(&pattern(4096, 14), 8192).unwrap();
            c.fsync_file(&f, "f");
            let g = open_rw(&c.p("g"));
            fallocate(&g, libc::FALLOC_FL_KEEP_SIZE, 8192, 65536);
            c.fsync_file(&g, "g");
        },
        fast_log: true,
    });
}

#[test]
fn rename_fsync_file() {
    run(Scenario {
        name: "rename-file",
        setup: vec![Step::Mounted(&|m| {
            fs::create_dir(m.join("d")).unwrap();
            fs::create_dir(m.join("e")).unwrap();
            write_file(&m.join("d/a"), 5000, 15);
            write_file(&m.join("d/b"), 5000, 16);
        })],
        ops: &|c| {
            fs::rename(c.p("d/a"), c.p("d/a2")).unwrap();
            c.fsync("d/a2");
            fs::rename(c.p("d/b"), c.p("e/b")).unwrap();
            c.fsync("e/b");
        },
        fast_log: true,
    });
}

#[test]
fn rename_fsync_dir() {
    run(Scenario {
        name: "rename-dir",
        setup: vec![Step::Mounted(&|m| {
            fs::create_dir(m.join("d")).unwrap();
            fs::create_dir(m.join("e")).unwrap();
            write_file(&m.join("d/a"), 5000, 17);
            write_file(&m.join("d/c"), 50, 18);
        })],
        ops: &|c| {
            fs::rename(c.p("d/a"), c.p("e/a")).unwrap();
            c.fsync("e");
            c.fsync("d");
        },
        fast_log: true,
    });
}

#[test]
fn rename_in_dir_fsync_dir() {
    run(Scenario {
        name: "rename-in-dir",
        setup: vec![Step::Mounted(&|m| {
            fs::create_dir(m.join("d")).unwrap();
            write_file(&m.join("d/a"), 5000, 17);
            write_file(&m.join("d/c"), 50, 18);
        })],
        ops: &|c| {
            fs::rename(c.p("d/c"), c.p("d/c2")).unwrap();
            fs::rename(c.p("d/a"), c.p("d/z")).unwrap();
            c.fsync("d");
        },
        fast_log: true,
    });
}

#[test]
fn rename_over_existing() {
    run(Scenario {
        name: "rename-over",
        setup: vec![Step::Mounted(&|m| {
            fs::create_dir(m.join("d")).unwrap();
            write_file(&m.join("d/a"), 5000, 45);
            write_file(&m.join("d/b"), 7000, 46);
        })],
        ops: &|c| {
            fs::rename(c.p("d/a"), c.p("d/b")).unwrap();
            c.fsync("d/b");
        },
        fast_log: true,
    });
}

/// A file renamed over a file in another directory: its fsync logs both directories whole
/// (replay drops the replaced file's entry before adding the new one).
#[test]
fn rename_over_across_directories() {
    run(Scenario {
        name: "rename-over-across",
        setup: vec![Step::Mounted(&|m| {
            fs::create_dir(m.join("d")).unwrap();
            fs::create_dir(m.join("e")).unwrap();
            write_file(&m.join("d/a"), 9000, 60);
            write_file(&m.join("e/b"), 3000, 61);
            write_file(&m.join("e/keep"), 200, 62);
        })],
        ops: &|c| {
            fs::rename(c.p("d/a"), c.p("e/b")).unwrap();
            c.fsync("e/b");
        },
        fast_log: true,
    });
}

/// The replaced file lives on under another name: it is logged with its names.
#[test]
fn rename_over_a_linked_file() {
    run(Scenario {
        name: "rename-over-linked",
        setup: vec![Step::Mounted(&|m| {
            fs::create_dir(m.join("d")).unwrap();
            fs::create_dir(m.join("f")).unwrap();
            write_file(&m.join("d/a"), 4000, 63);
            write_file(&m.join("d/b"), 6000, 64);
            fs::hard_link(m.join("d/b"), m.join("f/c")).unwrap();
        })],
        ops: &|c| {
            fs::rename(c.p("d/a"), c.p("d/b")).unwrap();
            c.fsync("d/b");
            c.note("f/c");
        },
        fast_log: true,
    });
}

/// The atomic replace, within one directory and from another: write a temporary file, fsync
/// it, rename it over the target, fsync the target's directory. The new contents must survive.
#[test]
fn atomic_replace_fsync_dir() {
    run(Scenario {
        name: "atomic-replace",
        setup: vec![Step::Mounted(&|m| {
            fs::create_dir(m.join("d")).unwrap();
            fs::create_dir(m.join("tmp")).unwrap();
            write_file(&m.join("d/config"), 5000, 65);
            write_file(&m.join("d/state"), 9000, 68);
            write_file(&m.join("d/other"), 700, 66);
        })],
        ops: &|c| {
            write_file(&c.p("d/config.tmp"), 5500, 67);
            // Not a path to compare: it is renamed away before the power cut.
            fsync_path(&c.p("d/config.tmp"));
            fs::rename(c.p("d/config.tmp"), c.p("d/config")).unwrap();
            write_file(&c.p("tmp/state"), 12000, 69);
            fsync_path(&c.p("tmp/state"));
            fs::rename(c.p("tmp/state"), c.p("d/state")).unwrap();
            c.fsync("d");
            c.note("d/config");
            c.note("d/state");
        },
        fast_log: true,
    });
}

#[test]
fn link_fsync() {
    run(Scenario {
        name: "link",
        setup: vec![Step::Mounted(&|m| {
            fs::create_dir(m.join("d")).unwrap();
            write_file(&m.join("d/a"), 3000, 19);
        })],
        ops: &|c| {
            fs::hard_link(c.p("d/a"), c.p("d/b")).unwrap();
            fs::hard_link(c.p("d/a"), c.p("c")).unwrap();
            c.fsync("d/a");
        },
        fast_log: true,
    });
}

/// A file loses names (its other names stay): its fsync logs the directories it lost them in.
#[test]
fn unlink_link_fsync_file() {
    run(Scenario {
        name: "unlink-link",
        setup: vec![Step::Mounted(&|m| {
            fs::create_dir(m.join("d")).unwrap();
            fs::create_dir(m.join("e")).unwrap();
            write_file(&m.join("d/a"), 6000, 47);
            write_file(&m.join("d/keep"), 100, 48);
            fs::hard_link(m.join("d/a"), m.join("d/b")).unwrap();
            fs::hard_link(m.join("d/a"), m.join("e/c")).unwrap();
        })],
        ops: &|c| {
            fs::remove_file(c.p("d/b")).unwrap();
            c.fsync("d/a");
            fs::remove_file(c.p("e/c")).unwrap();
            write_file(&c.p("e/new"), 200, 49);
            c.fsync("d/a");
        },
        fast_log: true,
    });
}

#[test]
fn unlink_fsync_dir() {
    run(Scenario {
        name: "unlink",
        setup: vec![Step::Mounted(&|m| {
            fs::create_dir(m.join("d")).unwrap();
            for i in 0..5 {
                write_file(&m.join(format!("d/f{i}")), 1000 * (i + 1), 20 + i as u8);
            }
            fs::hard_link(m.join("d/f3"), m.join("f3link")).unwrap();
        })],
        ops: &|c| {
            fs::remove_file(c.p("d/f1")).unwrap();
            fs::remove_file(c.p("d/f3")).unwrap();
            c.fsync("d");
            // The other link of f3 lost one name: its link count is fsynced too.
            c.fsync("f3link");
        },
        fast_log: true,
    });
}

#[test]
fn dir_create_delete() {
    run(Scenario {
        name: "dir-churn",
        setup: vec![Step::Mounted(&|m| {
            fs::create_dir(m.join("d")).unwrap();
            write_file(&m.join("d/x"), 100, 30);
            write_file(&m.join("d/y"), 9000, 31);
        })],
        ops: &|c| {
            write_file(&c.p("d/n1"), 100, 32);
            write_file(&c.p("d/n2"), 7000, 33);
            fs::create_dir(c.p("d/sub")).unwrap();
            write_file(&c.p("d/sub/z"), 10, 34);
            fs::create_dir(c.p("d/sub/deeper")).unwrap();
            write_file(&c.p("d/sub/deeper/w"), 70_000, 35);
            fs::create_dir(c.p("d/sub/deeper/empty")).unwrap();
            std::os::unix::fs::symlink("n2", c.p("d/ln")).unwrap();
            fs::remove_file(c.p("d/x")).unwrap();
            fs::remove_file(c.p("d/n1")).unwrap();
            // New subdirectories are logged with the directory, recursively.
            c.fsync("d");
        },
        fast_log: true,
    });
}

/// The highest index of a directory is unlinked, then a new file created there and fsynced:
/// the new file must not get the unlinked entry's index, which the crash image (the unlink
/// not durable) still gives the old one (the kernel's replay failed with EEXIST when it did).
#[test]
fn unlink_then_create_fsync_file() {
    run(Scenario {
        name: "unlink-create",
        setup: vec![Step::Mounted(&|m| {
            fs::create_dir(m.join("d")).unwrap();
            for (i, n) in ["a", "b", "c"].iter().enumerate() {
                write_file(&m.join("d").join(n), 3000, 50 + i as u8);
            }
        })],
        ops: &|c| {
            fs::remove_file(c.p("d/c")).unwrap();
            write_file(&c.p("d/n"), 5000, 53);
            c.fsync("d/n");
        },
        fast_log: true,
    });
}

/// A name unlinked and given to a new file, and another to a new link, in one transaction:
/// the directory is logged whole with them (replay drops the old files' entries first).
#[test]
fn unlink_then_reuse_the_name() {
    run(Scenario {
        name: "unlink-reuse",
        setup: vec![Step::Mounted(&|m| {
            fs::create_dir(m.join("d")).unwrap();
            for (i, n) in ["a", "b", "c"].iter().enumerate() {
                write_file(&m.join("d").join(n), 4000, 70 + i as u8);
            }
        })],
        ops: &|c| {
            fs::remove_file(c.p("d/b")).unwrap();
            write_file(&c.p("d/b"), 6000, 73);
            c.fsync("d/b");
            fs::remove_file(c.p("d/c")).unwrap();
            fs::hard_link(c.p("d/a"), c.p("d/c")).unwrap();
            c.fsync("d/a");
            c.note("d/c");
        },
        fast_log: true,
    });
}

/// Two files in two directories swap names (RENAME_EXCHANGE): the fsync of one logs both
/// files and both directories.
#[test]
fn exchange_fsync_file() {
    run(Scenario {
        name: "exchange",
        setup: vec![Step::Mounted(&|m| {
            fs::create_dir(m.join("d")).unwrap();
            fs::create_dir(m.join("e")).unwrap();
            write_file(&m.join("d/a"), 5000, 74);
            write_file(&m.join("e/b"), 9000, 75);
            write_file(&m.join("e/keep"), 300, 76);
        })],
        ops: &|c| {
            exchange(&c.p("d/a"), &c.p("e/b"));
            c.fsync("d/a");
            c.note("e/b");
        },
        fast_log: true,
    });
}

#[test]
fn rmdir_fsync_parent() {
    run(Scenario {
        name: "rmdir",
        setup: vec![Step::Mounted(&|m| {
            fs::create_dir_all(m.join("d/sub")).unwrap();
            fs::create_dir_all(m.join("d/keep")).unwrap();
            write_file(&m.join("d/keep/f"), 100, 43);
        })],
        ops: &|c| {
            fs::remove_dir(c.p("d/sub")).unwrap();
            write_file(&c.p("d/new"), 100, 44);
            c.fsync("d/new");
            c.fsync("d");
        },
        fast_log: true,
    });
}

#[test]
fn xattrs() {
    run(Scenario {
        name: "xattr",
        setup: vec![Step::Mounted(&|m| {
            write_file(&m.join("f"), 100, 35);
            setxattr(&m.join("f"), "user.a", b"one");
            setxattr(&m.join("f"), "user.b", b"two");
        })],
        ops: &|c| {
            setxattr(&c.p("f"), "user.c", b"three");
            setxattr(&c.p("f"), "user.b", b"changed");
            removexattr(&c.p("f"), "user.a");
            c.fsync("f");
        },
        fast_log: true,
    });
}

/// The second fsync of an inode in one transaction (only what changed since the first needs
/// logging); xattrs that were not changed must survive.
#[test]
fn repeated_fsync() {
    run(Scenario {
        name: "repeated",
        setup: vec![Step::Mounted(&|m| {
            write_file(&m.join("f"), 6000, 53);
            setxattr(&m.join("f"), "user.keep", b"kept");
        })],
        ops: &|c| {
            let mut f = OpenOptions::new().append(true).open(c.p("f")).unwrap();
            f.write_all(&pattern(9000, 54)).unwrap();
            c.fsync_file(&f, "f");
            f.write_all(&pattern(5000, 55)).unwrap();
            c.fsync_file(&f, "f");
            let g = open_rw(&c.p("f"));
            g.write_all_at(&pattern(100, 56), 10).unwrap();
            c.fsync_file(&g, "f");
        },
        fast_log: true,
    });
}

fn butter_cli(args: &[&std::ffi::OsStr]) {
    sh(fuse_mount::BUTTER, args);
}

/// A file in a subvolume and one in a snapshot of it (made with `butter subvolume create` and
/// `butter subvolume snapshot` on the unmounted image): their fsyncs go to those subvolumes'
/// logs.
#[test]
fn subvolume_and_snapshot() {
    run(Scenario {
        name: "subvol",
        setup: vec![
            Step::Image(&|img| {
                butter_cli(&[
                    "subvolume".as_ref(),
                    "create".as_ref(),
                    img.as_os_str(),
                    "/sv".as_ref(),
                ])
            }),
            Step::Mounted(&|m| write_file(&m.join("sv/f"), 20000, 36)),
            Step::Image(&|img| {
                butter_cli(&[
                    "subvolume".as_ref(),
                    "snapshot".as_ref(),
                    img.as_os_str(),
                    "/sv".as_ref(),
                    "/snap".as_ref(),
                ])
            }),
        ],
        ops: &|c| {
            let mut f = OpenOptions::new().append(true).open(c.p("snap/f")).unwrap();
            f.write_all(&pattern(9000, 37)).unwrap();
            c.fsync_file(&f, "snap/f");
            write_file(&c.p("sv/g"), 5000, 38);
            c.fsync("sv/g");
        },
        fast_log: true,
    });
}

/// Many files written and fsynced at once by several threads (concurrent fsyncs of different
/// files may share one log commit).
#[test]
fn many_files_concurrently() {
    many_files("many", &[], MOUNT_ARGS);
}

/// The same on a block-group-tree image (mkfs.btrfs's default since 6.19): the log commit and
/// the kernel's replay meet block group items in tree 11.
#[test]
fn many_files_concurrently_block_group_tree() {
    many_files("many-bgt", &["-O", "block-group-tree"], MOUNT_ARGS);
}

/// The same served through FUSE over io_uring: every fsync goes from a queue's thread to a
/// helper and back, five threads' fsyncs at once.
#[test]
fn many_files_concurrently_over_io_uring() {
    many_files(
        "many-uring",
        &[],
        &["-o", "commit=3600,noatime", "-o", "uring=on"],
    );
}

/// Over FUSE over io_uring, writes of 128 KiB and more (served by helpers, as fsyncs are)
/// between small ones, appends and overwrites, fsynced and fdatasynced.
#[test]
fn large_writes_over_io_uring() {
    run_on_with(
        Scenario {
            name: "large-uring",
            setup: vec![Step::Mounted(&|m| write_file(&m.join("f"), 300 << 10, 11))],
            ops: &|c| {
                let f = open_rw(&c.p("f"));
                f.write_all_at(&pattern(256 << 10, 12), 64 << 10).unwrap();
                f.write_all_at(&pattern(100, 13), 10).unwrap();
                f.write_all_at(&pattern(1 << 20, 14), 300 << 10).unwrap();
                c.fdatasync("f");
                write_file(&c.p("g"), 700 << 10, 15);
                let g = open_rw(&c.p("g"));
                g.write_all_at(&pattern(200 << 10, 16), 4096).unwrap();
                c.fsync_file(&g, "g");
                c.fsync("f");
            },
            fast_log: true,
        },
        &[],
        &["-o", "commit=3600,noatime", "-o", "uring=on"],
    );
}

fn many_files(name: &str, mkfs_args: &[&str], ops_args: &[&str]) {
    const THREADS: usize = 4;
    const FILES: usize = 40;
    run_on_with(
        Scenario {
            name,
            setup: vec![Step::Mounted(&|m| {
                fs::create_dir(m.join("d")).unwrap();
                fs::create_dir(m.join("e")).unwrap();
                write_file(&m.join("e/old"), 70000, 99);
            })],
            ops: &|c| {
                std::thread::scope(|s| {
                    for t in 0..THREADS {
                        s.spawn(move || {
                            for i in 0..FILES {
                                let rel = format!("d/t{t}-file-with-a-longer-name-{i:03}");
                                let n = (t * FILES + i) as u8;
                                write_file(&c.p(&rel), 300 + (t * FILES + i) * 531, n);
                                if i % 3 == 0 {
                                    c.fdatasync(&rel);
                                } else {
                                    c.fsync(&rel);
                                }
                            }
                        });
                    }
                    // Meanwhile, overwrites of one older file, fsynced each time.
                    s.spawn(|| {
                        let f = open_rw(&c.p("e/old"));
                        for i in 0..20u64 {
                            f.write_all_at(&pattern(3000, i as u8), i * 3000).unwrap();
                            c.fsync_file(&f, "e/old");
                        }
                    });
                });
            },
            fast_log: true,
        },
        mkfs_args,
        ops_args,
    );
}
