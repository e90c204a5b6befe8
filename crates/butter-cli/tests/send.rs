//! `butter send` against the kernel: streams butter makes from kernel-made snapshots, full and
//! incremental, protocol 1 and 2, applied by the kernel's `btrfs receive` on a loop mount and
//! by `butter receive` into an image, must give exactly the source snapshots (names, types,
//! modes, owners, sizes, mtimes, xattrs, link targets, hard-link groups, content); both
//! checkers stay clean. A full send of a kernel-made snapshot prints, through `btrfs receive
//! --dump`, what the kernel's own stream prints. A seeded model test makes random changes
//! between snapshots for many rounds and sends each round incrementally. Needs root, loop
//! devices and btrfs-progs; without them the test prints a notice and passes, unless CI is
//! set.

mod common;

use common::fuse_mount::{self, butter_check, BUTTER};
use common::kernel::{self, LoopMount, ScratchDir};
use common::manifest::{self, Manifest, TakeOpts};
use common::send_source::{make_compressed_source, make_source, received_opts, sh};
use std::fs;
use std::path::Path;
use std::process::Command;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn butter_ok(args: &[&str]) -> String {
    let out = kernel::run_output(Command::new(BUTTER).args(args));
    assert!(
        out.status.success(),
        "butter {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn dump(stream: &Path) -> String {
    kernel::sh("btrfs", &["receive", "--dump", "-f", s(stream)])
}

/// `btrfs receive -f STREAM` into the mounted `dir`.
fn kernel_receive(stream: &Path, dir: &Path) {
    let out = kernel::run_output(
        Command::new("btrfs")
            .args(["receive", "-f"])
            .arg(stream)
            .arg(dir),
    );
    assert!(
        out.status.success(),
        "btrfs receive {}: {}",
        stream.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn new_butter_image(img: &Path) {
    fs::File::create(img).unwrap().set_len(512 << 20).unwrap();
    butter_ok(&["mkfs", s(img)]);
}

fn assert_clean(img: &Path, what: &str) {
    let (rc, out) = butter_check(img);
    assert_eq!(rc, 0, "{what}: butter check:\n{out}");
    kernel::assert_btrfs_check(img);
}

#[test]
fn butter_streams_round_trip_through_both_receivers() {
    if !fuse_mount::require(
        "butter_streams_round_trip_through_both_receivers",
        &["setfattr", "fallocate", "python3"],
    ) {
        return;
    }
    let sc = ScratchDir::new("send");
    let src = sc.join("src.img");
    fuse_mount::fresh_image(&src, 512 << 20);
    let kstreams = sc.dir("kernel-streams");
    let (mans, _) = make_source(&src, &sc.dir("src"), &kstreams);

    // A full send of a kernel-made snapshot says what the kernel's says.
    let ours = sc.dir("ours");
    let full = ours.join("s0");
    butter_ok(&["send", "-q", "-f", s(&full), s(&src), "/s0"]);
    let (a, b) = (dump(&kstreams.join("s0")), dump(&full));
    assert!(
        a == b,
        "butter's full send differs from the kernel's:\nkernel:\n{a}\nbutter:\n{b}"
    );
    let (ka, kb) = (
        fs::metadata(kstreams.join("s0")).unwrap().len(),
        fs::metadata(&full).unwrap().len(),
    );
    assert!(
        kb * 100 <= ka * 105,
        "butter's full stream is {kb} bytes, the kernel's {ka}"
    );

    // Without data, and with compressed data in protocol 2: the kernel's commands too.
    {
        let m = LoopMount::btrfs_ro(&src, &sc.dir("src"));
        common::send_source::send(
            m.path(),
            &["--no-data", "-f", s(&kstreams.join("nodata")), "s0"],
        );
        m.unmount();
    }
    let nodata = ours.join("nodata");
    butter_ok(&["send", "-q", "--no-data", "-f", s(&nodata), s(&src), "/s0"]);
    assert_eq!(dump(&kstreams.join("nodata")), dump(&nodata), "--no-data");
    let cwant = make_compressed_source(&src, &sc.dir("src"), &kstreams.join("c0"));
    let c0 = ours.join("c0");
    butter_ok(&[
        "send",
        "-q",
        "--proto",
        "2",
        "--compressed-data",
        "-f",
        s(&c0),
        s(&src),
        "/c0",
    ]);
    assert_eq!(
        dump(&kstreams.join("c0")),
        dump(&c0),
        "--proto 2 --compressed-data"
    );
    {
        let kimg = sc.join("kc.img");
        fuse_mount::fresh_image(&kimg, 256 << 20);
        let m = LoopMount::btrfs(&kimg, &sc.dir("k"), "");
        kernel_receive(&c0, m.path());
        let got = manifest::take(&m.path().join("c0"), &TakeOpts::default());
        manifest::assert_same(
            &cwant,
            &got,
            &received_opts(),
            "compressed c0 by btrfs receive",
        );
        m.unmount();
        assert_clean(&kimg, "after btrfs receive of compressed data");
    }

    // The chain, both protocols.
    for proto in ["1", "2"] {
        let mut streams = Vec::new();
        for i in 0..5 {
            let f = ours.join(format!("v{proto}-s{i}"));
            let snap = format!("/s{i}");
            let mut args = vec!["send", "-q", "--proto", proto, "-f", s(&f)];
            let parent = format!("/s{}", i.max(1) - 1);
            // The last one of protocol 1 names its parent as a clone source only (-c), and
            // send picks it as the parent, as btrfs send does.
            if i == 4 && proto == "1" {
                args.extend(["-c", &parent]);
            } else if i > 0 {
                args.extend(["-p", &parent]);
            }
            args.extend([s(&src), &snap]);
            butter_ok(&args);
            streams.push(f);
        }
        // Into the kernel.
        let kimg = sc.join(format!("k{proto}.img"));
        fuse_mount::fresh_image(&kimg, 512 << 20);
        {
            let m = LoopMount::btrfs(&kimg, &sc.dir("k"), "");
            for (i, st) in streams.iter().enumerate() {
                kernel_receive(st, m.path());
                let got = manifest::take(&m.path().join(format!("s{i}")), &TakeOpts::default());
                manifest::assert_same(
                    &mans[i],
                    &got,
                    &received_opts(),
                    &format!("v{proto} s{i} by btrfs receive"),
                );
            }
            m.unmount();
        }
        assert_clean(&kimg, "after btrfs receive");
        // Into butter.
        let bimg = sc.join(format!("b{proto}.img"));
        new_butter_image(&bimg);
        for st in &streams {
            butter_ok(&["receive", "-q", "-f", s(st), s(&bimg), "/"]);
        }
        assert_clean(&bimg, "after butter receive");
        let m = LoopMount::btrfs_ro(&bimg, &sc.dir("b"));
        for (i, want) in mans.iter().enumerate() {
            let got = manifest::take(&m.path().join(format!("s{i}")), &TakeOpts::default());
            manifest::assert_same(
                want,
                &got,
                &received_opts(),
                &format!("v{proto} s{i} by butter receive"),
            );
        }
        m.unmount();
    }
}

/// Random changes to `x` in the mounted source, seeded: creates, renames across
/// directories, swaps, directories moved under their former children, unlinks, hard links,
/// overwrites, truncates, punched holes, reflinks, xattrs, modes.
const CHURN: &str = r#"
import os, random, subprocess, sys
r = random.Random(int(sys.argv[1]))
root = sys.argv[2]
def walk():
    files, dirs = [], []
    for dp, dns, fns in os.walk(root):
        for d in dns: dirs.append(os.path.join(dp, d))
        for f in fns: files.append(os.path.join(dp, f))
    return files, dirs
def name(): return "n%d" % r.randrange(60)
def anydir(dirs): return r.choice(dirs + [root])
for _ in range(int(sys.argv[3])):
    files, dirs = walk()
    op = r.randrange(14)
    try:
        if op == 0 or not files:
            p = os.path.join(anydir(dirs), name())
            with open(p, "wb") as f: f.write(os.urandom(r.choice([0, 10, 3000, 5000, 70000, 200000])))
        elif op == 1:
            os.mkdir(os.path.join(anydir(dirs), name()))
        elif op == 2:
            src = r.choice(files + dirs)
            dst = os.path.join(anydir(dirs), name())
            if not (dst + "/").startswith(src + "/"): os.rename(src, dst)
        elif op == 3 and len(files) > 1:
            a, b = r.sample(files, 2); t = a + ".swap"
            os.rename(a, t); os.rename(b, a); os.rename(t, b)
        elif op == 4 and dirs:
            a = r.choice(dirs)
            subs = [d for d in dirs if d.startswith(a + "/")]
            if subs:
                b = r.choice(subs); t = os.path.join(os.path.dirname(a), name() + "t")
                if not os.path.exists(t):
                    os.rename(b, t); os.rename(a, os.path.join(t, os.path.basename(a)))
        elif op == 5:
            os.unlink(r.choice(files))
        elif op == 6 and dirs:
            subprocess.run(["rm", "-rf", r.choice(dirs)], check=True)
        elif op == 7:
            os.link(r.choice(files), os.path.join(anydir(dirs), name()))
        elif op == 8:
            p = r.choice(files); sz = os.path.getsize(p)
            with open(p, "r+b") as f:
                f.seek(r.randrange(sz + 1)); f.write(os.urandom(r.choice([1, 4096, 9000, 65536])))
        elif op == 9:
            os.truncate(r.choice(files), r.choice([0, 1, 4096, 5000, 150000, 300000]))
        elif op == 10:
            p = r.choice(files); sz = os.path.getsize(p)
            if sz > 8192:
                subprocess.run(["fallocate", "-p", "-o", "4096", "-l", str(sz // 2), p], check=True)
        elif op == 11:
            subprocess.run(["cp", "--reflink=always", r.choice(files), os.path.join(anydir(dirs), name())], check=True)
        elif op == 12:
            p = r.choice(files + dirs)
            if r.randrange(3): os.setxattr(p, "user.k%d" % r.randrange(3), os.urandom(r.randrange(1, 40)))
            else:
                for x in os.listxattr(p): os.removexattr(p, x)
        elif op == 13:
            os.chmod(r.choice(files), r.choice([0o600, 0o644, 0o755, 0o4755]))
    except (OSError, subprocess.CalledProcessError):
        pass
"#;

#[test]
fn incremental_model_random_rounds() {
    if !fuse_mount::require(
        "incremental_model_random_rounds",
        &["setfattr", "fallocate", "python3"],
    ) {
        return;
    }
    let rounds: usize = std::env::var("BUTTER_SEND_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12);
    let seed: u64 = std::env::var("BUTTER_SEND_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20261125);
    let sc = ScratchDir::new("send-model");
    let src = sc.join("src.img");
    fuse_mount::fresh_image(&src, 768 << 20);
    let script = sc.join("churn.py");
    fs::write(&script, CHURN).unwrap();
    let kimg = sc.join("k.img");
    fuse_mount::fresh_image(&kimg, 768 << 20);
    let bimg = sc.join("b.img");
    fs::File::create(&bimg).unwrap().set_len(768 << 20).unwrap();
    butter_ok(&["mkfs", s(&bimg)]);
    let mut mans: Vec<Manifest> = Vec::new();
    for round in 0..rounds {
        {
            let m = LoopMount::btrfs(&src, &sc.dir("src"), "");
            if round == 0 {
                sh("btrfs subvolume create x >/dev/null", m.path());
            }
            let out = kernel::run_output(
                Command::new("python3")
                    .arg(&script)
                    .arg((seed + round as u64).to_string())
                    .arg(m.path().join("x"))
                    .arg(if round == 0 { "120" } else { "40" }),
            );
            assert!(
                out.status.success(),
                "churn: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            sh(
                &format!("btrfs subvolume snapshot -r x r{round} >/dev/null"),
                m.path(),
            );
            mans.push(manifest::take(
                &m.path().join(format!("r{round}")),
                &TakeOpts::default(),
            ));
            m.unmount();
        }
        let st = sc.join(format!("r{round}.stream"));
        let snap = format!("/r{round}");
        let parent = format!("/r{}", round.max(1) - 1);
        let proto = if round % 2 == 0 { "1" } else { "2" };
        let mut args = vec!["send", "-q", "--proto", proto, "-f", s(&st)];
        if round > 0 {
            args.extend(["-p", &parent]);
        }
        args.extend([s(&src), &snap]);
        butter_ok(&args);
        let what = format!(
            "round {round} (seed {}, protocol {proto})",
            seed + round as u64
        );
        {
            let m = LoopMount::btrfs(&kimg, &sc.dir("k"), "");
            kernel_receive(&st, m.path());
            let got = manifest::take(&m.path().join(format!("r{round}")), &TakeOpts::default());
            manifest::assert_same(
                &mans[round],
                &got,
                &received_opts(),
                &format!("{what} by btrfs receive"),
            );
            m.unmount();
        }
        butter_ok(&["receive", "-q", "-f", s(&st), s(&bimg), "/"]);
        let m = LoopMount::btrfs_ro(&bimg, &sc.dir("b"));
        let got = manifest::take(&m.path().join(format!("r{round}")), &TakeOpts::default());
        manifest::assert_same(
            &mans[round],
            &got,
            &received_opts(),
            &format!("{what} by butter receive"),
        );
        m.unmount();
    }
    assert_clean(&kimg, "the kernel's received image");
    assert_clean(&bimg, "butter's received image");
    assert_clean(&src, "the source");
}

/// Inode numbers reused: btrfs hands out the highest number + 1 after a mount, so deleting
/// the newest inodes, remounting and creating again reuses their numbers for other inodes
/// (a directory's number for a file of the same name, a file's for a directory). The
/// incremental stream must take the old inodes away before the new ones come.
#[test]
fn incremental_with_reused_inode_numbers() {
    if !fuse_mount::require("incremental_with_reused_inode_numbers", &["python3"]) {
        return;
    }
    let sc = ScratchDir::new("send-reuse");
    let src = sc.join("src.img");
    fuse_mount::fresh_image(&src, 256 << 20);
    let ino = |p: &Path| {
        use std::os::unix::fs::MetadataExt;
        fs::symlink_metadata(p).unwrap().ino()
    };
    let mut mans = Vec::new();
    let (old_d, old_f);
    {
        let m = LoopMount::btrfs(&src, &sc.dir("src"), "");
        sh(
            "btrfs subvolume create x >/dev/null
             cd x; echo keep > a; mkdir d; echo inner > d/in; echo last > f; cd ..
             btrfs subvolume snapshot -r x r0 >/dev/null",
            m.path(),
        );
        old_d = ino(&m.path().join("x/d"));
        old_f = ino(&m.path().join("x/f"));
        mans.push(manifest::take(&m.path().join("r0"), &TakeOpts::default()));
        sh("rm -rf x/d x/f", m.path());
        m.unmount();
    }
    {
        let m = LoopMount::btrfs(&src, &sc.dir("src"), "");
        // New inodes take the numbers of d, d/in and f: a file named d, a directory named f.
        sh(
            "cd x; echo now-a-file > d; mkdir f; echo x > f/g; mv a f/a; cd ..
             btrfs subvolume snapshot -r x r1 >/dev/null",
            m.path(),
        );
        let reused = [ino(&m.path().join("x/d")), ino(&m.path().join("x/f"))];
        assert!(
            reused.contains(&old_d) || reused.contains(&old_f),
            "no inode number was reused (old {old_d}, {old_f}; new {reused:?})"
        );
        mans.push(manifest::take(&m.path().join("r1"), &TakeOpts::default()));
        m.unmount();
    }
    let full = sc.join("r0.stream");
    let inc = sc.join("r1.stream");
    butter_ok(&["send", "-q", "-f", s(&full), s(&src), "/r0"]);
    butter_ok(&["send", "-q", "-p", "/r0", "-f", s(&inc), s(&src), "/r1"]);
    let kimg = sc.join("k.img");
    fuse_mount::fresh_image(&kimg, 256 << 20);
    {
        let m = LoopMount::btrfs(&kimg, &sc.dir("k"), "");
        for (i, st) in [&full, &inc].iter().enumerate() {
            kernel_receive(st, m.path());
            let got = manifest::take(&m.path().join(format!("r{i}")), &TakeOpts::default());
            manifest::assert_same(
                &mans[i],
                &got,
                &received_opts(),
                &format!("r{i} by btrfs receive"),
            );
        }
        m.unmount();
    }
    let bimg = sc.join("b.img");
    new_butter_image(&bimg);
    for st in [&full, &inc] {
        butter_ok(&["receive", "-q", "-f", s(st), s(&bimg), "/"]);
    }
    assert_clean(&bimg, "butter's received image");
    assert_clean(&kimg, "the kernel's received image");
    let m = LoopMount::btrfs_ro(&bimg, &sc.dir("b"));
    for (i, want) in mans.iter().enumerate() {
        let got = manifest::take(&m.path().join(format!("r{i}")), &TakeOpts::default());
        manifest::assert_same(
            want,
            &got,
            &received_opts(),
            &format!("r{i} by butter receive"),
        );
    }
    m.unmount();
}
