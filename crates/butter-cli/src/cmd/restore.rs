//! restore (being written).
use super::CliResult;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct RestoreArgs {
    pub image: PathBuf,
    pub dir: PathBuf,
}
pub fn restore(_a: RestoreArgs) -> CliResult {
    Err(super::CliError("not yet".into()))
}
