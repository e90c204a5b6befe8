//! The mount benchmark's metadata and fsync rows with no FUSE: the same operations through
//! the library (`lib IMAGE`) or through system calls on a mounted directory (`dir DIR`: the
//! kernel's btrfs, ext4, a butter mount), so issue 31's "library-only" rows compare the
//! engine's own cost per operation with the kernel's rate through system calls, both from
//! compiled loops.
//!
//! ```text
//! libops lib IMAGE PHASE ARGS...      libops dir DIR PHASE ARGS...
//! ```
//!
//! Phases (each run opens the image or directory afresh; the library's commit at the end
//! and the directory's fsync make the phase durable):
//! - `create N`: 100 directories, N files of 100 bytes spread over them;
//! - `stat N`: the attributes of every file, found by name;
//! - `delete N`: every file unlinked, the directories removed;
//! - `randprep MIB`: a file of MIB MiB written in 1 MiB pieces (untimed preparation);
//! - `randwrite MIB WRITES`: WRITES 4 KiB writes at seeded random 4 KiB offsets of it, an
//!   fsync after every 16.
//!
//! Prints `ops=N seconds=S ops_per_s=R`.

use butter::fs::{Fs, Inode};
use butter::inode::namespace::Owner;
use std::io::Write as _;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

const DIRS: u64 = 100;

fn usage() -> ! {
    eprintln!(
        "usage: libops lib IMAGE|dir DIR  create N | stat N | delete N | randprep MIB | \
         randwrite MIB WRITES"
    );
    std::process::exit(2)
}

fn dir_name(d: u64) -> String {
    format!("d{d:03}")
}

fn file_name(i: u64) -> String {
    format!("file-{i:07}")
}

/// A xorshift generator: the same offsets in both modes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

type Res<T> = Result<T, String>;

/// The operations of one phase, either way.
trait Target {
    fn mkdir(&mut self, name: &str) -> Res<()>;
    fn create_write(&mut self, dir: &str, name: &str, data: &[u8]) -> Res<()>;
    fn stat(&mut self, dir: &str, name: &str) -> Res<u64>;
    fn unlink(&mut self, dir: &str, name: &str) -> Res<()>;
    fn rmdir(&mut self, name: &str) -> Res<()>;
    fn open_big(&mut self) -> Res<()>;
    fn pwrite_big(&mut self, off: u64, data: &[u8]) -> Res<()>;
    fn fsync_big(&mut self) -> Res<()>;
    /// Makes the phase durable.
    fn finish(&mut self) -> Res<()>;
}

struct Lib {
    fs: Fs,
    top: Inode,
    dirs: std::collections::HashMap<String, Inode>,
    big: Option<Inode>,
}

impl Lib {
    fn open(image: &Path) -> Res<Lib> {
        let fs = Fs::open_rw(image).map_err(|e| format!("open {}: {e}", image.display()))?;
        let root = fs.root_inode();
        let top = match fs.lookup(root, b"libops").map_err(|e| e.to_string())? {
            Some(e) => e.target,
            None => fs
                .mkdir(root, b"libops", 0o755, Owner::default())
                .map_err(|e| e.to_string())?,
        };
        Ok(Lib {
            fs,
            top,
            dirs: Default::default(),
            big: None,
        })
    }

    fn dir(&mut self, name: &str) -> Res<Inode> {
        if let Some(d) = self.dirs.get(name) {
            return Ok(*d);
        }
        let d = self
            .fs
            .lookup(self.top, name.as_bytes())
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("{name}: no such directory"))?
            .target;
        self.dirs.insert(name.to_string(), d);
        Ok(d)
    }
}

impl Target for Lib {
    fn mkdir(&mut self, name: &str) -> Res<()> {
        let d = self
            .fs
            .mkdir(self.top, name.as_bytes(), 0o755, Owner::default())
            .map_err(|e| e.to_string())?;
        self.dirs.insert(name.to_string(), d);
        Ok(())
    }

    fn create_write(&mut self, dir: &str, name: &str, data: &[u8]) -> Res<()> {
        let d = self.dir(dir)?;
        let f = self
            .fs
            .create(d, name.as_bytes(), 0o644, Owner::default())
            .map_err(|e| e.to_string())?;
        self.fs.write(f, 0, data).map_err(|e| e.to_string())?;
        Ok(())
    }

    fn stat(&mut self, dir: &str, name: &str) -> Res<u64> {
        let d = self.dir(dir)?;
        let (_, item) = self
            .fs
            .lookup_item(d, name.as_bytes())
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("{dir}/{name}: missing"))?;
        Ok(item.size)
    }

    fn unlink(&mut self, dir: &str, name: &str) -> Res<()> {
        let d = self.dir(dir)?;
        self.fs
            .unlink(d, name.as_bytes())
            .map_err(|e| e.to_string())
    }

    fn rmdir(&mut self, name: &str) -> Res<()> {
        self.fs
            .rmdir(self.top, name.as_bytes())
            .map_err(|e| e.to_string())
    }

    fn open_big(&mut self) -> Res<()> {
        let f = match self
            .fs
            .lookup(self.top, b"big")
            .map_err(|e| e.to_string())?
        {
            Some(e) => e.target,
            None => self
                .fs
                .create(self.top, b"big", 0o644, Owner::default())
                .map_err(|e| e.to_string())?,
        };
        self.big = Some(f);
        Ok(())
    }

    fn pwrite_big(&mut self, off: u64, data: &[u8]) -> Res<()> {
        let f = self.big.ok_or("big file not open")?;
        self.fs
            .write(f, off, data)
            .map(drop)
            .map_err(|e| e.to_string())
    }

    fn fsync_big(&mut self) -> Res<()> {
        let f = self.big.ok_or("big file not open")?;
        self.fs.fsync(f, false).map_err(|e| e.to_string())
    }

    fn finish(&mut self) -> Res<()> {
        self.fs.close().map(drop).map_err(|e| e.to_string())
    }
}

struct Dir {
    top: PathBuf,
    big: Option<std::fs::File>,
}

fn io(what: &str, p: &Path, e: std::io::Error) -> String {
    format!("{what} {}: {e}", p.display())
}

impl Target for Dir {
    fn mkdir(&mut self, name: &str) -> Res<()> {
        let p = self.top.join(name);
        std::fs::create_dir(&p).map_err(|e| io("mkdir", &p, e))
    }

    fn create_write(&mut self, dir: &str, name: &str, data: &[u8]) -> Res<()> {
        let p = self.top.join(dir).join(name);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&p)
            .map_err(|e| io("create", &p, e))?;
        f.write_all(data).map_err(|e| io("write", &p, e))
    }

    fn stat(&mut self, dir: &str, name: &str) -> Res<u64> {
        let p = self.top.join(dir).join(name);
        Ok(std::fs::metadata(&p).map_err(|e| io("stat", &p, e))?.len())
    }

    fn unlink(&mut self, dir: &str, name: &str) -> Res<()> {
        let p = self.top.join(dir).join(name);
        std::fs::remove_file(&p).map_err(|e| io("unlink", &p, e))
    }

    fn rmdir(&mut self, name: &str) -> Res<()> {
        let p = self.top.join(name);
        std::fs::remove_dir(&p).map_err(|e| io("rmdir", &p, e))
    }

    fn open_big(&mut self) -> Res<()> {
        let p = self.top.join("big");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&p)
            .map_err(|e| io("open", &p, e))?;
        self.big = Some(f);
        Ok(())
    }

    fn pwrite_big(&mut self, off: u64, data: &[u8]) -> Res<()> {
        let f = self.big.as_ref().ok_or("big file not open")?;
        f.write_all_at(data, off)
            .map_err(|e| io("pwrite", &self.top.join("big"), e))
    }

    fn fsync_big(&mut self) -> Res<()> {
        let f = self.big.as_ref().ok_or("big file not open")?;
        f.sync_all()
            .map_err(|e| io("fsync", &self.top.join("big"), e))
    }

    fn finish(&mut self) -> Res<()> {
        self.big = None;
        let f = std::fs::File::open(&self.top).map_err(|e| io("open", &self.top, e))?;
        f.sync_all().map_err(|e| io("fsync", &self.top, e))
    }
}

fn num(a: Option<String>) -> u64 {
    a.and_then(|s| s.parse().ok()).unwrap_or_else(|| usage())
}

fn run(t: &mut dyn Target, phase: &str, args: &mut dyn Iterator<Item = String>) -> Res<u64> {
    let data = [b'm'; 100];
    match phase {
        "create" => {
            let n = num(args.next());
            for d in 0..DIRS {
                t.mkdir(&dir_name(d))?;
            }
            for i in 0..n {
                t.create_write(&dir_name(i % DIRS), &file_name(i), &data)?;
            }
            Ok(n)
        }
        "stat" => {
            let n = num(args.next());
            for i in 0..n {
                let size = t.stat(&dir_name(i % DIRS), &file_name(i))?;
                if size != 100 {
                    return Err(format!("{}: size {size}, not 100", file_name(i)));
                }
            }
            Ok(n)
        }
        "delete" => {
            let n = num(args.next());
            for i in 0..n {
                t.unlink(&dir_name(i % DIRS), &file_name(i))?;
            }
            for d in 0..DIRS {
                t.rmdir(&dir_name(d))?;
            }
            Ok(n)
        }
        "randprep" => {
            let mib = num(args.next());
            t.open_big()?;
            let piece = vec![0x5a; 1 << 20];
            for m in 0..mib {
                t.pwrite_big(m << 20, &piece)?;
            }
            Ok(mib)
        }
        "randwrite" => {
            let blocks = num(args.next()) << 8;
            let writes = num(args.next());
            t.open_big()?;
            let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
            let mut buf = [0u8; 4096];
            for w in 0..writes {
                buf[..8].copy_from_slice(&w.to_le_bytes());
                t.pwrite_big((rng.next() % blocks) * 4096, &buf)?;
                if w % 16 == 15 {
                    t.fsync_big()?;
                }
            }
            Ok(writes)
        }
        _ => usage(),
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mode, path, phase) = match (args.next(), args.next(), args.next()) {
        (Some(m), Some(p), Some(ph)) => (m, PathBuf::from(p), ph),
        _ => usage(),
    };
    let t0 = Instant::now();
    let r = match mode.as_str() {
        "lib" => Lib::open(&path).and_then(|mut l| {
            let n = run(&mut l, &phase, &mut args)?;
            l.finish()?;
            Ok(n)
        }),
        "dir" => {
            let top = path.join("libops");
            let _ = std::fs::create_dir(&top);
            let mut d = Dir { top, big: None };
            run(&mut d, &phase, &mut args).and_then(|n| d.finish().map(|()| n))
        }
        _ => usage(),
    };
    match r {
        Ok(n) => {
            let s = t0.elapsed().as_secs_f64();
            println!("ops={n} seconds={s:.3} ops_per_s={:.0}", n as f64 / s);
        }
        Err(e) => {
            eprintln!("libops {mode} {phase}: {e}");
            std::process::exit(1);
        }
    }
}
