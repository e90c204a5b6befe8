//! mount (being written).
use super::CliResult;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct MountArgs {
    pub image: PathBuf,
    pub dir: PathBuf,
}
pub fn mount(_a: MountArgs) -> CliResult {
    Err(super::CliError("not yet".into()))
}
