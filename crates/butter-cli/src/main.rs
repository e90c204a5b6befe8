//! `butter`: offline tools and the FUSE front end for btrfs images.
//!
//! One module per subcommand under `cmd/`; errors become messages only here.

mod acl;
mod bulk;
mod cmd;
mod fuse;
mod setid;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "butter",
    version,
    about = "btrfs in userspace: read, restore and mount btrfs images"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the superblock.
    DumpSuper(cmd::dump::DumpSuperArgs),
    /// Print tree blocks, like `btrfs inspect-internal dump-tree`.
    DumpTree(cmd::dump::DumpTreeArgs),
    /// List a directory inside an image.
    Ls(cmd::ls::LsArgs),
    /// Write a file's content from an image to standard output.
    Cat(cmd::ls::CatArgs),
    /// List subvolumes and snapshots.
    Subvolumes(cmd::ls::SubvolArgs),
    /// Create, snapshot and list subvolumes.
    Subvolume(cmd::subvol::SubvolumeArgs),
    /// Get and set properties (read-only state of a subvolume), like `btrfs property`.
    Property(cmd::property::PropertyArgs),
    /// Extract a subvolume (with subvolumes below it) into a directory.
    Restore(cmd::restore::RestoreArgs),
    /// Apply a send stream to a directory of an image (or print it with --dump).
    Receive(cmd::receive::ReceiveArgs),
    /// Write read-only snapshots as a send stream, in full or incremental.
    Send(cmd::send::SendArgs),
    /// Disk usage against decoded sizes per compression type, as compsize prints them.
    Compsize(cmd::compsize::CompsizeArgs),
    /// Space use of the block groups (df, usage), of files (du) and the label, like
    /// `btrfs filesystem`.
    Filesystem(cmd::filesystem::FilesystemArgs),
    /// Mount an image through FUSE.
    Mount(cmd::mount::MountArgs),
    /// Unmount a butter mount; returns once its final commit is on disk.
    Unmount(cmd::unmount::UnmountArgs),
    /// Check an image read-only; exit 1 when errors are found.
    Check(cmd::check::CheckArgs),
    /// Make a new, empty btrfs filesystem on an image file or device.
    Mkfs(cmd::mkfs::MkfsArgs),
    /// Write a man page for butter and each of its commands into DIR (butter.1,
    /// butter-mkfs.1, butter-subvolume-delete.1, ...).
    Manpages {
        /// Directory to write the pages into (created if missing).
        dir: std::path::PathBuf,
    },
    /// Print a completion script for SHELL (bash, zsh, fish, elvish, powershell); e.g.
    /// `butter completions bash > /etc/bash_completion.d/butter`.
    Completions { shell: clap_complete::Shell },
}

/// Man pages for `cmd` and, recursively, each of its subcommands: `butter-mkfs.1`, ...
fn write_manpages(cmd: &clap::Command, prefix: &str, dir: &std::path::Path) -> cmd::CliResult {
    let name = if prefix.is_empty() {
        cmd.get_name().to_string()
    } else {
        format!("{prefix}-{}", cmd.get_name())
    };
    let page = cmd.clone().name(name.clone());
    let mut out = Vec::new();
    clap_mangen::Man::new(page).render(&mut out)?;
    let path = dir.join(format!("{name}.1"));
    std::fs::write(&path, out)
        .map_err(|e| cmd::CliError(format!("writing {}: {e}", path.display())))?;
    for sub in cmd.get_subcommands() {
        if sub.get_name() != "help" {
            write_manpages(sub, &name, dir)?;
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format_timestamp(None)
        .init();
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let cli = match cmd::helper::from_args(&argv) {
        cmd::helper::Helper::No => Cli::parse(),
        cmd::helper::Helper::Run(args) => {
            Cli::parse_from(std::iter::once("butter".into()).chain(args))
        }
        cmd::helper::Helper::Nothing => return ExitCode::SUCCESS,
        cmd::helper::Helper::Usage(msg) => {
            eprintln!("{msg}");
            return ExitCode::FAILURE;
        }
    };
    let r = match cli.command {
        Command::DumpSuper(a) => cmd::dump::dump_super(a),
        Command::DumpTree(a) => cmd::dump::dump_tree(a),
        Command::Ls(a) => cmd::ls::ls(a),
        Command::Cat(a) => cmd::ls::cat(a),
        Command::Subvolumes(a) => cmd::ls::subvolumes(a),
        Command::Subvolume(a) => cmd::subvol::subvolume(a),
        Command::Property(a) => cmd::property::property(a),
        Command::Restore(a) => cmd::restore::restore(a),
        Command::Receive(a) => cmd::receive::receive(a),
        Command::Send(a) => cmd::send::send(a),
        Command::Filesystem(a) => cmd::filesystem::filesystem(a),
        Command::Compsize(a) => cmd::compsize::compsize(a),
        Command::Mount(a) => cmd::mount::mount(a),
        Command::Unmount(a) => cmd::unmount::unmount(a),
        Command::Check(a) => cmd::check::check(a),
        Command::Mkfs(a) => cmd::mkfs::mkfs(a),
        Command::Manpages { dir } => std::fs::create_dir_all(&dir)
            .map_err(|e| cmd::CliError(format!("creating {}: {e}", dir.display())))
            .and_then(|()| {
                let mut top = <Cli as clap::CommandFactory>::command();
                top.build();
                write_manpages(&top, "", &dir)
            }),
        Command::Completions { shell } => {
            let mut top = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(shell, &mut top, "butter", &mut std::io::stdout());
            Ok(())
        }
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // A closed stderr must not turn an error into a panic.
            use std::io::Write;
            if !e.0.is_empty() {
                let _ = writeln!(std::io::stderr(), "butter: {e:#}");
            }
            ExitCode::FAILURE
        }
    }
}
