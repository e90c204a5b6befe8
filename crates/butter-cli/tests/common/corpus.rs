//! The corpus of btrfs-progs' checker test images (tests/corpus/ at the top of the repository),
//! extracted to raw filesystem images.
//!
//! Extraction needs `xz`, `tar` and `btrfs-image -r` (btrfs-progs). Extracted images are cached
//! under `$BUTTER_ORACLE_TMP/corpus-<hash of the corpus listing>/` (default /tmp/butter-oracle),
//! each written to a temporary name and renamed into place, so test binaries running at the same
//! time share the work safely. Tests that change an image must copy it first ([`copy_to`]).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One filesystem image of the corpus, extracted.
#[derive(Clone, Debug)]
pub struct CorpusImage {
    /// `DIR/FILE` with the archive suffixes dropped, e.g. `012-leaf-corruption/good`; for a tar
    /// with several images, `DIR/TAR/MEMBER`.
    pub name: String,
    /// The raw image (shared cache: do not write to it).
    pub path: PathBuf,
}

/// The corpus directory: tests/corpus/btrfs-progs-fsck-tests at the repository's top.
pub fn corpus_dir() -> PathBuf {
    let top = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = top.join("tests/corpus/btrfs-progs-fsck-tests");
    assert!(
        dir.is_dir(),
        "the corpus is missing: expected {}",
        dir.display()
    );
    dir
}

/// Every archive file of the corpus, sorted (relative paths like `012-leaf-corruption/good.img.xz`).
pub fn archives() -> Vec<PathBuf> {
    let dir = corpus_dir();
    let mut out = Vec::new();
    for d in fs::read_dir(&dir).expect("read corpus dir") {
        let d = d.expect("corpus dir entry").path();
        if !d.is_dir() {
            continue;
        }
        for f in fs::read_dir(&d).expect("read corpus subdir") {
            let f = f.expect("corpus entry").path();
            let name = f.file_name().unwrap().to_string_lossy().into_owned();
            if name.ends_with(".img") || name.ends_with(".xz") {
                out.push(f.strip_prefix(&dir).unwrap().to_path_buf());
            }
        }
    }
    out.sort();
    out
}

fn cache_dir(archives: &[PathBuf]) -> PathBuf {
    // FNV-1a over the listing and sizes: a changed corpus gets a new cache.
    let mut h: u64 = 0xcbf29ce484222325;
    let dir = corpus_dir();
    for a in archives {
        let len = fs::metadata(dir.join(a)).map(|m| m.len()).unwrap_or(0);
        for b in a.to_string_lossy().bytes().chain(len.to_le_bytes()) {
            h ^= b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
    }
    let base = std::env::var_os("BUTTER_ORACLE_TMP")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp/butter-oracle"));
    base.join(format!("corpus-{h:016x}"))
}

fn tmp_name(p: &Path) -> PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(format!(".tmp{}", std::process::id()));
    PathBuf::from(s)
}

/// Turns a `.img` metadata dump or a raw file at `src` into the raw image `dst`.
fn restore_into(src: &Path, dst: &Path, what: &str) {
    let tmp = tmp_name(dst);
    let _ = fs::remove_file(&tmp);
    // A metadump starts with the btrfs-image magic at byte 0; a raw image has zeroes there.
    let head = fs::read(src)
        .map(|b| b[..8.min(b.len())].to_vec())
        .unwrap_or_default();
    if head.iter().all(|&b| b == 0) {
        fs::copy(src, &tmp).unwrap_or_else(|e| panic!("{what}: copy: {e}"));
    } else {
        super::kernel::run(Command::new("btrfs-image").arg("-r").arg(src).arg(&tmp));
    }
    fs::rename(&tmp, dst).unwrap_or_else(|e| panic!("{what}: rename: {e}"));
}

/// Extracts (once, cached) and returns every image of the corpus.
pub fn images() -> Vec<CorpusImage> {
    let archives = archives();
    let cache = cache_dir(&archives);
    fs::create_dir_all(&cache).unwrap_or_else(|e| panic!("mkdir {}: {e}", cache.display()));
    let dir = corpus_dir();
    let mut out = Vec::new();
    for a in &archives {
        let src = dir.join(a);
        let fname = a.file_name().unwrap().to_string_lossy().into_owned();
        let sub = a.parent().unwrap().to_string_lossy().into_owned();
        let stem = fname
            .trim_end_matches(".xz")
            .trim_end_matches(".tar")
            .trim_end_matches(".img")
            .trim_end_matches(".raw")
            .to_string();
        let what = format!("corpus {sub}/{fname}");
        if fname.ends_with(".tar.xz") {
            // A tar of one or more images: each member becomes an image.
            let tdir = cache.join(format!("{sub}__{stem}.d"));
            if !tdir.is_dir() {
                let tmp = tmp_name(&tdir);
                let _ = fs::remove_dir_all(&tmp);
                fs::create_dir_all(&tmp).unwrap();
                super::kernel::run(
                    Command::new("tar")
                        .arg("-xJf")
                        .arg(&src)
                        .arg("-C")
                        .arg(&tmp),
                );
                let mut members: Vec<PathBuf> = walk_files(&tmp);
                members.sort();
                for m in members {
                    let mname = m.file_name().unwrap().to_string_lossy().into_owned();
                    let raw = tmp.join(format!("{mname}.raw-image"));
                    restore_into(&m, &raw, &what);
                    fs::remove_file(&m).ok();
                }
                if fs::rename(&tmp, &tdir).is_err() {
                    // Another process got there first.
                    let _ = fs::remove_dir_all(&tmp);
                }
            }
            let mut members: Vec<PathBuf> = fs::read_dir(&tdir)
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
            members.sort();
            for m in members {
                let mname = m.file_name().unwrap().to_string_lossy().into_owned();
                let mname = mname
                    .trim_end_matches(".raw-image")
                    .trim_end_matches(".img")
                    .trim_end_matches(".raw")
                    .to_string();
                out.push(CorpusImage {
                    name: format!("{sub}/{stem}/{mname}"),
                    path: m,
                });
            }
            continue;
        }
        let raw = cache.join(format!("{sub}__{stem}.raw-image"));
        if !raw.exists() {
            if fname.ends_with(".xz") {
                let unpacked = tmp_name(&cache.join(format!("{sub}__{stem}.unxz")));
                let f = fs::File::create(&unpacked).unwrap();
                let st = Command::new("xz")
                    .arg("-dc")
                    .arg(&src)
                    .stdout(f)
                    .status()
                    .unwrap_or_else(|e| panic!("{what}: cannot run xz: {e}"));
                assert!(st.success(), "{what}: xz -dc failed");
                restore_into(&unpacked, &raw, &what);
                let _ = fs::remove_file(&unpacked);
            } else {
                restore_into(&src, &raw, &what);
            }
        }
        out.push(CorpusImage {
            name: format!("{sub}/{stem}"),
            path: raw,
        });
    }
    out
}

fn walk_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk_files(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// A private, writable copy of `img` at `dst` (sparse where the source is).
pub fn copy_to(img: &CorpusImage, dst: &Path) {
    super::kernel::run(
        Command::new("cp")
            .arg("--sparse=always")
            .arg(&img.path)
            .arg(dst),
    );
}
