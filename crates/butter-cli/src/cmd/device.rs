//! `butter device add|remove|replace IMAGE ...`, offline, as `btrfs device add|remove` and
//! `btrfs replace` do on a mount; given the mount point of a running `butter mount` instead
//! of IMAGE, each runs in the mount through the kernel's ioctl for it. Add: nothing is moved
//! onto the new device (that is balance); new chunks may use its space at once. Remove: the
//! device's block groups are relocated to the others first. Replace: the target is added and
//! the source removed; unlike the kernel's replace, the target gets the next devid rather
//! than the source's.

use super::{CliError, CliResult};
use std::path::{Path, PathBuf};

#[derive(clap::Subcommand)]
pub enum DeviceCmd {
    /// Add DEVICE (image files, block devices or NBD exports) to the filesystem on IMAGE (give
    /// its other devices with --device), or to a running `butter mount` (IMAGE is then its
    /// mount point); each gets the next devid.
    Add {
        /// Overwrite a device that holds a filesystem.
        #[arg(short = 'f', long = "force")]
        force: bool,
        /// Accepted for btrfs-progs' spelling (butter never discards).
        #[arg(short = 'K', long = "nodiscard")]
        nodiscard: bool,
        /// Image file or block device of the filesystem, or the mount point of a running
        /// `butter mount`.
        image: PathBuf,
        /// The devices to add.
        #[arg(required = true)]
        devices: Vec<PathBuf>,
    },
    /// Remove devices (by path, devid or `missing`) that hold no chunk from the filesystem on
    /// IMAGE (give its other devices with --device); their superblocks are wiped.
    #[command(alias = "delete")]
    Remove {
        /// Image file or block device of the filesystem, or the mount point of a running `butter mount` (the removal then runs in the mount, between its
        /// other operations).
        image: PathBuf,
        /// The devices to remove: a path given with --device, a devid, or `missing`.
        #[arg(required = true)]
        devices: Vec<String>,
    },
    /// Replace device SOURCE (a path given with --device, a devid, or `missing` on a
    /// degraded filesystem) by TARGET: TARGET joins with the next devid, everything on
    /// SOURCE is relocated (onto TARGET and the others, rebuilt from the other copies where
    /// SOURCE is missing), and SOURCE leaves.
    Replace {
        /// Overwrite a TARGET that holds a filesystem.
        #[arg(short = 'f', long = "force")]
        force: bool,
        /// Image file or block device of the filesystem, or the mount point of a running
        /// `butter mount` (the replace then runs in the mount, between its other operations).
        image: PathBuf,
        /// The device to replace.
        source: String,
        /// The device that takes its place.
        target: PathBuf,
    },
}

#[derive(clap::Args)]
pub struct DeviceArgs {
    #[command(subcommand)]
    pub cmd: DeviceCmd,
}

pub fn device(a: DeviceArgs) -> CliResult {
    match a.cmd {
        DeviceCmd::Add {
            force,
            nodiscard: _,
            image,
            devices,
        } => add(&image, &devices, force),
        DeviceCmd::Remove { image, devices } => remove(&image, &devices),
        DeviceCmd::Replace {
            force,
            image,
            source,
            target,
        } => replace(&image, &source, &target, force),
    }
}

/// The devids `which` names (paths given with --device, devids, `missing`).
fn resolve(fs: &butter::fs::Fs, which: &[String]) -> Result<Vec<u64>, CliError> {
    let devs = fs.devices()?;
    let canon = |p: &str| std::fs::canonicalize(p).unwrap_or_else(|_| PathBuf::from(p));
    let mut ids = Vec::new();
    for w in which {
        let found = if w == "missing" {
            devs.iter()
                .find(|d| d.path.is_none() && !ids.contains(&d.devid))
        } else if let Ok(id) = w.parse::<u64>() {
            devs.iter().find(|d| d.devid == id)
        } else {
            devs.iter()
                .find(|d| d.path.as_deref().is_some_and(|p| canon(p) == canon(w)))
        };
        let Some(d) = found else {
            return Err(CliError(format!(
                "{w} is not a device of the filesystem (give a devid, a path given with \
                 --device, or missing)"
            )));
        };
        ids.push(d.devid);
    }
    Ok(ids)
}

/// Device removal through a running butter mount (IMAGE is its mount point): the kernel's
/// BTRFS_IOC_RM_DEV_V2, which the mount serves; devids, `missing` or device paths.
fn remove_mounted(dir: &Path, which: &[String]) -> CliResult {
    const BTRFS_IOC_RM_DEV_V2: u32 = 0x5000_943a;
    const BTRFS_DEVICE_SPEC_BY_ID: u64 = 1 << 3;
    for w in which {
        let mut args = vec![0u8; 4096];
        match w.parse::<u64>() {
            Ok(id) => {
                args[16..24].copy_from_slice(&BTRFS_DEVICE_SPEC_BY_ID.to_le_bytes());
                args[56..64].copy_from_slice(&id.to_le_bytes());
            }
            Err(_) => {
                // As the mount can find it (it runs elsewhere).
                let name = if w == "missing" {
                    w.clone()
                } else {
                    absolute(Path::new(w))?
                };
                args[56..56 + name.len()].copy_from_slice(name.as_bytes());
            }
        }
        let mut line = super::progress::StatusLine::new();
        line.show(&format!("removing device {w} through the mount"));
        let r = super::progress::dir_ioctl(dir, BTRFS_IOC_RM_DEV_V2, &mut args);
        line.end();
        r.map_err(|e| {
            CliError(format!(
                "cannot remove device {w} through the mount at {}: {e}",
                dir.display()
            ))
        })?;
        println!("Removed device {w}");
    }
    Ok(())
}

fn remove(image: &Path, which: &[String]) -> CliResult {
    if image.is_dir() {
        return remove_mounted(image, which);
    }
    let fs = super::subvol::open_rw(image)?;
    let ids = resolve(&fs, which)?;
    for id in ids {
        let mut line = super::progress::StatusLine::new();
        let r = fs.remove_device(id, &mut |m| line.show(m));
        line.end();
        r.map_err(|e| CliError(format!("cannot remove device {id}: {}", CliError::from(e))))?;
        println!("Removed device {id}");
    }
    fs.close()?;
    Ok(())
}

/// Opens a device to add: an NBD export, or a file or block device for writing, alone.
pub(crate) fn open_new(
    p: &Path,
) -> Result<std::sync::Arc<dyn butter::io::device::BlockDevice>, CliError> {
    if let Some(addr) = p.to_str().and_then(butter::io::nbd::Address::parse) {
        let addr = addr.map_err(|e| CliError(format!("{}: {e}", p.display())))?;
        let d = butter::io::nbd::NbdDevice::open(&addr)
            .map_err(|e| CliError(format!("cannot connect to {}: {e}", p.display())))?;
        if !d.writable() {
            return Err(CliError(format!(
                "{}: the NBD server exports it read-only",
                p.display()
            )));
        }
        return Ok(std::sync::Arc::new(d));
    }
    let d = butter::io::device::FileDevice::open_exclusive(p)
        .map_err(|e| CliError(format!("cannot open {} for writing: {e}", p.display())))?;
    Ok(std::sync::Arc::new(d))
}

fn add(image: &Path, devices: &[PathBuf], force: bool) -> CliResult {
    if image.is_dir() {
        return add_mounted(image, devices, force);
    }
    let canon = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let mut members: Vec<PathBuf> = vec![canon(image)];
    members.extend(super::other_devices().paths.iter().map(|p| canon(p)));
    // Every device checked before anything is written.
    let mut new = Vec::with_capacity(devices.len());
    for (i, p) in devices.iter().enumerate() {
        if members.contains(&canon(p)) || devices[..i].iter().any(|q| canon(q) == canon(p)) {
            return Err(CliError(format!(
                "{} is given twice: it is a device of the filesystem already, or named twice",
                p.display()
            )));
        }
        let dev = open_new(p)?;
        if !force {
            if let Some(sig) = butter::mkfs::existing_signature(dev.as_ref())? {
                return Err(CliError(format!(
                    "{} appears to contain an existing filesystem ({sig}); use -f to \
                     overwrite it",
                    p.display()
                )));
            }
        }
        new.push((p, dev));
    }
    let fs = super::subvol::open_rw(image)?;
    for (p, dev) in new {
        let size = dev.len();
        let devid = fs
            .add_device(dev, &canon(p).display().to_string())
            .map_err(|e| CliError(format!("cannot add {}: {}", p.display(), CliError::from(e))))?;
        println!(
            "Added device {devid} ({}), {}: open the filesystem with --device {} from now on",
            p.display(),
            super::mkfs::human(size),
            p.display()
        );
    }
    fs.close()?;
    Ok(())
}

fn replace(image: &Path, source: &str, target: &Path, force: bool) -> CliResult {
    if image.is_dir() {
        return replace_mounted(image, source, target, force);
    }
    let canon = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let mut members: Vec<PathBuf> = vec![canon(image)];
    members.extend(super::other_devices().paths.iter().map(|p| canon(p)));
    if members.contains(&canon(target)) {
        return Err(CliError(format!(
            "{} is a device of the filesystem already",
            target.display()
        )));
    }
    let dev = open_new(target)?;
    if !force {
        if let Some(sig) = butter::mkfs::existing_signature(dev.as_ref())? {
            return Err(CliError(format!(
                "{} appears to contain an existing filesystem ({sig}); use -f to overwrite it",
                target.display()
            )));
        }
    }
    let fs = super::subvol::open_rw(image)?;
    let src = resolve(&fs, &[source.to_string()])?[0];
    let mut line = super::progress::StatusLine::new();
    let name = canon(target).display().to_string();
    let r = fs.replace_device(src, dev, &name, &mut |m| line.show(m));
    line.end();
    let new = r.map_err(|e| {
        CliError(format!(
            "cannot replace device {src} by {}: {}",
            target.display(),
            CliError::from(e)
        ))
    })?;
    fs.close()?;
    println!(
        "Replaced device {src} by {} (devid {new}): open the filesystem with {} (as the image \
         or with --device) from now on",
        target.display(),
        target.display()
    );
    Ok(())
}

/// A device path as the mount (another process, another working directory) can open it.
fn absolute(p: &Path) -> Result<String, CliError> {
    let abs = std::fs::canonicalize(p)
        .map_err(|e| CliError(format!("cannot find {}: {e}", p.display())))?;
    let s = abs.display().to_string();
    if s.len() >= 1024 {
        return Err(CliError(format!("{s}: the device path is too long")));
    }
    Ok(s)
}

/// Refuses a device that holds a filesystem unless `force` (before a mount is asked to add
/// it; the check opens it read-only and lets it go).
fn refuse_signature(p: &Path, force: bool) -> CliResult {
    if force {
        return Ok(());
    }
    let dev = butter::io::device::FileDevice::open(p, false)
        .map_err(|e| CliError(format!("cannot open {}: {e}", p.display())))?;
    if let Some(sig) = butter::mkfs::existing_signature(&dev)? {
        return Err(CliError(format!(
            "{} appears to contain an existing filesystem ({sig}); use -f to overwrite it",
            p.display()
        )));
    }
    Ok(())
}

/// Device add through a running butter mount (IMAGE is its mount point): the kernel's
/// BTRFS_IOC_ADD_DEV, which the mount serves; new chunks may use the device at once.
fn add_mounted(dir: &Path, devices: &[PathBuf], force: bool) -> CliResult {
    const BTRFS_IOC_ADD_DEV: u32 = 0x5000_940a;
    for p in devices {
        refuse_signature(p, force)?;
    }
    for p in devices {
        let name = absolute(p)?;
        let mut args = vec![0u8; 4096];
        args[8..8 + name.len()].copy_from_slice(name.as_bytes());
        super::progress::dir_ioctl(dir, BTRFS_IOC_ADD_DEV, &mut args).map_err(|e| {
            CliError(format!(
                "cannot add {} through the mount at {}: {e} (the mount's log says why)",
                p.display(),
                dir.display()
            ))
        })?;
        println!("Added device {name}: mount the filesystem with -o device={name} from now on");
    }
    Ok(())
}

/// Device replace through a running butter mount (IMAGE is its mount point): the kernel's
/// BTRFS_IOC_DEV_REPLACE (START), which the mount serves to the end: TARGET is added and
/// SOURCE's block groups relocated while the mount goes on serving (between its other
/// operations).
fn replace_mounted(dir: &Path, source: &str, target: &Path, force: bool) -> CliResult {
    const BTRFS_IOC_DEV_REPLACE: u32 = 0xca28_9435;
    refuse_signature(target, force)?;
    let tgt = absolute(target)?;
    let mut args = vec![0u8; 2600];
    match source.parse::<u64>() {
        Ok(id) => args[16..24].copy_from_slice(&id.to_le_bytes()),
        Err(_) => {
            let src = if source == "missing" {
                source.to_string()
            } else {
                absolute(Path::new(source))?
            };
            args[32..32 + src.len()].copy_from_slice(src.as_bytes());
        }
    }
    args[32 + 1025..32 + 1025 + tgt.len()].copy_from_slice(tgt.as_bytes());
    let mut line = super::progress::StatusLine::new();
    line.show(&format!(
        "replacing device {source} by {tgt} through the mount"
    ));
    let r = super::progress::dir_ioctl(dir, BTRFS_IOC_DEV_REPLACE, &mut args);
    line.end();
    r.map_err(|e| {
        CliError(format!(
            "cannot replace device {source} by {} through the mount at {}: {e} (the mount's \
             log says why)",
            target.display(),
            dir.display()
        ))
    })?;
    println!(
        "Replaced device {source} by {tgt}: mount the filesystem with -o device={tgt} from \
         now on"
    );
    Ok(())
}
