//! `butter ls`, `butter cat`, `butter subvolumes`: look inside an image without mounting it.

use super::paths::Start;
use super::{open_fs, CliError, CliResult};
use butter::format::items::Timespec;
use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct LsArgs {
    /// Image file or block device.
    pub image: PathBuf,
    /// Directory inside the image (default: the root of the default subvolume).
    #[arg(default_value = "/")]
    pub path: OsString,
    /// Long listing: mode, links, owner, size, mtime.
    #[arg(short = 'l')]
    pub long: bool,
    #[command(flatten)]
    pub start: Start,
}

#[derive(clap::Args)]
pub struct CatArgs {
    pub image: PathBuf,
    /// File inside the image.
    pub path: OsString,
    #[command(flatten)]
    pub start: Start,
}

/// `butter subvolumes` / `butter subvolume list`: the columns and filters of `btrfs
/// subvolume list` on a mount of the top level, printed as it prints them.
#[derive(clap::Args)]
pub struct SubvolArgs {
    pub image: PathBuf,
    /// Also each subvolume's parent (the subvolume it is linked in).
    #[arg(short = 'p')]
    pub parent: bool,
    /// Also the generation at creation (cgen).
    #[arg(short = 'c')]
    pub cgen: bool,
    /// The generation (gen; always shown).
    #[arg(short = 'g')]
    pub gen: bool,
    /// Also each subvolume's uuid.
    #[arg(short = 'u')]
    pub uuid: bool,
    /// Also each subvolume's parent uuid (the subvolume it is a snapshot of; "-" for none).
    #[arg(short = 'q')]
    pub parent_uuid: bool,
    /// Also each subvolume's received uuid ("-" for none).
    #[arg(short = 'R')]
    pub received_uuid: bool,
    /// Only read-only subvolumes.
    #[arg(short = 'r')]
    pub readonly: bool,
}

/// A uuid as btrfs prints it, "-" for none (all zeros).
pub fn uuid_or_dash(u: &[u8; 16]) -> String {
    if *u == [0; 16] {
        "-".into()
    } else {
        butter::format::fmt_uuid(u)
    }
}

pub fn mode_string(mode: u32) -> String {
    let t = match mode & 0o170000 {
        0o040000 => 'd',
        0o120000 => 'l',
        0o020000 => 'c',
        0o060000 => 'b',
        0o010000 => 'p',
        0o140000 => 's',
        _ => '-',
    };
    let mut s = String::from(t);
    let bits = [
        (0o400, 'r'),
        (0o200, 'w'),
        (0o100, 'x'),
        (0o40, 'r'),
        (0o20, 'w'),
        (0o10, 'x'),
        (0o4, 'r'),
        (0o2, 'w'),
        (0o1, 'x'),
    ];
    for (i, (b, c)) in bits.iter().enumerate() {
        let mut ch = if mode & b != 0 { *c } else { '-' };
        if i == 2 && mode & 0o4000 != 0 {
            ch = if ch == 'x' { 's' } else { 'S' };
        }
        if i == 5 && mode & 0o2000 != 0 {
            ch = if ch == 'x' { 's' } else { 'S' };
        }
        if i == 8 && mode & 0o1000 != 0 {
            ch = if ch == 'x' { 't' } else { 'T' };
        }
        s.push(ch);
    }
    s
}

fn fmt_time(t: Timespec) -> String {
    butter::format::print::utc_datetime(t.sec)
}

pub fn ls(a: LsArgs) -> CliResult {
    let fs = open_fs(&a.image)?;
    let dir = a.start.resolve(&fs, &a.path)?;
    let st = fs.stat(dir)?;
    let out = std::io::stdout();
    let mut out = out.lock();
    // A path that is not a directory lists itself, named as given, as ls(1) does.
    let entries: Vec<(String, butter::fs::Inode)> = if st.is_dir() {
        fs.readdir(dir, 0, 0)?
            .into_iter()
            .map(|e| (String::from_utf8_lossy(&e.name).into_owned(), e.target))
            .collect()
    } else {
        vec![(a.path.to_string_lossy().into_owned(), dir)]
    };
    for (name, target) in entries {
        if a.long {
            let s = fs.stat(target)?;
            let mut line = format!(
                "{} {:>3} {:>5} {:>5} {:>12} {} {}",
                mode_string(s.mode),
                s.nlink,
                s.uid,
                s.gid,
                s.size,
                fmt_time(s.mtime),
                name
            );
            if s.is_symlink() {
                line.push_str(" -> ");
                line.push_str(&String::from_utf8_lossy(&fs.readlink(target)?));
            }
            writeln!(out, "{line}")?;
        } else {
            writeln!(out, "{name}")?;
        }
    }
    Ok(())
}

pub fn cat(a: CatArgs) -> CliResult {
    let fs = open_fs(&a.image)?;
    let ino = a.start.resolve(&fs, &a.path)?;
    let st = fs.stat(ino)?;
    if !st.is_reg() {
        return Err(CliError(format!(
            "{} is not a regular file",
            a.path.to_string_lossy()
        )));
    }
    let out = std::io::stdout();
    let mut out = out.lock();
    let chunk = 1 << 20;
    let mut off = 0u64;
    while off < st.size {
        let buf = fs.read(ino, off, chunk)?;
        if buf.is_empty() {
            break;
        }
        out.write_all(&buf)?;
        off += buf.len() as u64;
    }
    Ok(())
}

pub fn subvolumes(a: SubvolArgs) -> CliResult {
    let fs = open_fs(&a.image)?;
    let out = std::io::stdout();
    let mut out = out.lock();
    for s in fs.list_subvolumes()? {
        if a.readonly && s.item.flags & butter::format::ROOT_SUBVOL_RDONLY == 0 {
            continue;
        }
        // btrfs-progs' column order, whatever the order of the options.
        let mut line = format!("ID {} gen {} ", s.id, s.item.generation);
        if a.cgen {
            line.push_str(&format!("cgen {} ", s.item.otransid));
        }
        if a.parent {
            line.push_str(&format!("parent {} ", s.parent));
        }
        line.push_str(&format!("top level {} ", s.parent));
        for (on, name, u) in [
            (a.parent_uuid, "parent_uuid", &s.item.parent_uuid),
            (a.received_uuid, "received_uuid", &s.item.received_uuid),
            (a.uuid, "uuid", &s.item.uuid),
        ] {
            if on {
                line.push_str(&format!("{name} {:<36} ", uuid_or_dash(u)));
            }
        }
        line.push_str("path ");
        let mut bytes = line.into_bytes();
        bytes.extend_from_slice(&s.path);
        bytes.push(b'\n');
        out.write_all(&bytes)?;
    }
    Ok(())
}
