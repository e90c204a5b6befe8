//! Compression on write against the kernel: data written through the library and through
//! `butter mount` with each algorithm and several levels reads back identically through butter
//! and through the kernel; dump-tree shows compressed extents where the data compresses,
//! incompressible data stays plain (its file marked NOCOMPRESS unless compression is forced),
//! small files become compressed inline extents, partial overwrites and truncates of
//! compressed extents keep the right bytes, `chattr +c` and the `btrfs.compression` property
//! switch it on per file, and both checkers are clean. Needs root, loop devices and
//! btrfs-progs; without them the test prints a notice and passes, unless CI is set.

mod common;

use butter::format::compress::Compression;
use butter::fs::{Fs, RwOptions};
use butter::inode::file::Precompressed;
use butter::inode::namespace::Owner;
use common::fuse_mount::{self, butter_check, ButterMount, BUTTER};
use common::kernel::{self, LoopMount, ScratchDir};
use std::fs;
use std::path::Path;
use std::process::Command;

fn text(seed: u64, len: usize) -> Vec<u8> {
    let words: [&[u8]; 5] = [b"alpha ", b"beta ", b"gamma ", b"delta\n", b"epsilon "];
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(words[(x % 5) as usize]);
    }
    v.truncate(len);
    v
}

fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn new_image(img: &Path) {
    fs::File::create(img).unwrap().set_len(512 << 20).unwrap();
    let out = kernel::run_output(Command::new(BUTTER).arg("mkfs").arg(img));
    assert!(out.status.success(), "butter mkfs: {out:?}");
}

fn clean(img: &Path, what: &str) {
    let (rc, out) = butter_check(img);
    assert_eq!(rc, 0, "{what}: butter check:\n{out}");
    kernel::assert_btrfs_check(img);
}

/// Counts of extents by compression in the dump of the top-level tree.
fn codes(img: &Path) -> String {
    kernel::dump_tree(img, &["-t", "5"])
}

/// Small appends gather in memory and are compressed at their write-back, as the kernel
/// compresses at writeback: a file written 4 KiB at a time (more than one full buffer, with
/// an fsync half way, which commits) ends as compressed extents of 128 KiB, not as 4 KiB
/// pieces that cannot save a sector. Reads back through butter and the kernel, both
/// checkers clean.
#[test]
fn small_appends_are_compressed_at_write_back() {
    if !fuse_mount::require("small_appends_are_compressed_at_write_back", &[]) {
        return;
    }
    let sc = ScratchDir::new("compress-appends");
    let img = sc.join("a.img");
    new_image(&img);
    let opts = RwOptions {
        compress: Compression::parse("zstd:3").unwrap(),
        ..Default::default()
    };
    let body = text(42, (9 << 20) + 1234);
    {
        let fs = Fs::open_rw_with(&img, opts).unwrap();
        let top = fs.subvol_root_inode(5).unwrap();
        let o = Owner { uid: 0, gid: 0 };
        let f = fs.create(top, b"log", 0o644, o).unwrap();
        for (i, piece) in body.chunks(4096).enumerate() {
            fs.write(f, (i * 4096) as u64, piece).unwrap();
            if i == 700 {
                fs.fsync(f, false).unwrap();
            }
        }
        assert_eq!(fs.read(f, 0, body.len() + 10).unwrap(), body);
        let uses = fs.extent_usage(f).unwrap();
        let compressed = uses.iter().filter(|u| u.compression == 3).count();
        let plain: Vec<_> = uses.iter().filter(|u| u.compression == 0).collect();
        assert!(
            compressed >= body.len() / (128 << 10) - 2,
            "only {compressed} zstd extents of {} for 9 MiB of 4 KiB appends",
            uses.len()
        );
        assert!(
            plain.len() <= 1,
            "appends stayed plain: {} of {} extents",
            plain.len(),
            uses.len()
        );
        fs.close().unwrap();
    }
    clean(&img, "appends");
    let m = LoopMount::btrfs_ro(&img, &sc.dir("k"));
    assert!(fs::read(m.path().join("log")).unwrap() == body);
    m.unmount();
}

#[test]
fn library_writes_compress_with_every_algorithm() {
    if !fuse_mount::require("library_writes_compress_with_every_algorithm", &[]) {
        return;
    }
    let sc = ScratchDir::new("compress-lib");
    for (n, alg) in ["zlib:1", "zlib:9", "lzo", "zstd:1", "zstd:15"]
        .iter()
        .enumerate()
    {
        let img = sc.join(format!("{n}.img"));
        new_image(&img);
        let c = Compression::parse(alg).unwrap();
        let opts = RwOptions {
            compress: c,
            ..Default::default()
        };
        let want: Vec<(&str, Vec<u8>)> = {
            let fs = Fs::open_rw_with(&img, opts).unwrap();
            let top = fs.subvol_root_inode(5).unwrap();
            let o = Owner { uid: 0, gid: 0 };
            let mut files = Vec::new();
            // Compressible, in pieces of uneven size.
            let t = fs.create(top, b"text", 0o644, o).unwrap();
            let body = text(n as u64, 700_000);
            for (i, piece) in body.chunks(100_000).enumerate() {
                fs.write(t, (i * 100_000) as u64, piece).unwrap();
            }
            files.push(("text", body.clone()));
            // Incompressible: stays plain, the file marked NOCOMPRESS.
            let r = fs.create(top, b"noise", 0o644, o).unwrap();
            let nbody = noise(n as u64, 300_000);
            fs.write(r, 0, &nbody).unwrap();
            files.push(("noise", nbody));
            // Small: a compressed inline extent, then cut.
            let s = fs.create(top, b"small", 0o644, o).unwrap();
            fs.write(s, 0, &[b'q'; 2000]).unwrap();
            fs.truncate(s, 1500).unwrap();
            files.push(("small", vec![b'q'; 1500]));
            // Overwritten inside a compressed extent, then truncated into one.
            let w = fs.create(top, b"patched", 0o644, o).unwrap();
            let mut pbody = text(n as u64 + 7, 400_000);
            fs.write(w, 0, &pbody).unwrap();
            fs.write(w, 70_000, b"PATCH").unwrap();
            pbody[70_000..70_005].copy_from_slice(b"PATCH");
            fs.truncate(w, 250_001).unwrap();
            pbody.truncate(250_001);
            files.push(("patched", pbody));
            for (name, data) in &files {
                let ino = fs.lookup(top, name.as_bytes()).unwrap().unwrap().target;
                assert_eq!(
                    &fs.read(ino, 0, data.len() + 10).unwrap(),
                    data,
                    "{alg}: {name} through butter"
                );
            }
            fs.close().unwrap();
            files
        };
        clean(&img, alg);
        let tree = codes(&img);
        let name = c.unwrap().name();
        assert!(
            tree.contains(&format!("({name})")),
            "{alg}: no {name} extent:\n{tree}"
        );
        assert!(
            tree.contains("NOCOMPRESS"),
            "{alg}: noise not marked NOCOMPRESS"
        );
        assert!(
            tree.contains("inline extent data size"),
            "{alg}: no inline extent"
        );
        let m = LoopMount::btrfs_ro(&img, &sc.dir("k"));
        for (name, data) in &want {
            assert_eq!(
                &fs::read(m.path().join(name)).unwrap(),
                data,
                "{alg}: {name} through the kernel"
            );
        }
        m.unmount();
    }
}

/// Data compressed ahead of its write ([`Precompressed`], as mkfs compresses on its
/// workers) is stored as an ordinary write stores it: two images, one written with
/// `write` and one with `write_precompressed`, hold extents of the same shapes and read back
/// the same through butter and the kernel, both checkers clean. Data compressed ahead that
/// does not fit the write (another algorithm, an overwrite ending inside old data) is
/// written as an ordinary write.
#[test]
fn precompressed_writes_match_ordinary_ones() {
    if !fuse_mount::require("precompressed_writes_match_ordinary_ones", &[]) {
        return;
    }
    let sc = ScratchDir::new("compress-ahead");
    let zstd = Compression::parse("zstd:3").unwrap();
    let zlib = Compression::parse("zlib:3").unwrap().unwrap();
    let sizes = [100, 1500, 3000, 4096, 40_000, 300_001];
    let mut shapes = Vec::new();
    let mut files = Vec::new();
    for ahead in [false, true] {
        let img = sc.join(format!("{ahead}.img"));
        new_image(&img);
        let opts = RwOptions {
            compress: zstd,
            compress_force: true,
            ..Default::default()
        };
        files.clear();
        {
            let fs = Fs::open_rw_with(&img, opts).unwrap();
            let top = fs.subvol_root_inode(5).unwrap();
            let o = Owner { uid: 0, gid: 0 };
            let put = |name: &str, at: u64, data: &[u8], c: Compression| {
                let ino = match fs.lookup(top, name.as_bytes()).unwrap() {
                    Some(e) => e.target,
                    None => fs.create(top, name.as_bytes(), 0o644, o).unwrap(),
                };
                let n = if ahead {
                    let z = Precompressed::new(c, data, 4096);
                    fs.write_precompressed(ino, at, data, &z).unwrap()
                } else {
                    fs.write(ino, at, data).unwrap()
                };
                assert_eq!(n, data.len(), "{name}: short write");
            };
            for (i, &len) in sizes.iter().enumerate() {
                let t = text(i as u64, len);
                put(&format!("text{len}"), 0, &t, zstd.unwrap());
                files.push((format!("text{len}"), t));
                let r = noise(i as u64, len);
                put(&format!("noise{len}"), 0, &r, zstd.unwrap());
                files.push((format!("noise{len}"), r));
            }
            // Compressed ahead with another algorithm: compressed here instead.
            let other = text(99, 200_000);
            put("other", 0, &other, zlib);
            files.push(("other".into(), other));
            // An overwrite ending inside the file's old data (its last sector holds old
            // bytes, not the zeros compressed ahead).
            let mut mid = text(7, 20_000);
            put("mid", 0, &mid, zstd.unwrap());
            let patch = noise(8, 5000);
            put("mid", 4096, &patch, zstd.unwrap());
            mid[4096..9096].copy_from_slice(&patch);
            files.push(("mid".into(), mid));
            for (name, data) in &files {
                let ino = fs.lookup(top, name.as_bytes()).unwrap().unwrap().target;
                assert_eq!(
                    &fs.read(ino, 0, data.len() + 10).unwrap(),
                    data,
                    "{name} through butter (ahead: {ahead})"
                );
            }
            fs.close().unwrap();
        }
        clean(&img, &format!("ahead: {ahead}"));
        let m = LoopMount::btrfs_ro(&img, &sc.dir("k"));
        for (name, data) in &files {
            assert_eq!(
                &fs::read(m.path().join(name)).unwrap(),
                data,
                "{name} through the kernel (ahead: {ahead})"
            );
        }
        m.unmount();
        shapes.push(extent_shapes(&img));
    }
    assert!(
        shapes[0]
            .iter()
            .any(|e| e.starts_with("inline") && e.ends_with("compression 3")),
        "no compressed inline extent: {:?}",
        shapes[0]
    );
    assert_eq!(
        shapes[0], shapes[1],
        "extents written by write (left) and write_precompressed (right)"
    );
}

#[test]
fn mount_options_flag_and_property_compress() {
    if !fuse_mount::require(
        "mount_options_flag_and_property_compress",
        &["chattr", "setfattr"],
    ) {
        return;
    }
    let sc = ScratchDir::new("compress-mount");
    for (n, opt) in ["compress=zstd:3", "compress-force=zlib", ""]
        .iter()
        .enumerate()
    {
        let img = sc.join(format!("{n}.img"));
        new_image(&img);
        let args: Vec<&str> = if opt.is_empty() {
            vec![]
        } else {
            vec!["-o", opt]
        };
        let bm = ButterMount::start(&img, &sc.dir("m"), &args, &sc.join(format!("{n}.log")));
        let p = bm.path();
        fs::write(p.join("text"), text(3, 900_000)).unwrap();
        fs::write(p.join("noise"), noise(3, 200_000)).unwrap();
        fs::create_dir(p.join("lzo")).unwrap();
        let st = Command::new("setfattr")
            .args(["-n", "btrfs.compression", "-v", "lzo"])
            .arg(p.join("lzo"))
            .status()
            .unwrap();
        assert!(st.success());
        fs::write(p.join("lzo/inherits"), text(4, 300_000)).unwrap();
        fs::write(p.join("flagged"), b"").unwrap();
        let st = Command::new("chattr")
            .arg("+c")
            .arg(p.join("flagged"))
            .status()
            .unwrap();
        assert!(st.success());
        fs::write(p.join("flagged"), text(5, 300_000)).unwrap();
        let bad = Command::new("setfattr")
            .args(["-n", "btrfs.compression", "-v", "bogus"])
            .arg(p.join("text"))
            .output()
            .unwrap();
        assert!(
            !bad.status.success(),
            "{opt}: a bogus compression was accepted"
        );
        bm.unmount();
        clean(&img, opt);
        let tree = codes(&img);
        assert!(
            tree.contains("(lzo)"),
            "{opt}: the property's lzo is not used:\n{tree}"
        );
        match *opt {
            "compress=zstd:3" => {
                assert!(tree.contains("(zstd)"));
                assert!(tree.contains("NOCOMPRESS"), "{opt}: noise not NOCOMPRESS");
            }
            "compress-force=zlib" => {
                assert!(tree.contains("(zlib)"));
                assert!(
                    !tree.contains("NOCOMPRESS"),
                    "{opt}: forced, yet NOCOMPRESS"
                );
            }
            _ => assert!(
                tree.contains("(zlib)"),
                "chattr +c without compress= is zlib"
            ),
        }
        let m = LoopMount::btrfs_ro(&img, &sc.dir("k"));
        assert_eq!(fs::read(m.path().join("text")).unwrap(), text(3, 900_000));
        assert_eq!(fs::read(m.path().join("noise")).unwrap(), noise(3, 200_000));
        assert_eq!(
            fs::read(m.path().join("lzo/inherits")).unwrap(),
            text(4, 300_000)
        );
        assert_eq!(
            fs::read(m.path().join("flagged")).unwrap(),
            text(5, 300_000)
        );
        let lsattr = kernel::sh("lsattr", &[m.path().join("flagged").to_str().unwrap()]);
        assert!(
            lsattr.split_whitespace().next().unwrap_or("").contains('c'),
            "{lsattr}"
        );
        m.unmount();
    }
}

/// The file extents of the top-level tree as (kind, file bytes, compression code), sorted:
/// inline extents with their decoded length, regular ones with their `nr` and `ram`.
fn extent_shapes(img: &Path) -> Vec<String> {
    let dump = kernel::dump_tree(img, &["-t", "5"]);
    let mut out = Vec::new();
    let mut regular = None;
    for line in dump.lines().map(str::trim) {
        let w: Vec<&str> = line.split_whitespace().collect();
        if line.starts_with("inline extent data size") && w.len() >= 9 {
            out.push(format!("inline ram {} compression {}", w[6], w[8]));
        } else if line.starts_with("extent data offset") && w.len() >= 8 {
            regular = Some(format!("regular nr {} ram {}", w[5], w[7]));
        } else if line.starts_with("extent compression") && w.len() >= 3 {
            if let Some(r) = regular.take() {
                out.push(format!("{r} compression {}", w[2]));
            }
        }
    }
    out.sort();
    out
}

/// `butter mkfs --rootdir --compress ALGO[:LEVEL]`: the kernel shows the source tree exactly,
/// both checkers pass, the extents are compressed, and two runs with the same uuid and
/// SOURCE_DATE_EPOCH make the same bytes (the files are read and compressed ahead on several
/// threads; the image does not depend on which finishes first). The extents have the shapes
/// mkfs.btrfs gives the same tree: every file shorter than a sector inline (compressed where
/// that makes it smaller), the others in compressed extents of 128 KiB where they shrink.
#[test]
fn mkfs_rootdir_compress() {
    if !fuse_mount::require("mkfs_rootdir_compress", &[]) {
        return;
    }
    let sc = ScratchDir::new("compress-mkfs");
    let src = sc.dir("src");
    for d in 0..4 {
        let dir = src.join(format!("d{d}"));
        fs::create_dir(&dir).unwrap();
        for f in 0..30u64 {
            let len = [90, 3000, 40_000, 300_000][(f % 4) as usize];
            let body = if f % 5 == 4 {
                noise(f + d * 100, len)
            } else {
                text(f + d * 100, len)
            };
            fs::write(dir.join(format!("f{f}")), body).unwrap();
        }
    }
    let want = common::manifest::take(&src, &Default::default());
    for alg in ["zstd:3", "zlib", "lzo"] {
        let mut images = Vec::new();
        for run in 0..2 {
            let img = sc.join(format!("{alg}-{run}.img"));
            let out = kernel::run_output(
                Command::new(BUTTER)
                    .args(["mkfs", "-q", "-U", "11111111-2222-3333-4444-555555555555"])
                    .args(["--compress", alg, "--rootdir"])
                    .arg(&src)
                    .arg(&img)
                    .env("SOURCE_DATE_EPOCH", "1700000000"),
            );
            assert!(out.status.success(), "mkfs --compress {alg}: {out:?}");
            images.push(img);
        }
        assert!(
            fs::read(&images[0]).unwrap() == fs::read(&images[1]).unwrap(),
            "--compress {alg}: two runs differ"
        );
        clean(&images[0], alg);
        let theirs = sc.join(format!("{alg}-progs.img"));
        let src_arg = src.to_string_lossy().into_owned();
        kernel::mkfs_btrfs(
            &theirs,
            512 << 20,
            &["--rootdir", src_arg.as_str(), "--compress", alg],
        );
        let (ours, progs) = (extent_shapes(&images[0]), extent_shapes(&theirs));
        assert!(
            ours.iter()
                .any(|e| e.starts_with("inline") && !e.ends_with("compression 0")),
            "--compress {alg}: no compressed inline extent in {ours:?}"
        );
        assert_eq!(
            ours, progs,
            "--compress {alg}: file extents of butter mkfs (left) and mkfs.btrfs (right)"
        );
        let name = Compression::parse(alg).unwrap().unwrap().name();
        assert!(
            codes(&images[0]).contains(&format!("({name})")),
            "--compress {alg}: nothing compressed"
        );
        let m = LoopMount::btrfs_ro(&images[0], &sc.dir("k"));
        let got = common::manifest::take(m.path(), &Default::default());
        m.unmount();
        // (Reading the source for mkfs moves its directories' atimes.)
        let opts = common::manifest::CompareOpts {
            root_attrs: false,
            atime: false,
            ..common::manifest::CompareOpts::restore()
        };
        common::manifest::assert_same(&want, &got, &opts, &format!("mkfs --compress {alg}"));
    }
    let bad = kernel::run_output(
        Command::new(BUTTER)
            .args(["mkfs", "-q", "--compress", "zstd:99", "--rootdir"])
            .arg(&src)
            .arg(sc.join("bad.img")),
    );
    assert!(!bad.status.success(), "zstd:99 accepted");
    assert!(
        !sc.join("bad.img").exists(),
        "a refused mkfs wrote an image"
    );
}

/// `butter compsize` prints what compsize prints on a kernel mount: for the whole
/// filesystem and for a few paths, over compressed, plain, inline, preallocated and
/// reflinked (counted once on disk) extents written by the kernel with compress-force.
#[test]
fn compsize_matches_compsize() {
    if !fuse_mount::require("compsize_matches_compsize", &["compsize", "fallocate"]) {
        return;
    }
    let sc = ScratchDir::new("compsize");
    let img = sc.join("k.img");
    kernel::mkfs_btrfs::<&str>(&img, 512 << 20, &[]);
    {
        let m = LoopMount::btrfs(&img, &sc.dir("m"), "compress-force=zstd");
        let p = m.path();
        fs::create_dir(p.join("d")).unwrap();
        fs::write(p.join("d/text"), text(1, 2_000_000)).unwrap();
        fs::write(p.join("d/noise"), noise(1, 500_000)).unwrap();
        fs::write(p.join("small"), b"tiny file").unwrap();
        fs::write(p.join("d/inline"), text(2, 3000)).unwrap();
        let st = Command::new("cp")
            .args(["--reflink=always"])
            .arg(p.join("d/text"))
            .arg(p.join("copy"))
            .status()
            .unwrap();
        assert!(st.success());
        let st = Command::new("fallocate")
            .args(["-l", "1M"])
            .arg(p.join("pre"))
            .status()
            .unwrap();
        assert!(st.success());
        m.unmount();
    }
    let m = LoopMount::btrfs_ro(&img, &sc.dir("m"));
    for paths in [
        vec![""],
        vec!["d"],
        vec!["d/text", "copy"],
        vec!["small", "pre"],
    ] {
        let theirs = kernel::sh(
            "compsize",
            &paths
                .iter()
                .map(|p| m.path().join(p).to_str().unwrap().to_string())
                .collect::<Vec<_>>(),
        );
        let mut args = vec!["compsize".to_string(), img.to_str().unwrap().to_string()];
        args.extend(paths.iter().map(|p| format!("/{p}")));
        let out = kernel::run_output(Command::new(BUTTER).args(&args));
        assert!(out.status.success(), "butter compsize {paths:?}: {out:?}");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            theirs,
            "compsize {paths:?}"
        );
    }
    m.unmount();
}
