//! Man pages and shell completions come from the command-line definition itself: `butter
//! manpages DIR` writes a page for butter and for every command and subcommand, each naming
//! its options; `butter completions SHELL` prints a script that knows every command.

use std::process::Command;

const BUTTER: &str = env!("CARGO_BIN_EXE_butter");

/// `butter manpages` into a fresh temporary directory named after `what`.
fn manpages(what: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("butter-man-{what}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(BUTTER)
        .arg("manpages")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    dir
}

#[test]
fn manpages_cover_every_command() {
    let dir = manpages("cover");
    for (page, needle) in [
        ("butter.1", "mkfs"),
        ("butter-mkfs.1", "rootdir"),
        ("butter-send.1", "compressed\\-data"),
        ("butter-receive.1", "dump"),
        ("butter-subvolume-delete.1", "subvolid"),
        ("butter-mount.1", "compress"),
        ("butter-filesystem-df.1", "IMAGE"),
    ] {
        let text =
            std::fs::read_to_string(dir.join(page)).unwrap_or_else(|e| panic!("{page}: {e}"));
        assert!(text.contains(".TH"), "{page} is no man page");
        assert!(text.contains(needle), "{page} does not mention {needle}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn completions_know_every_command() {
    for shell in ["bash", "zsh", "fish"] {
        let out = Command::new(BUTTER)
            .args(["completions", shell])
            .output()
            .unwrap();
        assert!(out.status.success(), "{shell}: {out:?}");
        let text = String::from_utf8_lossy(&out.stdout);
        for cmd in [
            "mkfs",
            "send",
            "receive",
            "subvolume",
            "filesystem",
            "mount",
        ] {
            assert!(text.contains(cmd), "{shell} completions lack {cmd}");
        }
    }
}

/// Every man page ends with EXAMPLES (where the command has some: every command users run)
/// and EXIT STATUS, and speaks users' words: no seeds, issue numbers or internal rules.
#[test]
fn manpages_have_examples_and_exit_status() {
    let dir = manpages("examples");
    let mut pages = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let path = e.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            text.contains(".SH \"EXIT STATUS\""),
            "{name} has no EXIT STATUS"
        );
        assert!(text.contains(".SH EXAMPLES"), "{name} has no EXAMPLES");
        for word in ["seed 0", "issue #", "the fsync rule", "Seed 0"] {
            assert!(!text.contains(word), "{name} says {word:?}");
        }
        pages += 1;
    }
    assert!(pages >= 30, "only {pages} pages");
    let mkfs = std::fs::read_to_string(dir.join("butter-mkfs.1")).unwrap();
    assert!(mkfs.contains("130"), "mkfs's exit status does not name 130");
    let check = std::fs::read_to_string(dir.join("butter-check.1")).unwrap();
    assert!(check.contains("errors were found"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `butter --help` names every job; `mkfs --help` says it fills from a directory; each
/// command's `--help` ends with examples and its exit status.
#[test]
fn help_names_the_jobs_and_shows_examples() {
    let help = |args: &[&str]| {
        let out = Command::new(BUTTER).args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let top = help(&["--help"]);
    for job in [
        "mkfs", "mount", "send", "receive", "check", "restore", "snapshot",
    ] {
        assert!(
            top.contains(job),
            "butter --help does not name {job}:\n{top}"
        );
    }
    let mkfs = help(&["mkfs", "--help"]);
    assert!(
        mkfs.contains("directory") && mkfs.contains("--rootdir"),
        "{mkfs}"
    );
    for cmd in [
        &["mkfs"][..],
        &["mount"],
        &["send"],
        &["receive"],
        &["check"],
        &["subvolume", "snapshot"],
    ] {
        let text = help(&[cmd, &["--help"]].concat());
        assert!(
            text.contains("Examples:\n  ") && text.contains("Exit status: "),
            "{cmd:?} --help has no examples or exit status:\n{text}"
        );
    }
    // -h stays short.
    assert!(!help(&["mkfs", "-h"]).contains("Examples:"));
}

/// Completion offers values: compression algorithms for `mkfs --compress`, mount options
/// for `mount -o`, checksums and profiles for mkfs.
#[test]
fn completions_offer_option_values() {
    for shell in ["bash", "zsh", "fish"] {
        let out = Command::new(BUTTER)
            .args(["completions", shell])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        for value in ["compress=zstd", "subvolid=", "nodelalloc", "xxhash", "dup"] {
            assert!(
                text.contains(value),
                "{shell} completions do not offer {value}"
            );
        }
        // zsh escapes the colon.
        assert!(
            text.contains("zstd:3") || text.contains("zstd\\:3"),
            "{shell} completions do not offer zstd:3"
        );
    }
    // Values outside the list are still taken (and checked by the command).
    let out = Command::new(BUTTER)
        .args([
            "mkfs",
            "--compress",
            "zstd:-7",
            "--rootdir",
            "/nonexistent",
            "/tmp/none.img",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("invalid value"), "{err}");
}

/// The README warns that the kernel can loop-mount an image a butter mount holds (nothing in
/// a regular file can stop it), and says what to do before a kernel mount and after a clash.
#[test]
fn readme_warns_about_a_kernel_mount_of_a_held_image() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    let at = readme
        .find("the one butter cannot stop")
        .expect("the README has no warning about the kernel mounting a held image");
    let para = &readme[at..readme[at..].find("\n\n").map_or(readme.len(), |e| at + e)];
    for needle in [
        "mount -o loop",
        "butter unmount",
        "butter check",
        "btrfs check",
    ] {
        assert!(
            para.contains(needle),
            "the warning does not mention {needle}:\n{para}"
        );
    }
}
