//! Rules the engine keeps by itself, tested without a mount:
//! - a file unlinked while open is an orphan; if the writer stops before closing it, the next
//!   read-write open deletes it and gives its space back (as the kernel does at mount);
//! - the gate lets readers run together and keeps them out of a change, from many threads.

use super::crash_support;

use butter::fs::Fs;
use butter::inode::namespace::Owner;
use butter::internals::RamDevice;
use butter::mkfs::Profile;
use crash_support::{butter_check, fresh_image};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

fn fresh(size: u64) -> Arc<RamDevice> {
    Arc::new(RamDevice::new(fresh_image(
        size,
        Profile::Dup,
        Profile::Single,
    )))
}

fn clean(dev: &RamDevice) {
    let fs = Fs::open_device(Arc::new(RamDevice::new(dev.durable_bytes()))).unwrap();
    butter_check(&fs).unwrap();
}

#[test]
fn orphans_left_by_a_stopped_writer_go_at_the_next_open() {
    let dev = fresh(256 << 20);
    let me = Owner { uid: 0, gid: 0 };
    let used_before;
    {
        let fs = Fs::open_device_rw(dev.clone()).unwrap();
        used_before = fs.statfs().unwrap().free;
        let f = fs.create(fs.root_inode(), b"big", 0o644, me).unwrap();
        fs.write(f, 0, &vec![7u8; 8 << 20]).unwrap();
        fs.hold(f);
        fs.unlink(fs.root_inode(), b"big").unwrap();
        fs.commit().unwrap();
        // The writer stops here with the file still open: it stays an orphan on disk.
        assert_eq!(fs.inode_item(f).unwrap().nlink, 0);
    }
    let fs = Fs::open_device_rw(dev.clone()).unwrap();
    let free = fs.statfs().unwrap().free;
    assert!(
        free + (1 << 20) >= used_before,
        "the orphan's 8 MiB did not come back: {free} bytes free, {used_before} before"
    );
    drop(fs);
    clean(&dev);
}

#[test]
fn readers_run_together_and_never_inside_a_change() {
    let dev = fresh(256 << 20);
    let fs = Arc::new(Fs::open_device_rw(dev.clone()).unwrap());
    let me = Owner { uid: 0, gid: 0 };
    let inside = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let (fs, inside) = (fs.clone(), inside.clone());
            std::thread::spawn(move || {
                for i in 0..50 {
                    if (i + t) % 3 == 0 {
                        let _g = fs.change_gate().unwrap();
                        assert_eq!(inside.swap(usize::MAX, Ordering::SeqCst), 0);
                        fs.create(fs.root_inode(), format!("f{t}-{i}").as_bytes(), 0o644, me)
                            .unwrap();
                        inside.store(0, Ordering::SeqCst);
                    } else {
                        let _g = fs.read_gate();
                        let n = inside.fetch_add(1, Ordering::SeqCst);
                        assert_ne!(n, usize::MAX, "a reader ran inside a change");
                        fs.readdir(fs.root_inode(), 0, usize::MAX).unwrap();
                        inside.fetch_sub(1, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    fs.gated_commit().unwrap();
    let names = fs.readdir(fs.root_inode(), 0, usize::MAX).unwrap();
    let made = (0..4usize)
        .map(|t| (0..50usize).filter(|i| (i + t) % 3 == 0).count())
        .sum::<usize>();
    assert_eq!(
        names.iter().filter(|e| e.name.starts_with(b"f")).count(),
        made
    );
    drop(fs);
    clean(&dev);
}

/// Writes through the write gate step out of it for their data I/O (crate::gate): under many
/// threads writing big and small, overwriting, appending, truncating, reading and committing
/// at once, every file ends with what the last change of it made (each file has one thread
/// changing it, as the model requires), and the image checks clean.
#[test]
fn data_writes_out_of_the_gate_keep_every_file_exact() {
    let dev = fresh(512 << 20);
    let fs = Arc::new(Fs::open_device_rw(dev.clone()).unwrap());
    let me = Owner { uid: 0, gid: 0 };
    fs.start_committer(std::time::Duration::from_millis(30))
        .unwrap();
    let writers: Vec<_> = (0..3u8)
        .map(|t| {
            let fs = fs.clone();
            std::thread::spawn(move || {
                let f = {
                    let _g = fs.change_gate().unwrap();
                    fs.create(fs.root_inode(), format!("w{t}").as_bytes(), 0o644, me)
                        .unwrap()
                };
                let mut model: Vec<u8> = Vec::new();
                let mut seed = u64::from(t) * 7919 + 1;
                for i in 0..60u32 {
                    seed = seed
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let pick = (seed >> 33) as usize;
                    if i % 17 == 16 {
                        let to = (pick % (model.len() + 1)) as u64;
                        let _g = fs.change_gate_on(f).unwrap();
                        fs.truncate(f, to).unwrap();
                        model.truncate(to as usize);
                        continue;
                    }
                    // Big (out-of-gate writeback) and small writes, overwrites and appends.
                    let len = if pick.is_multiple_of(3) {
                        4000 + pick % 9000
                    } else {
                        100_000 + pick % 700_000
                    };
                    let off = if pick.is_multiple_of(2) {
                        model.len()
                    } else {
                        pick % (model.len() + 1)
                    };
                    let byte = (i as u8).wrapping_mul(31).wrapping_add(t);
                    let data = vec![byte; len];
                    {
                        let _g = fs.write_gate(f).unwrap();
                        assert_eq!(fs.write(f, off as u64, &data).unwrap(), len);
                    }
                    if model.len() < off + len {
                        model.resize(off + len, 0);
                    }
                    model[off..off + len].copy_from_slice(&data);
                }
                (f, model)
            })
        })
        .collect();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let others = {
        let (fs, stop) = (fs.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                {
                    let _g = fs.change_gate().unwrap();
                    let f = fs
                        .create(fs.root_inode(), format!("small{n}").as_bytes(), 0o644, me)
                        .unwrap();
                    fs.write(f, 0, &[9u8; 4096]).unwrap();
                }
                let _r = fs.read_gate();
                for e in fs.readdir(fs.root_inode(), 0, usize::MAX).unwrap() {
                    let st = fs.stat(e.target).unwrap();
                    if e.name.starts_with(b"small") {
                        assert_eq!(fs.read(e.target, 0, 8192).unwrap(), vec![9u8; 4096]);
                    } else {
                        assert!(
                            fs.read(e.target, 0, 1 << 20).unwrap().len() as u64
                                <= st.size.max(1 << 20)
                        );
                    }
                }
                n += 1;
            }
            n
        })
    };
    let results: Vec<_> = writers.into_iter().map(|w| w.join().unwrap()).collect();
    stop.store(true, Ordering::SeqCst);
    assert!(others.join().unwrap() > 0);
    {
        let _r = fs.read_gate();
        for (f, model) in &results {
            assert_eq!(fs.inode_item(*f).unwrap().size, model.len() as u64);
            assert!(
                fs.read(*f, 0, model.len() + 1).unwrap() == *model,
                "inode {} differs",
                f.ino
            );
        }
    }
    let report = fs.close().unwrap();
    assert!(
        report.data_io_out_of_gate > 0,
        "no write stepped out of the gate"
    );
    drop(fs);
    clean(&dev);
    let after = Fs::open_device(Arc::new(RamDevice::new(dev.durable_bytes()))).unwrap();
    for (f, model) in &results {
        assert!(after.read(*f, 0, model.len() + 1).unwrap() == *model);
    }
}

/// A read of one file passes the gate without completing another file's pending writes
/// (`Fs::read_gate_on`); a read of the file that has them completes them first, and then
/// sees its data.
#[test]
fn reading_one_file_leaves_another_files_writes_pending() {
    let dev = fresh(256 << 20);
    let fs = Fs::open_device_rw(dev.clone()).unwrap();
    let me = Owner { uid: 0, gid: 0 };
    let (a, b) = {
        let _g = fs.change_gate().unwrap();
        let a = fs.create(fs.root_inode(), b"a", 0o644, me).unwrap();
        let b = fs.create(fs.root_inode(), b"b", 0o644, me).unwrap();
        fs.write(b, 0, &[1u8; 4096]).unwrap();
        (a, b)
    };
    fs.gated_commit().unwrap();
    {
        // An overwrite of an extent (no delayed allocation): pending when it returns.
        let _g = fs.write_gate(a).unwrap();
        fs.write(a, 0, &[2u8; 300_000]).unwrap();
        fs.write(a, 0, &[3u8; 300_000]).unwrap();
    }
    let pending = fs.core().ordered_stats().pending;
    assert!(pending > 0, "the writes left nothing pending");
    {
        let _r = fs.read_gate_on(b);
        assert_eq!(fs.read(b, 0, 8192).unwrap(), vec![1u8; 4096]);
        assert_eq!(fs.stat(b).unwrap().size, 4096);
    }
    assert_eq!(
        fs.core().ordered_stats().pending,
        pending,
        "reading b completed a's writes"
    );
    {
        let _r = fs.read_gate_on(a);
        assert_eq!(fs.core().ordered_stats().pending, 0);
        assert_eq!(fs.read(a, 0, 400_000).unwrap(), vec![3u8; 300_000]);
    }
    fs.close().unwrap();
    drop(fs);
    clean(&dev);
}

/// Completion is per file: with writes pending on two files (an overwrite's ordered extents
/// on one, a delayed-allocation buffer on the other), a read or stat of one, a release of a
/// handle and a create beside them complete none of the other file's; each file reads back
/// exactly, from another thread too, and the image checks clean after the commit.
#[test]
fn completion_of_one_files_writes_leaves_the_others_pending() {
    let dev = fresh(256 << 20);
    let fs = Arc::new(Fs::open_device_rw(dev.clone()).unwrap());
    let me = Owner { uid: 0, gid: 0 };
    let root = fs.root_inode();
    let (a, b) = {
        let _g = fs.change_gate().unwrap();
        let a = fs.create(root, b"a", 0o644, me).unwrap();
        let b = fs.create(root, b"b", 0o644, me).unwrap();
        fs.write(a, 0, &[1u8; 1 << 20]).unwrap();
        (a, b)
    };
    fs.gated_commit().unwrap();
    let pending_writes = |fs: &Fs| {
        {
            let _g = fs.write_gate(a).unwrap();
            fs.write(a, 0, &[2u8; 1 << 20]).unwrap();
        }
        let _g = fs.write_gate(b).unwrap();
        fs.write(b, 0, &[3u8; 8192]).unwrap();
    };
    pending_writes(&fs);
    assert!(fs.core().ordered.has_pending(a) && fs.core().ordered.has_pending(b));
    // A read and a stat of b complete b's buffer alone.
    std::thread::scope(|t| {
        t.spawn(|| {
            let _r = fs.read_gate_on(b);
            assert_eq!(fs.read(b, 0, 1 << 20).unwrap(), vec![3u8; 8192]);
            assert_eq!(fs.stat(b).unwrap().size, 8192);
        });
    });
    assert!(
        !fs.core().ordered.has_pending(b),
        "reading b left its writes pending"
    );
    assert!(
        fs.core().ordered.has_pending(a),
        "reading b completed a's writes"
    );
    // A release of b's handle and a create in the directory leave a's alone too.
    fs.hold(b);
    {
        let _g = fs.write_gate(b).unwrap();
        fs.write(b, 8192, &[4u8; 4096]).unwrap();
    }
    assert!(fs.core().ordered.has_pending(b));
    fs.release(b).unwrap();
    {
        let _g = fs.change_gate().unwrap();
        fs.create(root, b"c", 0o644, me).unwrap();
    }
    assert!(
        fs.core().ordered.has_pending(a) && fs.core().ordered.has_pending(b),
        "a release or a create completed other files' writes"
    );
    // Each file reads back exactly; the stat of a completes a's.
    {
        let _r = fs.read_gate_on(a);
        assert_eq!(fs.stat(a).unwrap().size, 1 << 20);
        assert_eq!(fs.read(a, 0, 2 << 20).unwrap(), vec![2u8; 1 << 20]);
    }
    assert!(!fs.core().ordered.has_pending(a));
    {
        let _r = fs.read_gate();
        let mut want = vec![3u8; 8192];
        want.extend_from_slice(&[4u8; 4096]);
        assert_eq!(fs.read(b, 0, 1 << 20).unwrap(), want);
    }
    fs.gated_commit().unwrap();
    fs.close().unwrap();
    drop(fs);
    clean(&dev);
}

/// `Fs::release`: closing one of two handles of an unlinked file keeps it; closing the last
/// deletes it under the gate.
#[test]
fn the_last_release_of_an_unlinked_file_deletes_it() {
    let dev = fresh(256 << 20);
    let fs = Fs::open_device_rw(dev.clone()).unwrap();
    let me = Owner { uid: 0, gid: 0 };
    let f = {
        let _g = fs.change_gate().unwrap();
        let f = fs.create(fs.root_inode(), b"open", 0o644, me).unwrap();
        fs.write(f, 0, &vec![5u8; 1 << 20]).unwrap();
        fs.hold(f);
        fs.hold(f);
        fs.unlink(fs.root_inode(), b"open").unwrap();
        f
    };
    fs.release(f).unwrap();
    {
        let _r = fs.read_gate_on(f);
        assert_eq!(fs.inode_item(f).unwrap().nlink, 0);
        assert_eq!(fs.read(f, 0, 8).unwrap(), vec![5u8; 8]);
    }
    fs.release(f).unwrap();
    {
        let _r = fs.read_gate();
        assert!(
            fs.inode_item(f).is_err(),
            "the unlinked file outlived its last handle"
        );
    }
    fs.close().unwrap();
    drop(fs);
    clean(&dev);
}

#[test]
fn the_commit_scheduler_and_close_make_changes_durable() {
    let dev = fresh(256 << 20);
    let fs = Arc::new(Fs::open_device_rw(dev.clone()).unwrap());
    let me = Owner { uid: 0, gid: 0 };
    fs.start_committer(std::time::Duration::from_millis(50))
        .unwrap();
    {
        let _g = fs.change_gate().unwrap();
        fs.create(fs.root_inode(), b"by-the-scheduler", 0o644, me)
            .unwrap();
    }
    // No commit call: the scheduler's commit puts it on the device.
    let on_disk = |name: &[u8]| {
        let seen = Fs::open_device(Arc::new(RamDevice::new(dev.durable_bytes()))).unwrap();
        seen.lookup(seen.root_inode(), name).unwrap().is_some()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !on_disk(b"by-the-scheduler") {
        assert!(
            std::time::Instant::now() < deadline,
            "no periodic commit within 10 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    {
        let _g = fs.change_gate().unwrap();
        let f = fs.create(fs.root_inode(), b"at-close", 0o644, me).unwrap();
        fs.write(f, 0, &vec![3u8; 300 << 10]).unwrap();
    }
    let report = fs.close().unwrap();
    assert!(
        report.ordered.started + report.ordered.delalloc_flushed >= 1,
        "the report does not count the write: {report:?}"
    );
    assert!(on_disk(b"at-close"), "close did not commit");
    drop(fs);
    clean(&dev);
}

#[test]
fn options_given_at_open_decide_what_fsync_writes() {
    let me = Owner { uid: 0, gid: 0 };
    for fsync_log in [true, false] {
        let dev = fresh(256 << 20);
        let opts = butter::fs::RwOptions {
            fsync_log,
            ..Default::default()
        };
        let fs = Fs::open_device_rw_with(dev.clone(), opts).unwrap();
        let f = fs.create(fs.root_inode(), b"f", 0o644, me).unwrap();
        fs.write(f, 0, &vec![1u8; 200 << 10]).unwrap();
        fs.gated_fsync(f).unwrap();
        let st = fs.core().log_stats().unwrap();
        if fsync_log {
            assert_eq!((st.logged, st.fallbacks), (1, 0), "{st:?}");
        } else {
            assert_eq!(st.logged, 0, "{st:?}");
        }
        // Either way the file is on the device now.
        let seen = Fs::open_device(Arc::new(RamDevice::new(dev.durable_bytes()))).unwrap();
        let found = seen
            .lookup(seen.root_inode(), b"f")
            .unwrap()
            .expect("fsynced file");
        assert_eq!(seen.stat(found.target).unwrap().size, 200 << 10);
        drop(fs);
        clean(&dev);
    }
}

#[test]
fn an_fsync_after_a_new_chunk_survives_a_power_cut() {
    // Data chunks are added as a file grows; a log naming an extent in a chunk that only the
    // next commit records would not replay. Every fsync here is followed by a power cut (the
    // durable bytes) and a replay that must show the file as fsynced.
    let dev = fresh(256 << 20);
    let fs = Fs::open_device_rw(dev.clone()).unwrap();
    let me = Owner { uid: 0, gid: 0 };
    let f = fs.create(fs.root_inode(), b"growing", 0o644, me).unwrap();
    fs.commit().unwrap();
    let chunk = vec![9u8; 1 << 20];
    let mut chunks_seen = std::collections::BTreeSet::new();
    for i in 0..24u64 {
        fs.write(f, i << 20, &chunk).unwrap();
        fs.gated_fsync(f).unwrap();
        let after_cut = Fs::open_device(Arc::new(RamDevice::new(dev.durable_bytes())))
            .unwrap_or_else(|e| panic!("after fsync {i}: the image does not open: {e}"));
        let found = after_cut
            .lookup(after_cut.root_inode(), b"growing")
            .unwrap()
            .expect("the file");
        assert_eq!(
            after_cut.stat(found.target).unwrap().size,
            (i + 1) << 20,
            "after fsync {i}"
        );
        chunks_seen.insert(after_cut.disk().chunk_map().chunks().count());
    }
    assert!(
        chunks_seen.len() > 1,
        "the workload never added a chunk: {chunks_seen:?}"
    );
    drop(fs);
    clean(&dev);
}
