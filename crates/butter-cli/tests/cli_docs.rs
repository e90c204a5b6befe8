//! Man pages and shell completions come from the command-line definition itself: `butter
//! manpages DIR` writes a page for butter and for every command and subcommand, each naming
//! its options; `butter completions SHELL` prints a script that knows every command.

use std::process::Command;

const BUTTER: &str = env!("CARGO_BIN_EXE_butter");

#[test]
fn manpages_cover_every_command() {
    let dir = std::env::temp_dir().join(format!("butter-man-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(BUTTER)
        .arg("manpages")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
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
