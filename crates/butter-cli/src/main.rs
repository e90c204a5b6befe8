//! `butter`: offline tools and the FUSE front end for btrfs images.
//!
//! One module per subcommand under `cmd/`; errors become messages only here.

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
    about = "btrfs in userspace, without a kernel driver or root: make filesystem images (from a \
             directory too), mount them read-write through FUSE, snapshot, send and receive, \
             check, restore and inspect them",
    long_about = "btrfs in userspace, without a kernel driver or root: make filesystem images \
                  (mkfs, from a directory too), mount them read-write through FUSE (mount, \
                  unmount), make and delete subvolumes and snapshots (subvolume, property), \
                  send and receive snapshots as send streams (send, receive), check them \
                  (check), copy files out (restore, ls, cat), and see how space is used \
                  (filesystem, compsize) and how the trees look (dump-super, dump-tree). What \
                  butter writes the kernel's btrfs mounts and btrfs check passes; what the \
                  kernel writes butter reads and changes."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Another device of a filesystem of several devices (repeat for each): the image names
    /// one of them, these the rest, in any order.
    #[arg(long = "device", value_name = "PATH", global = true)]
    device: Vec<std::path::PathBuf>,
    /// Open a filesystem of several devices with some missing, reading the other copies or
    /// rebuilding from parity where its profiles allow (as the kernel's `-o degraded`).
    #[arg(long, global = true)]
    degraded: bool,
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
    /// Read and verify every copy and parity block, repairing from the good copies, like
    /// `btrfs scrub`.
    Scrub(cmd::scrub::ScrubArgs),
    /// Balance block groups offline with the kernel's filters: relocate, convert profiles,
    /// resume an interrupted balance (butter's or the kernel's).
    #[command(subcommand_required = true)]
    Balance(cmd::balance::BalanceArgsCli),
    /// Add, remove or replace devices offline, as `btrfs device` and `btrfs replace` do on a
    /// mount.
    #[command(subcommand_required = true)]
    Device(cmd::device::DeviceArgs),
    /// Mount an image through FUSE.
    Mount(cmd::mount::MountArgs),
    /// Unmount a butter mount; returns once its final commit is on disk.
    Unmount(cmd::unmount::UnmountArgs),
    /// Check an image read-only; exit 1 when errors are found. `--repair` mends what it can.
    Check(cmd::check::CheckArgs),
    /// Rescue commands of btrfs-progs (zero-log, super-recover, fix-device-size), each
    /// checked before it writes.
    #[command(subcommand_required = true)]
    Rescue(cmd::rescue::RescueArgs),
    /// Make a new btrfs filesystem on an image file or device, empty or holding a copy of a
    /// directory (--rootdir).
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

/// Man pages for `cmd` (the command named `path`: "", "mkfs", "subvolume snapshot") and,
/// recursively, each of its subcommands: `butter-mkfs.1`, ... Each ends with EXAMPLES and
/// EXIT STATUS.
fn write_manpages(
    cmd: &clap::Command,
    path: &str,
    prefix: &str,
    dir: &std::path::Path,
) -> cmd::CliResult {
    let name = if prefix.is_empty() {
        cmd.get_name().to_string()
    } else {
        format!("{prefix}-{}", cmd.get_name())
    };
    let man = clap_mangen::Man::new(cmd.clone().name(name.clone()));
    let mut out = Vec::new();
    man.render_title(&mut out)?;
    man.render_name_section(&mut out)?;
    man.render_synopsis_section(&mut out)?;
    man.render_description_section(&mut out)?;
    if cmd.get_arguments().any(|a| !a.is_hide_set()) {
        man.render_options_section(&mut out)?;
    }
    if cmd.has_subcommands() {
        man.render_subcommands_section(&mut out)?;
    }
    out.extend_from_slice(cmd::docs::man_sections(path).as_bytes());
    if cmd.get_version().is_some() {
        man.render_version_section(&mut out)?;
    }
    let file = dir.join(format!("{name}.1"));
    std::fs::write(&file, out)
        .map_err(|e| cmd::CliError(format!("writing {}: {e}", file.display())))?;
    for sub in cmd.get_subcommands() {
        if sub.get_name() != "help" {
            let sub_path = if path.is_empty() {
                sub.get_name().to_string()
            } else {
                format!("{path} {}", sub.get_name())
            };
            write_manpages(sub, &sub_path, &name, dir)?;
        }
    }
    Ok(())
}

/// The command-line definition with every command's examples and exit status after its
/// `--help`.
fn command_with_examples() -> clap::Command {
    fn add(cmd: clap::Command, path: &str) -> clap::Command {
        let mut cmd = match cmd::docs::help_examples(path) {
            Some(text) => cmd.after_long_help(text),
            None => cmd,
        };
        let names: Vec<String> = cmd
            .get_subcommands()
            .map(|s| s.get_name().to_string())
            .filter(|n| n != "help")
            .collect();
        for n in names {
            let sub_path = if path.is_empty() {
                n.clone()
            } else {
                format!("{path} {n}")
            };
            cmd = cmd.mut_subcommand(&n, |s| add(s, &sub_path));
        }
        cmd
    }
    add(<Cli as clap::CommandFactory>::command(), "")
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn"))
        .format_timestamp(None)
        .init();
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let parse = |args: Vec<std::ffi::OsString>| {
        let matches = command_with_examples().get_matches_from(args);
        <Cli as clap::FromArgMatches>::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
    };
    let cli = match cmd::helper::from_args(&argv) {
        cmd::helper::Helper::No => parse(argv),
        cmd::helper::Helper::Run(args) => {
            parse(std::iter::once("butter".into()).chain(args).collect())
        }
        cmd::helper::Helper::Nothing => return ExitCode::SUCCESS,
        cmd::helper::Helper::Usage(msg) => {
            eprintln!("{msg}");
            return ExitCode::FAILURE;
        }
    };
    *cmd::other_devices() = cmd::OtherDevices {
        paths: cli.device,
        degraded: cli.degraded,
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
        Command::Scrub(a) => cmd::scrub::scrub(a),
        Command::Device(a) => cmd::device::device(a),
        Command::Balance(a) => cmd::balance::balance(a),
        Command::Mount(a) => cmd::mount::mount(a),
        Command::Unmount(a) => cmd::unmount::unmount(a),
        Command::Check(a) => cmd::check::check(a),
        Command::Rescue(a) => cmd::rescue::rescue(a),
        Command::Mkfs(a) => cmd::mkfs::mkfs(a),
        Command::Manpages { dir } => std::fs::create_dir_all(&dir)
            .map_err(|e| cmd::CliError(format!("creating {}: {e}", dir.display())))
            .and_then(|()| {
                let mut top = command_with_examples();
                top.build();
                write_manpages(&top, "", "", &dir)
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
