//! `butter dump-tree` / `dump-super` against `btrfs inspect-internal` on mkfs.btrfs images
//! (made with --rootdir, so no root is needed). Every line after the banner must match.

use std::path::{Path, PathBuf};
use std::process::Command;

fn have(tool: &str) -> bool {
    let ok = Command::new(tool)
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok && std::env::var_os("CI").is_some() {
        panic!("{tool} is required in CI (install btrfs-progs)");
    }
    ok
}

fn run(cmd: &mut Command) -> String {
    let o = cmd.env("TZ", "UTC").output().unwrap();
    assert!(
        o.status.success(),
        "{:?}: {}",
        cmd,
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

fn image(dir: &Path, args: &[&str]) -> PathBuf {
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("a/b")).unwrap();
    for i in 0..400 {
        std::fs::write(src.join(format!("a/f{i}")), vec![b'x'; (i * 37) % 9000]).unwrap();
    }
    std::os::unix::fs::symlink("a/b", src.join("l")).unwrap();
    // Names dump-tree escapes (space, backslash, control characters, bytes past ASCII).
    for name in ["with space", "back\\slash", "tab\tnl\n", "ünïcødé-名前"] {
        std::fs::write(src.join("a/b").join(name), b"n").unwrap();
    }
    let img = dir.join("t.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(300 << 20)
        .unwrap();
    run(Command::new("mkfs.btrfs")
        .args(["-q", "-f"])
        .args(args)
        .arg("--rootdir")
        .arg(&src)
        .arg(&img));
    img
}

#[test]
fn dump_tree_and_dump_super_match_btrfs_progs() {
    if !have("mkfs.btrfs") {
        return;
    }
    for (n, args) in [
        ("d", vec![]),
        ("n4k", vec!["--nodesize", "4096"]),
        ("x", vec!["--csum", "xxhash"]),
        ("bgt", vec!["-O", "block-group-tree"]),
    ] {
        let dir = std::env::temp_dir().join(format!("butter-dump-{n}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let img = image(&dir, &args);
        let ours = run(Command::new(env!("CARGO_BIN_EXE_butter"))
            .arg("dump-tree")
            .arg(&img));
        let theirs = run(Command::new("btrfs")
            .args(["inspect-internal", "dump-tree"])
            .arg(&img));
        let o: Vec<&str> = ours.lines().skip(1).collect();
        let t: Vec<&str> = theirs.lines().skip(1).collect();
        for (i, (a, b)) in o.iter().zip(t.iter()).enumerate() {
            assert_eq!(a.trim_end(), b.trim_end(), "{n}: dump-tree line {}", i + 2);
        }
        assert_eq!(o.len(), t.len(), "{n}: line counts");
        assert!(o.len() > 1000);
        let ours = run(Command::new(env!("CARGO_BIN_EXE_butter"))
            .args(["dump-super", "-f"])
            .arg(&img));
        let theirs = run(Command::new("btrfs")
            .args(["inspect-internal", "dump-super", "-f"])
            .arg(&img));
        assert_eq!(ours.trim_end(), theirs.trim_end(), "{n}: dump-super -f");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
