//! One module per subcommand.
pub mod balance;
pub mod check;
pub mod compsize;
pub mod device;
pub mod docs;
pub mod dump;
pub mod filesystem;
pub mod helper;
pub mod ls;
pub mod mkfs;
pub mod mount;
pub mod paths;
pub mod progress;
pub mod property;
pub mod receive;
pub mod rescue;
pub mod restore;
pub mod scrub;
pub mod send;
pub mod subvol;
pub mod unmount;

/// Errors shown to the user: a message, with what to do next where we know it.
pub type CliResult = Result<(), CliError>;

#[derive(Debug)]
pub struct CliError(pub String);

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<butter::Error> for CliError {
    fn from(e: butter::Error) -> Self {
        if let butter::Error::Io { source, .. } = &e {
            if source.kind() == std::io::ErrorKind::BrokenPipe {
                return CliError(String::new());
            }
        }
        let hint = match &e {
            butter::Error::Corrupt { .. } | butter::Error::BadChecksum { .. } => {
                "\n  the image is damaged there; `butter dump-tree` shows the block, and `butter restore` can save what is readable"
            }
            butter::Error::DataChecksum { .. } => {
                "\n  the file's data is damaged there (its checksum does not match); `butter restore` copies what is readable, and `butter check --check-data-csum` lists every damaged block"
            }
            butter::Error::Unsupported(_) => "\n  this image uses a feature butter does not handle yet",
            _ => "",
        };
        CliError(format!("{e}{hint}"))
    }
}

impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> Self {
        // The reader of our output went away (`butter ls IMG | head`): stop quietly.
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            return CliError(String::new());
        }
        CliError(e.to_string())
    }
}

/// The other devices of a filesystem of several, given with `--device PATH` (or a mount's
/// `-o device=PATH`), and whether it may be opened with some missing (`--degraded`, `-o
/// degraded`).
#[derive(Debug, Clone, Default)]
pub struct OtherDevices {
    pub paths: Vec<std::path::PathBuf>,
    pub degraded: bool,
}

static OTHER_DEVICES: std::sync::Mutex<OtherDevices> = std::sync::Mutex::new(OtherDevices {
    paths: Vec::new(),
    degraded: false,
});

/// The devices every open of this run takes besides the image (see [`OtherDevices`]).
pub fn other_devices() -> std::sync::MutexGuard<'static, OtherDevices> {
    OTHER_DEVICES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Opens an image with a message that names it.
pub fn open_fs(image: &std::path::Path) -> Result<butter::fs::Fs, CliError> {
    open_fs_opts(image, butter::fs::OpenOpts::default())
}

/// [`open_fs`] with options; the other devices and `--degraded` come from
/// [`other_devices`].
pub fn open_fs_opts(
    image: &std::path::Path,
    mut opts: butter::fs::OpenOpts,
) -> Result<butter::fs::Fs, CliError> {
    let others = other_devices().clone();
    opts.degraded |= others.degraded;
    let mut paths: Vec<&std::path::Path> = vec![image];
    paths.extend(others.paths.iter().map(|p| p.as_path()));
    butter::fs::Fs::open_paths(&paths, opts).map_err(|e| {
        CliError(format!(
            "cannot open {}: {}",
            image.display(),
            CliError::from(e)
        ))
    })
}

/// Opens an image read-write with the other devices of [`other_devices`] (and, with
/// `--degraded`, some of them missing).
pub fn open_fs_rw(
    image: &std::path::Path,
    mut opts: butter::fs::RwOptions,
) -> Result<butter::fs::Fs, butter::Error> {
    let others = other_devices().clone();
    opts.degraded |= others.degraded;
    let mut paths: Vec<&std::path::Path> = vec![image];
    paths.extend(others.paths.iter().map(|p| p.as_path()));
    butter::fs::Fs::open_rw_paths(&paths, opts)
}

/// A time in the local time zone, as btrfs-progs prints times (localtime_r and strftime).
pub struct LocalTime {
    tm: libc::tm,
}

/// Seconds since the epoch in the local time zone (TZ, else /etc/localtime); UTC where the
/// C library cannot convert them.
pub fn local_time(secs: i64) -> LocalTime {
    let t = secs as libc::time_t;
    // SAFETY: a zeroed tm is a valid value of that plain C struct; localtime_r writes only
    // into `tm`, which outlives the call, and reads only `t`.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    if unsafe { libc::localtime_r(&t, &mut tm) }.is_null() {
        // SAFETY: as above.
        unsafe { libc::gmtime_r(&t, &mut tm) };
    }
    LocalTime { tm }
}

impl LocalTime {
    /// `2024-01-31` `sep` `12:00:00` (strftime's `%F`, `%T`; `%X` in the C locale).
    pub fn date_time(&self, sep: char) -> String {
        let tm = &self.tm;
        format!(
            "{:04}-{:02}-{:02}{sep}{:02}:{:02}:{:02}",
            i64::from(tm.tm_year) + 1900,
            tm.tm_mon + 1,
            tm.tm_mday,
            tm.tm_hour,
            tm.tm_min,
            tm.tm_sec
        )
    }

    /// The offset from UTC, `+0100` (strftime's `%z`).
    pub fn zone(&self) -> String {
        let off = self.tm.tm_gmtoff / 60;
        let sign = if off < 0 { '-' } else { '+' };
        format!("{sign}{:02}{:02}", off.abs() / 60, off.abs() % 60)
    }
}
