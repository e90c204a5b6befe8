//! Crash consistency of the commit on filesystems of several devices: a two-device RAID1 and
//! a three-device RAID5, made by mkfs.btrfs, each device a RAM device.
//!
//! One power cut stops every device at once. The devices' writes and flushes are traced in
//! the one order they were issued; a flush makes durable only its own device's earlier
//! writes. For every cut point over the commit's writes (and a sample of the data writes
//! before it), three sets of images are checked: only each device's flushed writes survived
//! ("durable"), every issued write survived ("live"), and a random subset of each device's
//! unflushed writes survived ("torn"). Each set must open with every device and show exactly
//! the state before the commit (A) or after it (B): B once the primary superblock of B is on
//! some device (the newest superblock wins at open, as in the kernel), and butter's checker
//! must be clean.
//!
//! The RAID5 write hole: a cut between a data block and its parity leaves that row's parity
//! stale. With every device there nothing reads the parity, so each cut must still show A or
//! B; a device lost before a scrub rewrites the parity would rebuild the row's other blocks
//! wrongly (their checksums then fail the read). The kernel has the same hole.
//!
//! Needs mkfs.btrfs (btrfs-progs): without it the tests print a notice and pass, unless `CI`
//! is set (then they fail).

use super::crash_support::*;
use butter::error::Error;
use butter::fs::{Fs, Inode, OpenOpts};
use butter::internals::RamDevice;
use butter::io::device::BlockDevice;
use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Mutex};

const DEV_SIZE: u64 = 160 * MIB;
const PRIMARY_SB: u64 = 64 * 1024;
const OWNER: butter::fs::Owner = butter::fs::Owner { uid: 0, gid: 0 };

/// Each device's pages that differ from its base image.
type Pages = HashMap<u64, Vec<u8>>;

/// One device's writes and flushes in the order every device's were issued.
type Trace = Arc<Mutex<Vec<(usize, Op)>>>;

struct Member {
    idx: usize,
    inner: Arc<dyn BlockDevice>,
    trace: Trace,
}

impl BlockDevice for Member {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.inner.write_at(buf, offset)?;
        self.trace.lock().unwrap().push((
            self.idx,
            Op::Write {
                offset,
                data: buf.to_vec(),
            },
        ));
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        self.inner.flush()?;
        self.trace.lock().unwrap().push((self.idx, Op::Flush));
        Ok(())
    }
    fn len(&self) -> u64 {
        self.inner.len()
    }
}

/// mkfs.btrfs over `n` devices with `profile` for data and metadata: each device's bytes.
fn mkfs_btrfs(n: usize, profile: &str) -> Option<Vec<Vec<u8>>> {
    if !have_btrfs_progs() {
        assert!(
            std::env::var_os("CI").is_none(),
            "mkfs.btrfs is not installed (CI is set: this is an error, not a skip)"
        );
        eprintln!("SKIPPED: mkfs.btrfs is not installed");
        return None;
    }
    let dir = tmp_dir();
    let paths: Vec<_> = (0..n)
        .map(|i| dir.join(format!("multi-{profile}-{i}-{}.img", std::process::id())))
        .collect();
    for p in &paths {
        let f = std::fs::File::create(p).unwrap();
        f.set_len(DEV_SIZE).unwrap();
    }
    let out = std::process::Command::new("mkfs.btrfs")
        .args(["-f", "-q", "-d", profile, "-m", profile])
        .args(&paths)
        .output()
        .expect("running mkfs.btrfs");
    assert!(
        out.status.success(),
        "mkfs.btrfs: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let imgs = paths.iter().map(|p| std::fs::read(p).unwrap()).collect();
    for p in &paths {
        let _ = std::fs::remove_file(p);
    }
    Some(imgs)
}

fn open_set(devs: &[Arc<dyn BlockDevice>], rw: bool) -> Result<Fs, Error> {
    let given = devs
        .iter()
        .enumerate()
        .map(|(i, d)| (format!("device {i}"), d.clone()))
        .collect();
    if rw {
        Fs::open_device_set_rw_with(given, Default::default())
    } else {
        Fs::open_device_set(given, OpenOpts::default())
    }
}

fn file(fs: &Fs, dir: Inode, name: &str, seed: u64, len: usize) -> Result<Inode, Error> {
    let ino = fs.create(dir, name.as_bytes(), 0o644, OWNER)?;
    fs.write(ino, 0, &content(seed, len))?;
    Ok(ino)
}

fn populate(fs: &Fs) -> Result<(), Error> {
    let root = fs.root_inode();
    for d in 0..4u64 {
        let dir = fs.mkdir(root, format!("d{d}").as_bytes(), 0o755, OWNER)?;
        for i in 0..30u64 {
            file(
                fs,
                dir,
                &format!("f{i}"),
                d * 100 + i,
                100 + (i as usize * 997) % 150_000,
            )?;
        }
    }
    Ok(())
}

/// The change set A -> B: new small and large files, overwrites, deletes, a rename.
fn change(fs: &Fs) -> Result<(), Error> {
    let root = fs.root_inode();
    let new = fs.mkdir(root, b"new", 0o755, OWNER)?;
    for i in 0..300u64 {
        file(
            fs,
            new,
            &format!("n{i}"),
            5000 + i,
            300 + (i as usize * 37) % 3000,
        )?;
    }
    file(fs, root, "big", 77, 3 << 20)?;
    let d1 = fs.lookup(root, b"d1")?.expect("d1").target;
    for i in 0..10u64 {
        let ino = fs
            .lookup(d1, format!("f{i}").as_bytes())?
            .expect("f")
            .target;
        fs.write(ino, 5000, &content(9000 + i, 70_000))?;
    }
    let d2 = fs.lookup(root, b"d2")?.expect("d2").target;
    for i in 0..30 {
        fs.unlink(d2, format!("f{i}").as_bytes())?;
    }
    fs.rmdir(root, b"d2")?;
    fs.rename(root, b"d3", new, b"d3moved", 0)?;
    Ok(())
}

struct Run {
    bases: Vec<Arc<Vec<u8>>>,
    man_a: Manifest,
    man_b: Manifest,
    ops: Vec<(usize, Op)>,
    commit_first_write: usize,
}

fn run(n: usize, profile: &str) -> Option<Run> {
    fixed_time();
    let imgs = mkfs_btrfs(n, profile)?;
    let rams: Vec<Arc<RamDevice>> = imgs
        .into_iter()
        .map(|b| Arc::new(RamDevice::new(b)))
        .collect();
    let devs: Vec<Arc<dyn BlockDevice>> = rams.iter().map(|r| r.clone() as _).collect();
    let fs = open_set(&devs, true).expect("open the new filesystem");
    populate(&fs).expect("populate");
    fs.commit().expect("commit A");
    let man_a = manifest(&fs).expect("manifest A");
    drop(fs);
    let bases: Vec<Arc<Vec<u8>>> = rams.iter().map(|r| Arc::new(r.durable_bytes())).collect();
    let trace: Trace = Default::default();
    let devs: Vec<Arc<dyn BlockDevice>> = bases
        .iter()
        .enumerate()
        .map(|(idx, b)| {
            Arc::new(Member {
                idx,
                inner: Arc::new(RamDevice::new((**b).clone())),
                trace: trace.clone(),
            }) as _
        })
        .collect();
    let fs = open_set(&devs, true).expect("open A");
    change(&fs).expect("change set");
    let commit_first_write = trace
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, o)| matches!(o, Op::Write { .. }))
        .count();
    fs.commit().expect("commit B");
    let man_b = manifest(&fs).expect("manifest B");
    drop(fs);
    let ops = std::mem::take(&mut *trace.lock().unwrap());
    assert!(man_a != man_b);
    Some(Run {
        bases,
        man_a,
        man_b,
        ops,
        commit_first_write,
    })
}

/// Opens the devices of one cut (page maps over the bases) and checks the state they show.
fn verify(
    r: &Run,
    pages: &[HashMap<u64, Vec<u8>>],
    expect_b: bool,
    what: &str,
) -> Result<(), String> {
    let devs: Vec<Arc<dyn BlockDevice>> = r
        .bases
        .iter()
        .zip(pages)
        .map(|(b, p)| Arc::new(OverlayDevice::new(b.clone(), p.clone())) as _)
        .collect();
    let fs = open_set(&devs, false).map_err(|e| format!("{what}: open: {e}"))?;
    let m = manifest(&fs).map_err(|e| format!("{what}: {e}"))?;
    let (name, want) = if expect_b {
        ("B", &r.man_b)
    } else {
        ("A", &r.man_a)
    };
    if m != *want {
        return Err(format!("{what}: not state {name}: {}", diff(want, &m)));
    }
    butter_check(&fs).map_err(|e| format!("{what} (state {name}): {e}"))
}

fn sweep(n: usize, profile: &str) {
    let Some(r) = run(n, profile) else { return };
    let mut live: Vec<HashMap<u64, Vec<u8>>> = vec![HashMap::new(); n];
    let mut durable = live.clone();
    let mut unflushed: Vec<Vec<(u64, Vec<u8>)>> = vec![Vec::new(); n];
    let mut live_sb = false;
    let mut durable_sb = false;
    let mut unflushed_sb = vec![false; n];
    let mut rng = Rng(0x5eed_0000_3200_0001);
    let (mut k, mut checked) = (0usize, 0usize);
    let mut failures = Vec::new();
    for (dev, op) in &r.ops {
        match op {
            Op::Flush => {
                durable[*dev] = live[*dev].clone();
                unflushed[*dev].clear();
                durable_sb |= unflushed_sb[*dev];
                unflushed_sb[*dev] = false;
            }
            Op::Write { offset, data } => {
                if k >= r.commit_first_write || k.is_multiple_of(16) {
                    checked += 1;
                    let checks: [(&str, &[Pages], bool); 2] =
                        [("durable", &durable, durable_sb), ("live", &live, live_sb)];
                    for (what, pages, b) in checks {
                        if let Err(e) = verify(&r, pages, b, &format!("{profile} {what} k={k}")) {
                            failures.push(e);
                        }
                    }
                    if k.is_multiple_of(3) {
                        let mut torn = durable.clone();
                        let mut b = durable_sb;
                        for (d, writes) in unflushed.iter().enumerate() {
                            for (off, bytes) in writes {
                                if rng.next().is_multiple_of(2) {
                                    apply_write(&r.bases[d], &mut torn[d], *off, bytes);
                                    b |= *off == PRIMARY_SB;
                                }
                            }
                        }
                        if let Err(e) = verify(&r, &torn, b, &format!("{profile} torn k={k}")) {
                            failures.push(e);
                        }
                    }
                    if failures.len() > 5 {
                        break;
                    }
                }
                apply_write(&r.bases[*dev], &mut live[*dev], *offset, data);
                unflushed[*dev].push((*offset, data.clone()));
                if *offset == PRIMARY_SB {
                    live_sb = true;
                    unflushed_sb[*dev] = true;
                }
                k += 1;
            }
        }
    }
    if failures.is_empty() {
        if let Err(e) = verify(&r, &live, true, &format!("{profile} after the commit")) {
            failures.push(e);
        }
    }
    eprintln!(
        "{profile} on {n} devices: {checked} cut points over {k} writes ({} in the commit)",
        k - r.commit_first_write
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn power_cut_at_every_commit_write_raid1_two_devices() {
    sweep(2, "raid1");
}

#[test]
fn power_cut_at_every_commit_write_raid5_three_devices() {
    sweep(3, "raid5");
}

/// Device add is one commit; the new device's superblocks go first. A power cut at every
/// write of it (durable writes only, and every issued write): while device 1's primary
/// superblock is the old one, device 1 opens alone as the one-device filesystem it was;
/// once any device has the new superblock, both open together as two devices; the files
/// are the same throughout, and butter's checker is clean.
#[test]
fn power_cut_at_every_write_of_a_device_add() {
    fixed_time();
    let base = fresh_image(
        DEV_SIZE,
        butter::mkfs::Profile::Dup,
        butter::mkfs::Profile::Single,
    );
    let ram = Arc::new(RamDevice::new(base));
    let fs =
        open_set(&[ram.clone() as Arc<dyn BlockDevice>], true).expect("open the new filesystem");
    populate(&fs).expect("populate");
    fs.commit().expect("commit");
    let want = manifest(&fs).expect("manifest");
    drop(fs);
    let base1 = Arc::new(ram.durable_bytes());
    let base2 = Arc::new(vec![0u8; DEV_SIZE as usize]);
    let trace: Trace = Default::default();
    let devs: Vec<Arc<dyn BlockDevice>> = [&base1, &base2]
        .iter()
        .enumerate()
        .map(|(idx, b)| {
            Arc::new(Member {
                idx,
                inner: Arc::new(RamDevice::new((***b).clone())),
                trace: trace.clone(),
            }) as _
        })
        .collect();
    let fs = open_set(&devs[..1], true).expect("open");
    let devid = fs
        .add_device(devs[1].clone(), "device 2")
        .expect("device add");
    assert_eq!(devid, 2);
    drop(fs);
    let ops = std::mem::take(&mut *trace.lock().unwrap());
    let bases = [base1, base2];
    let generation = |b: &[u8], pages: &Pages| -> Option<u64> {
        let mut buf = vec![0u8; 4096];
        let dev = OverlayDevice::new(Arc::new(b.to_vec()), pages.clone());
        dev.read_at(&mut buf, PRIMARY_SB).ok()?;
        (buf[64..72] == butter::format::MAGIC.to_le_bytes())
            .then(|| u64::from_le_bytes(buf[72..80].try_into().unwrap()))
    };
    let check = |pages: &[Pages], what: &str| -> Result<(), String> {
        let gen1 = generation(&bases[0], &pages[0]);
        let gen0 = generation(&bases[0], &Pages::new());
        let new1 = gen1 != gen0;
        let new2 = generation(&bases[1], &pages[1]).is_some();
        if new1 && !new2 {
            return Err(format!(
                "{what}: device 1 names device 2, which has no superblock"
            ));
        }
        let devs: Vec<Arc<dyn BlockDevice>> = bases
            .iter()
            .zip(pages)
            .map(|(b, p)| Arc::new(OverlayDevice::new(b.clone(), p.clone())) as _)
            .collect();
        let (set, n) = if new2 {
            (&devs[..], 2)
        } else {
            (&devs[..1], 1)
        };
        let fs = open_set(set, false).map_err(|e| format!("{what}: open: {e}"))?;
        let got = fs.devices().map_err(|e| format!("{what}: {e}"))?.len();
        if got != n {
            return Err(format!("{what}: {got} devices, want {n}"));
        }
        let m = manifest(&fs).map_err(|e| format!("{what}: {e}"))?;
        if m != want {
            return Err(format!("{what}: files changed: {}", diff(&want, &m)));
        }
        butter_check(&fs).map_err(|e| format!("{what}: {e}"))?;
        if !new1 {
            // Device 1 alone is still the filesystem of one device.
            let fs = open_set(&devs[..1], false).map_err(|e| format!("{what}: alone: {e}"))?;
            butter_check(&fs).map_err(|e| format!("{what}: alone: {e}"))?;
        }
        Ok(())
    };
    let (mut failures, live, k) = cut_everywhere(&ops, &bases, check);
    if let Err(e) = check(&live, "after the commit") {
        failures.push(e);
    }
    eprintln!("device add: {k} writes, each a cut point");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Removing empty block groups is one commit (after one that unpins what was freed): a power
/// cut at every write of it leaves the groups there or gone, the files the same, and the
/// checker clean.
#[test]
fn power_cut_at_every_write_of_an_empty_group_removal() {
    fixed_time();
    let base = fresh_image(
        DEV_SIZE,
        butter::mkfs::Profile::Dup,
        butter::mkfs::Profile::Single,
    );
    let ram = Arc::new(RamDevice::new(base));
    let fs = open_set(&[ram.clone() as Arc<dyn BlockDevice>], true).expect("open");
    populate(&fs).expect("populate");
    let root = fs.root_inode();
    file(&fs, root, "big", 3, 40 << 20).expect("big file");
    fs.commit().expect("commit");
    fs.unlink(root, b"big").expect("unlink");
    fs.commit().expect("commit");
    let want = manifest(&fs).expect("manifest");
    let groups = fs.block_groups().expect("groups");
    let empty: Vec<u64> = groups
        .iter()
        .filter(|g| g.used == 0 && g.flags & 1 != 0)
        .map(|g| g.start)
        .collect();
    assert!(!empty.is_empty(), "{groups:?}");
    drop(fs);
    let base = Arc::new(ram.durable_bytes());
    let trace: Trace = Default::default();
    let dev: Arc<dyn BlockDevice> = Arc::new(Member {
        idx: 0,
        inner: Arc::new(RamDevice::new((*base).clone())),
        trace: trace.clone(),
    });
    let fs = open_set(std::slice::from_ref(&dev), true).expect("open");
    fs.remove_empty_block_groups(&empty).expect("remove");
    drop(fs);
    let ops = std::mem::take(&mut *trace.lock().unwrap());
    let (before, after) = (groups.len(), groups.len() - empty.len());
    let check = |pages: &Pages, what: &str| -> Result<(), String> {
        let d: Arc<dyn BlockDevice> = Arc::new(OverlayDevice::new(base.clone(), pages.clone()));
        let fs = open_set(&[d], true).map_err(|e| format!("{what}: open: {e}"))?;
        let n = fs.block_groups().map_err(|e| format!("{what}: {e}"))?.len();
        if n != before && n != after {
            return Err(format!(
                "{what}: {n} block groups, want {before} or {after}"
            ));
        }
        let m = manifest(&fs).map_err(|e| format!("{what}: {e}"))?;
        if m != want {
            return Err(format!("{what}: files changed: {}", diff(&want, &m)));
        }
        butter_check(&fs).map_err(|e| format!("{what}: {e}"))
    };
    let check = |pages: &[Pages], what: &str| check(&pages[0], what);
    let (mut failures, live, k) = cut_everywhere(&ops, std::slice::from_ref(&base), check);
    if let Err(e) = check(&live, "after the commit") {
        failures.push(e);
    }
    eprintln!("empty group removal: {k} writes, each a cut point");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Device remove (of a device that holds no chunk): one commit on the devices that stay,
/// then the removed one's superblocks wiped. A power cut at every write: while device 1's
/// superblock still names two devices, device 2 still has its superblock and both open
/// together; after, device 1 opens alone; the files are the same, the checker clean.
#[test]
fn power_cut_at_every_write_of_a_device_remove() {
    fixed_time();
    let base = fresh_image(
        DEV_SIZE,
        butter::mkfs::Profile::Dup,
        butter::mkfs::Profile::Single,
    );
    let r1 = Arc::new(RamDevice::new(base));
    let r2 = Arc::new(RamDevice::new(vec![0u8; DEV_SIZE as usize]));
    let fs = open_set(&[r1.clone() as Arc<dyn BlockDevice>], true).expect("open");
    populate(&fs).expect("populate");
    fs.add_device(r2.clone(), "device 2").expect("add");
    let want = manifest(&fs).expect("manifest");
    drop(fs);
    let bases = [Arc::new(r1.durable_bytes()), Arc::new(r2.durable_bytes())];
    let trace: Trace = Default::default();
    let devs: Vec<Arc<dyn BlockDevice>> = bases
        .iter()
        .enumerate()
        .map(|(idx, b)| {
            Arc::new(Member {
                idx,
                inner: Arc::new(RamDevice::new((**b).clone())),
                trace: trace.clone(),
            }) as _
        })
        .collect();
    let fs = open_set(&devs, true).expect("open both");
    fs.remove_device(2, &mut |_| {}).expect("remove");
    drop(fs);
    let ops = std::mem::take(&mut *trace.lock().unwrap());
    let num_devices = |b: &Arc<Vec<u8>>, pages: &Pages| -> Option<u64> {
        let mut buf = vec![0u8; 4096];
        let dev = OverlayDevice::new(b.clone(), pages.clone());
        dev.read_at(&mut buf, PRIMARY_SB).ok()?;
        (buf[64..72] == butter::format::MAGIC.to_le_bytes())
            .then(|| u64::from_le_bytes(buf[0x88..0x90].try_into().unwrap()))
    };
    let check = |pages: &[Pages], what: &str| -> Result<(), String> {
        let n1 = num_devices(&bases[0], &pages[0]);
        let n2 = num_devices(&bases[1], &pages[1]);
        let devs: Vec<Arc<dyn BlockDevice>> = bases
            .iter()
            .zip(pages)
            .map(|(b, p)| Arc::new(OverlayDevice::new(b.clone(), p.clone())) as _)
            .collect();
        let (set, n) = match n1 {
            Some(2) if n2.is_none() => {
                return Err(format!(
                    "{what}: device 1 names device 2, whose superblock is gone"
                ))
            }
            Some(2) => (&devs[..], 2),
            Some(1) => (&devs[..1], 1),
            other => {
                return Err(format!(
                    "{what}: device 1's superblock says {other:?} devices"
                ))
            }
        };
        let fs = open_set(set, false).map_err(|e| format!("{what}: open: {e}"))?;
        let got = fs.devices().map_err(|e| format!("{what}: {e}"))?.len();
        if got != n {
            return Err(format!("{what}: {got} devices, want {n}"));
        }
        let m = manifest(&fs).map_err(|e| format!("{what}: {e}"))?;
        if m != want {
            return Err(format!("{what}: files changed: {}", diff(&want, &m)));
        }
        butter_check(&fs).map_err(|e| format!("{what}: {e}"))
    };
    let (mut failures, live, k) = cut_everywhere(&ops, &bases, check);
    match check(&live, "after") {
        Ok(()) if num_devices(&bases[1], &live[1]).is_none() => {}
        Ok(()) => failures.push("after: device 2 still has a superblock".into()),
        Err(e) => failures.push(e),
    }
    eprintln!("device remove: {k} writes, each a cut point");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Every cut point of a traced run over devices `bases`: before each write, `check` sees the
/// pages only flushed writes left ("durable") and every write issued so far ("live").
/// Returns the failures (at most a few), the pages after the last write, and the writes.
fn cut_everywhere(
    ops: &[(usize, Op)],
    bases: &[Arc<Vec<u8>>],
    check: impl Fn(&[Pages], &str) -> Result<(), String>,
) -> (Vec<String>, Vec<Pages>, usize) {
    let mut live: Vec<Pages> = vec![Pages::new(); bases.len()];
    let mut durable = live.clone();
    let mut failures = Vec::new();
    let mut k = 0;
    for (dev, op) in ops {
        match op {
            Op::Flush => durable[*dev] = live[*dev].clone(),
            Op::Write { offset, data } => {
                for (what, pages) in [("durable", &durable), ("live", &live)] {
                    if let Err(e) = check(pages, &format!("{what} k={k}")) {
                        failures.push(e);
                    }
                }
                apply_write(&bases[*dev], &mut live[*dev], *offset, data);
                k += 1;
            }
        }
        if failures.len() > 5 {
            break;
        }
    }
    (failures, live, k)
}

/// A balance that relocates every block group (metadata converted from DUP to single, data
/// moved) commits once per group step. A power cut at every write: the image opens with the
/// same files and a clean checker, before or after each step, and (for a sample of the
/// cuts) `balance resume` from there ends where the uncut balance ended: every metadata and
/// system group single, no group of before left, the files the same.
#[test]
fn power_cut_at_every_write_of_a_balance_resumes_to_the_same_end() {
    use butter::inode::balance::{BalanceFilters, BalanceRequest};
    fixed_time();
    let base = fresh_image(
        DEV_SIZE,
        butter::mkfs::Profile::Dup,
        butter::mkfs::Profile::Single,
    );
    let ram = Arc::new(RamDevice::new(base));
    let fs = open_set(&[ram.clone() as Arc<dyn BlockDevice>], true).expect("open");
    populate(&fs).expect("populate");
    let root = fs.root_inode();
    let f = file(&fs, root, "shared", 9, 300_000).expect("file");
    let g = fs.create(root, b"clone", 0o644, OWNER).expect("create");
    fs.clone_range(f, 0, g, 0, 128 << 10).expect("clone");
    fs.commit().expect("commit");
    let want = manifest(&fs).expect("manifest");
    let before: Vec<u64> = fs
        .block_groups()
        .expect("groups")
        .iter()
        .map(|g| g.start)
        .collect();
    drop(fs);
    let base = Arc::new(ram.durable_bytes());
    let trace: Trace = Default::default();
    let dev: Arc<dyn BlockDevice> = Arc::new(Member {
        idx: 0,
        inner: Arc::new(RamDevice::new((*base).clone())),
        trace: trace.clone(),
    });
    let convert = BalanceFilters {
        convert: Some(0),
        ..BalanceFilters::default()
    };
    let item = BalanceRequest {
        data: Some(BalanceFilters::default()),
        metadata: Some(convert.clone()),
        system: Some(convert),
        force: true,
    };
    let fs = open_set(std::slice::from_ref(&dev), true).expect("open");
    let report = fs
        .balance(Some(&item), &mut |_| {}, &mut |_, _| false)
        .expect("balance");
    assert_eq!(report.relocated, before.len(), "{report:?}");
    drop(fs);
    let ops = std::mem::take(&mut *trace.lock().unwrap());
    // Where a balance must end: no group of before, metadata and system single, no item.
    let at_end = |fs: &Fs, what: &str| -> Result<(), String> {
        let groups = fs.block_groups().map_err(|e| format!("{what}: {e}"))?;
        for g in &groups {
            if before.contains(&g.start) {
                return Err(format!("{what}: the group at {} is still there", g.start));
            }
            if g.flags & 1 == 0 && g.flags & butter::format::BLOCK_GROUP_PROFILE_MASK != 0 {
                return Err(format!(
                    "{what}: {:#x} group at {} not converted",
                    g.flags, g.start
                ));
            }
        }
        if fs
            .paused_balance()
            .map_err(|e| format!("{what}: {e}"))?
            .is_some()
        {
            return Err(format!("{what}: the balance item is still there"));
        }
        Ok(())
    };
    let sample = std::sync::atomic::AtomicUsize::new(0);
    let check = |pages: &Pages, what: &str| -> Result<(), String> {
        let d: Arc<dyn BlockDevice> = Arc::new(OverlayDevice::new(base.clone(), pages.clone()));
        {
            let fs = open_set(std::slice::from_ref(&d), false)
                .map_err(|e| format!("{what}: open: {e}"))?;
            let m = manifest(&fs).map_err(|e| format!("{what}: {e}"))?;
            if m != want {
                return Err(format!("{what}: files changed: {}", diff(&want, &m)));
            }
            butter_check(&fs).map_err(|e| format!("{what}: {e}"))?;
        }
        if !sample
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .is_multiple_of(23)
        {
            return Ok(());
        }
        // Resume on a copy: the balance ends where the uncut one did.
        let copy: Arc<dyn BlockDevice> = Arc::new(OverlayDevice::new(base.clone(), pages.clone()));
        let fs = open_set(&[copy], true).map_err(|e| format!("{what}: open rw: {e}"))?;
        if fs
            .paused_balance()
            .map_err(|e| format!("{what}: {e}"))?
            .is_some()
        {
            fs.balance(None, &mut |_| {}, &mut |_, _| false)
                .map_err(|e| format!("{what}: resume: {e}"))?;
        } else {
            // Cut before the item was written: the balance starts again from the top.
            fs.balance(Some(&item), &mut |_| {}, &mut |_, _| false)
                .map_err(|e| format!("{what}: again: {e}"))?;
        }
        at_end(&fs, what)?;
        let m = manifest(&fs).map_err(|e| format!("{what}: {e}"))?;
        if m != want {
            return Err(format!(
                "{what}: files changed by the resume: {}",
                diff(&want, &m)
            ));
        }
        fs.close().map_err(|e| format!("{what}: close: {e}"))?;
        Ok(())
    };
    let check1 = |pages: &[Pages], what: &str| check(&pages[0], what);
    let (mut failures, live, k) = cut_everywhere(&ops, std::slice::from_ref(&base), check1);
    let d: Arc<dyn BlockDevice> = Arc::new(OverlayDevice::new(base.clone(), live[0].clone()));
    match open_set(&[d], true) {
        Ok(fs) => {
            if let Err(e) = at_end(&fs, "after the balance") {
                failures.push(e);
            }
            if let Err(e) = butter_check(&fs) {
                failures.push(e);
            }
        }
        Err(e) => failures.push(format!("after the balance: open: {e}")),
    }
    eprintln!("balance: {k} writes, each a cut point");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A filesystem written through the engine, then damaged in two inode items (a file's
/// nbytes, a directory's isize), as `internals::rewrite_item` does it: the damaged image's
/// bytes, and the findings' kinds the checker reports on it.
fn damaged_image() -> (Vec<u8>, Vec<butter::check::FindingKind>) {
    damaged_image_by(|ram| {
        // Inode 257 is directory d0, 260 its file f2 (2,094 bytes: a regular extent).
        for (ino, at, add) in [(260u64, 24usize, 4096u64), (257, 16, 10)] {
            butter::internals::rewrite_item(
                ram.clone(),
                butter::format::FS_TREE_OBJECTID,
                false,
                |k, _| k.objectid == ino && k.ty == butter::format::INODE_ITEM_KEY,
                |blk, _, d| {
                    let v = u64::from_le_bytes(blk[d + at..d + at + 8].try_into().unwrap());
                    blk[d + at..d + at + 8].copy_from_slice(&(v + add).to_le_bytes());
                },
            )
            .expect("damage");
        }
    })
}

/// [`damaged_image`] with the damage `hurt` does to the written image (two findings).
fn damaged_image_by(hurt: impl Fn(&Arc<RamDevice>)) -> (Vec<u8>, Vec<butter::check::FindingKind>) {
    fixed_time();
    let base = fresh_image(
        DEV_SIZE,
        butter::mkfs::Profile::Dup,
        butter::mkfs::Profile::Single,
    );
    let ram = Arc::new(RamDevice::new(base));
    let fs = open_set(&[ram.clone() as Arc<dyn BlockDevice>], true).expect("open");
    populate(&fs).expect("populate");
    fs.close().expect("close");
    drop(fs);
    hurt(&ram);
    let img = ram.durable_bytes();
    let dev: Arc<dyn BlockDevice> = Arc::new(RamDevice::new(img.clone()));
    let fs = open_set(&[dev], false).expect("open damaged");
    let mut kinds: Vec<_> = fs
        .check(Default::default(), &mut |_| {})
        .expect("check")
        .findings
        .iter()
        .filter(|f| f.severity != butter::check::Severity::Warning)
        .map(|f| f.kind)
        .collect();
    kinds.sort_by_key(|k| format!("{k:?}"));
    assert_eq!(kinds.len(), 2, "the damage: {kinds:?}");
    (img, kinds)
}

/// `butter check --repair`'s transaction cut by a power loss at every write: the image opens
/// as it was (the same two findings) or repaired (none), never in between, and its files
/// read the same either way.
#[test]
fn power_cut_at_every_write_of_a_repair_leaves_the_damage_or_the_repair() {
    let (img, damage) = damaged_image();
    power_cut_repair(img, damage);
}

/// The same for a repair of the extent tree: a data extent item's one inline data back
/// reference counts 2 (the item's count and its back references disagree, and the file
/// extent items make one): the reference changes go through the commit's delayed
/// references, the item rewritten, the block groups and free space untouched.
#[test]
fn power_cut_at_every_write_of_an_extent_repair_leaves_the_damage_or_the_repair() {
    // An inline EXTENT_DATA_REF after refs, generation and flags (24 bytes): type, root,
    // objectid, offset, then its count (4 bytes).
    const REF_LEN: usize = 1 + 8 + 8 + 8 + 4;
    let (img, damage) = damaged_image_by(|ram| {
        butter::internals::rewrite_item(
            ram.clone(),
            butter::format::EXTENT_TREE_OBJECTID,
            false,
            |k, d| {
                k.ty == butter::format::EXTENT_ITEM_KEY
                    && d.len() == 24 + REF_LEN
                    && d[24] == butter::format::EXTENT_DATA_REF_KEY
            },
            |blk, _, d| {
                let c = d + 24 + REF_LEN - 4;
                blk[c..c + 4].copy_from_slice(&2u32.to_le_bytes());
            },
        )
        .expect("damage");
    });
    power_cut_repair(img, damage);
}

/// Repairs `img` (whose findings are `damage`) with a power cut at every write: each cut
/// image opens as it was or repaired, its files the same.
fn power_cut_repair(img: Vec<u8>, damage: Vec<butter::check::FindingKind>) {
    power_cut_repair_rounds(Arc::new(img), damage, None);
}

/// The non-warning finding kinds of a report, sorted.
fn kinds_of(r: &butter::check::Report) -> Vec<butter::check::FindingKind> {
    let mut k: Vec<_> = r
        .findings
        .iter()
        .filter(|f| f.severity != butter::check::Severity::Warning)
        .map(|f| f.kind)
        .collect();
    k.sort_by_key(|k| format!("{k:?}"));
    k
}

/// [`power_cut_repair`], where a cut image may also show `round1` (what a first round of
/// several leaves); with `round1` set the damaged image's files are not compared (its
/// damage may hide them), every other state's are.
fn power_cut_repair_rounds(
    img: Arc<Vec<u8>>,
    damage: Vec<butter::check::FindingKind>,
    round1: Option<Vec<butter::check::FindingKind>>,
) {
    let trace: Trace = Default::default();
    let dev: Arc<dyn BlockDevice> = Arc::new(Member {
        idx: 0,
        inner: Arc::new(RamDevice::new((*img).clone())),
        trace: trace.clone(),
    });
    let opts = butter::fs::RwOptions {
        untouched: true,
        ..Default::default()
    };
    let fs = Fs::open_device_set_rw_with(vec![("device 0".into(), dev)], opts).expect("open");
    let r = fs.repair(false, &mut |_| {}).expect("repair");
    assert!(r.committed, "{r:?}");
    fs.close().expect("close");
    drop(fs);
    let ops = std::mem::take(&mut *trace.lock().unwrap());
    let ro = |pages: &Pages| -> Result<Fs, String> {
        let d: Arc<dyn BlockDevice> = Arc::new(OverlayDevice::new(img.clone(), pages.clone()));
        open_set(&[d], false).map_err(|e| format!("open: {e}"))
    };
    // The files as the repaired image shows them.
    let (_, live, _) = cut_everywhere(&ops, std::slice::from_ref(&img), |_, _| Ok(()));
    let want = manifest(&ro(&live[0]).expect("open repaired")).expect("manifest");
    let check = |pages: &Pages, what: &str| -> Result<(), String> {
        let fs = ro(pages).map_err(|e| format!("{what}: {e}"))?;
        let report = fs
            .check(Default::default(), &mut |_| {})
            .map_err(|e| format!("{what}: check: {e}"))?;
        let kinds = kinds_of(&report);
        let as_it_was = kinds == damage;
        if !as_it_was && !kinds.is_empty() && Some(&kinds) != round1.as_ref() {
            return Err(format!(
                "{what}: neither as it was ({damage:?}), nor after a whole round, nor repaired: {kinds:?}"
            ));
        }
        if as_it_was && round1.is_some() {
            return Ok(());
        }
        let m = manifest(&fs).map_err(|e| format!("{what}: {e}"))?;
        if m != want {
            return Err(format!("{what}: files changed: {}", diff(&want, &m)));
        }
        Ok(())
    };
    let check1 = |pages: &[Pages], what: &str| check(&pages[0], what);
    let (mut failures, live, k) = cut_everywhere(&ops, std::slice::from_ref(&img), check1);
    match ro(&live[0]) {
        Ok(fs) => {
            if let Err(e) = butter_check(&fs) {
                failures.push(format!("after the repair: {e}"));
            }
        }
        Err(e) => failures.push(format!("after the repair: {e}")),
    }
    eprintln!("repair: {k} writes, each a cut point");
    assert!(k > 0, "the repair wrote nothing");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A repair of two rounds cut by a power loss at every write: a leaf whose item offset is
/// damaged (mended alone in the first round) and a file's nbytes (mended in the second, once
/// the trees can be read). Each cut image opens as it was, as the first round left it, or
/// repaired; never in between, and where the trees can be read its files are the same.
#[test]
fn power_cut_at_every_write_of_a_two_round_repair_leaves_a_round_whole() {
    fixed_time();
    let base = fresh_image(
        DEV_SIZE,
        butter::mkfs::Profile::Dup,
        butter::mkfs::Profile::Single,
    );
    let ram = Arc::new(RamDevice::new(base));
    {
        let fs = open_set(&[ram.clone() as Arc<dyn BlockDevice>], true).expect("open");
        populate(&fs).expect("populate");
        fs.close().expect("close");
    }
    // File f2 of d0 (inode 260): nbytes one page more (byte 24 of its inode item).
    butter::internals::rewrite_item(
        ram.clone(),
        butter::format::FS_TREE_OBJECTID,
        false,
        |k, _| k.objectid == 260 && k.ty == butter::format::INODE_ITEM_KEY,
        |blk, _, d| {
            let v = u64::from_le_bytes(blk[d + 24..d + 32].try_into().unwrap());
            blk[d + 24..d + 32].copy_from_slice(&(v + 4096).to_le_bytes());
        },
    )
    .expect("damage nbytes");
    // The last inode item's data offset (bytes 17..21 of its item header) made garbage.
    butter::internals::rewrite_item(
        ram.clone(),
        butter::format::FS_TREE_OBJECTID,
        true,
        |k, _| k.ty == butter::format::INODE_ITEM_KEY,
        |blk, h, _| blk[h + 17..h + 21].copy_from_slice(&0x2d0f_4b57u32.to_le_bytes()),
    )
    .expect("damage offset");
    let img = Arc::new(ram.durable_bytes());
    let untouched = butter::fs::RwOptions {
        untouched: true,
        ..Default::default()
    };
    // The first round alone, on a copy: what it leaves.
    let round1 = {
        let dev: Arc<dyn BlockDevice> = Arc::new(RamDevice::new((*img).clone()));
        let fs =
            Fs::open_device_set_rw_with(vec![("device 0".into(), dev)], untouched).expect("open");
        let before = fs.check(Default::default(), &mut |_| {}).expect("check");
        let fixes = butter::check::repair::plan(&before);
        assert!(
            fixes
                .iter()
                .all(|f| matches!(f, butter::check::Fix::MendBlock { .. })),
            "the first round mends the leaf alone: {fixes:?}"
        );
        let r = fs
            .repair_with(before, fixes, false, &mut |_| {})
            .expect("round 1");
        assert!(r.committed, "{r:?}");
        kinds_of(r.after.as_ref().expect("after"))
    };
    assert_eq!(
        round1,
        vec![butter::check::FindingKind::NbytesMismatch],
        "what the first round leaves"
    );
    let damage = kinds_of(
        &open_set(
            &[Arc::new(RamDevice::new((*img).clone())) as Arc<dyn BlockDevice>],
            false,
        )
        .expect("open")
        .check(Default::default(), &mut |_| {})
        .expect("check"),
    );
    assert!(
        damage.contains(&butter::check::FindingKind::TreeBlockUnreadable),
        "the damage: {damage:?}"
    );
    power_cut_repair_rounds(img, damage, Some(round1));
}

/// A repair whose result the checker finds worse is not written: a planted wrong fix (a
/// healthy file's nbytes set off by one sector) is refused, and the device sees no write.
#[test]
fn a_repair_that_would_leave_new_problems_writes_nothing() {
    fixed_time();
    let base = fresh_image(
        DEV_SIZE,
        butter::mkfs::Profile::Dup,
        butter::mkfs::Profile::Single,
    );
    let ram = Arc::new(RamDevice::new(base));
    {
        let fs = open_set(&[ram.clone() as Arc<dyn BlockDevice>], true).expect("open");
        populate(&fs).expect("populate");
        fs.close().expect("close");
    }
    let before_bytes = ram.durable_bytes();
    let writes = ram.write_count();
    let opts = butter::fs::RwOptions {
        untouched: true,
        ..Default::default()
    };
    let fs = Fs::open_device_set_rw_with(vec![("device 0".into(), ram.clone() as _)], opts)
        .expect("open");
    let before = fs.check(Default::default(), &mut |_| {}).expect("check");
    assert!(before.is_clean(), "{:?}", before.findings);
    let wrong = butter::check::Fix::InodeNbytes {
        root: butter::format::FS_TREE_OBJECTID,
        ino: 260,
        nbytes: 4096 * 3,
    };
    let r = fs
        .repair_with(before, vec![wrong], false, &mut |_| {})
        .expect("repair");
    assert!(!r.committed, "{r:?}");
    let why = r.refused.clone().unwrap_or_default();
    assert!(why.contains("NbytesMismatch"), "{why}");
    drop(fs);
    assert_eq!(ram.write_count(), writes, "the refused repair wrote");
    assert!(ram.durable_bytes() == before_bytes, "the image changed");
}

/// The checker on a filesystem still open read-write, after commits that changed the used
/// bytes and the generation: it reads the superblock as last committed, not as opened.
#[test]
fn a_live_check_after_commits_is_clean() {
    fixed_time();
    let base = fresh_image(
        DEV_SIZE,
        butter::mkfs::Profile::Dup,
        butter::mkfs::Profile::Single,
    );
    let ram = Arc::new(RamDevice::new(base));
    let fs = open_set(&[ram.clone() as Arc<dyn BlockDevice>], true).expect("open");
    populate(&fs).expect("populate");
    fs.commit().expect("commit");
    change(&fs).expect("change");
    fs.commit().expect("commit");
    let r = fs.check(Default::default(), &mut |_| {}).expect("check");
    assert!(r.is_clean(), "{:?}", r.findings);
}
