//! dump-super and dump-tree (being written).
use super::CliResult;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct DumpSuperArgs {
    pub image: PathBuf,
}
#[derive(clap::Args)]
pub struct DumpTreeArgs {
    pub image: PathBuf,
}
pub fn dump_super(_a: DumpSuperArgs) -> CliResult {
    Err(super::CliError("not yet".into()))
}
pub fn dump_tree(_a: DumpTreeArgs) -> CliResult {
    Err(super::CliError("not yet".into()))
}
