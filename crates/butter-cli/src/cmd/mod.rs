//! One module per subcommand.
pub mod check;
pub mod compsize;
pub mod dump;
pub mod filesystem;
pub mod ls;
pub mod mkfs;
pub mod mount;
pub mod paths;
pub mod progress;
pub mod property;
pub mod receive;
pub mod restore;
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

/// Opens an image with a message that names it.
pub fn open_fs(image: &std::path::Path) -> Result<butter::fs::Fs, CliError> {
    butter::fs::Fs::open(image).map_err(|e| {
        CliError(format!(
            "cannot open {}: {}",
            image.display(),
            CliError::from(e)
        ))
    })
}
