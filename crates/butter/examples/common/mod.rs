//! What the benchmark examples share: a fresh image file to write through the library.

use butter::fs::{Fs, RwOptions};
use butter::io::device::FileDevice;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Makes a `size`-byte image file `butter-<name>-<pid>.img` in `dir` (replacing one left
/// behind), formats it with a fixed fsid and time, and opens it read-write with `rw`.
pub fn fresh_image(
    dir: &Path,
    name: &str,
    size: u64,
    rw: RwOptions,
) -> butter::Result<(PathBuf, Fs)> {
    let path = dir.join(format!("butter-{name}-{}.img", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let io = |e: std::io::Error| butter::Error::Invalid(format!("{}: {e}", path.display()));
    std::fs::File::create(&path)
        .and_then(|f| f.set_len(size))
        .map_err(io)?;
    let dev = Arc::new(FileDevice::open(&path, true).map_err(io)?);
    let opts = butter::mkfs::MkfsOptions {
        size,
        fsid: Some([7; 16]),
        time: Some(1_700_000_000),
        ..Default::default()
    };
    butter::mkfs::mkfs(dev.as_ref(), &opts)?;
    Ok((path, Fs::open_device_rw_with(dev, rw)?))
}
