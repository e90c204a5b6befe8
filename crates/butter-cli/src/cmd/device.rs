//! `butter device add IMAGE DEVICE...`: a new device joins the filesystem offline, as `btrfs
//! device add` does on a mount. Nothing is moved onto it (that is balance): new chunks use its
//! space once the filesystem is opened with it (`--device`).

use super::{CliError, CliResult};
use std::path::{Path, PathBuf};

#[derive(clap::Subcommand)]
pub enum DeviceCmd {
    /// Add DEVICE (image files, block devices or NBD exports) to the filesystem on IMAGE (give
    /// its other devices with --device); each gets the next devid.
    Add {
        /// Overwrite a device that holds a filesystem.
        #[arg(short = 'f', long = "force")]
        force: bool,
        /// Accepted for btrfs-progs' spelling (butter never discards).
        #[arg(short = 'K', long = "nodiscard")]
        nodiscard: bool,
        /// Image file or block device of the filesystem.
        image: PathBuf,
        /// The devices to add.
        #[arg(required = true)]
        devices: Vec<PathBuf>,
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
    }
}

/// Opens a device to add: an NBD export, or a file or block device for writing, alone.
fn open_new(p: &Path) -> Result<std::sync::Arc<dyn butter::io::device::BlockDevice>, CliError> {
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
    let fs = super::open_fs_rw(image, Default::default()).map_err(|e| {
        CliError(format!(
            "cannot open {}: {}",
            image.display(),
            CliError::from(e)
        ))
    })?;
    for (p, dev) in new {
        let size = dev.len();
        let devid = fs
            .add_device(dev)
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
