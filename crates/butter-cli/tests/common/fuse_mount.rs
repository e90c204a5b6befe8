//! A read-write `butter mount IMAGE DIR` as a test fixture, and the checks every test that
//! changed an image ends with.
//!
//! - [`require`]: root, /dev/fuse, loop devices, kernel btrfs and the named tools; a skip with a
//!   notice, or a failure when `CI` is set.
//! - [`ButterMount`]: starts `butter mount` in the background, waits until the directory is a
//!   FUSE mount, and either unmounts it cleanly ([`ButterMount::unmount`], which asserts that
//!   butter exits 0) or kills butter with SIGKILL and detaches the dead mount
//!   ([`ButterMount::kill9`]). Drop cleans up whatever is left, also after a failed assertion.
//! - [`verify_image`]: `butter check`, `btrfs check --readonly`, a kernel mount, and (when given)
//!   a comparison of the kernel's view with a manifest taken on the butter mount.
//!
//! Used by fuse_pjdfstest.rs, fuse_fsx.rs and fuse_crash.rs.
//!
//! Transport: a mount whose arguments say `-o uring=on` is served through FUSE over io_uring
//! (the fuse module's `enable_uring` is Y while it mounts, under a lock shared by every test
//! process, and put back after), and [`ButterMount::start`] checks that its queues run; every
//! other mount gets `-o uring=off` and is served through /dev/fuse, whatever the module says
//! (or, with `BUTTER_TEST_URING=1` in the environment, `-o uring=on` too).

#![allow(dead_code)]

use super::kernel::{self, LoopMount};
use super::manifest::{self, CompareOpts, Manifest, TakeOpts};
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

/// The butter binary under test.
pub const BUTTER: &str = env!("CARGO_BIN_EXE_butter");

/// True when the test can run: root, /dev/fuse, loop devices, kernel btrfs, btrfs-progs,
/// `fusermount3`, and every program in `tools` (found on PATH, in /usr/local/bin or in
/// ~/.cargo/bin). Otherwise prints a notice and returns false, or panics when `CI` is set.
pub fn require(test: &str, tools: &[&str]) -> bool {
    let mut missing: Vec<String> = Vec::new();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        missing.push("root".into());
    }
    if !Path::new("/dev/fuse").exists() {
        missing.push("/dev/fuse".into());
    }
    if !Path::new("/dev/loop-control").exists() {
        missing.push("loop devices (/dev/loop-control)".into());
    }
    let btrfs_in_kernel = fs::read_to_string("/proc/filesystems")
        .map(|s| {
            s.lines()
                .any(|l| l.split_whitespace().last() == Some("btrfs"))
        })
        .unwrap_or(false);
    if !btrfs_in_kernel {
        let _ = Command::new("modprobe").arg("btrfs").output();
    }
    for tool in [
        "mkfs.btrfs",
        "btrfs",
        "losetup",
        "mount",
        "umount",
        "fusermount3",
    ]
    .iter()
    .chain(tools)
    {
        if find_tool(tool).is_none() {
            missing.push(format!("`{tool}`"));
        }
    }
    if missing.is_empty() {
        // Only now: require_privileges checks the kernel's btrfs and would print its own skip.
        return kernel::require_privileges();
    }
    let msg = format!(
        "{test} needs {} (scripts/install-deps installs the tools)",
        missing.join(", ")
    );
    if std::env::var_os("CI").is_some() {
        panic!("{msg}; CI is set, so this is a failure, not a skip");
    }
    eprintln!("SKIPPED: {msg}");
    false
}

/// Where `tool` is: on PATH, or in /usr/local/bin, /usr/sbin, /sbin, ~/.cargo/bin.
pub fn find_tool(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let home_cargo = std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo/bin"));
    std::env::split_paths(&path)
        .chain(
            ["/usr/local/bin", "/usr/sbin", "/sbin"]
                .iter()
                .map(PathBuf::from),
        )
        .chain(home_cargo)
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// Like [`find_tool`], panicking when it is missing (after [`require`] said it is there).
pub fn tool(tool: &str) -> PathBuf {
    find_tool(tool).unwrap_or_else(|| panic!("`{tool}` is not installed"))
}

/// The file system type mounted exactly on `dir` (last mount wins), from mountinfo.
pub fn mounted_type(dir: &Path) -> Option<String> {
    let dir = fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let want = dir.to_str()?.replace(' ', "\\040");
    let info = fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mut found = None;
    for line in info.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(sep) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        if fields.get(4) == Some(&want.as_str()) {
            found = fields.get(sep + 1).map(|s| s.to_string());
        }
    }
    found
}

/// The fuse module's switch for FUSE over io_uring.
const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";

/// The time a `-o uring=on` mount takes to mount: the kernel offers FUSE over io_uring
/// (enable_uring is Y), and no other test process changes that meanwhile (an exclusive lock
/// on a file every test process shares). Dropping it puts the old value back.
pub struct UringWindow {
    lock: File,
    old: String,
}

impl UringWindow {
    fn open() -> UringWindow {
        Self::open_as("Y")
    }

    /// The switch set to `value` ("Y" or "N") until dropped.
    pub fn open_as(value: &str) -> UringWindow {
        use std::os::fd::AsRawFd;
        let lock = File::create("/tmp/butter-tests-enable-uring.lock")
            .unwrap_or_else(|e| panic!("creating the enable_uring lock file: {e}"));
        // SAFETY: flock on a descriptor we own; it is released when `lock` is closed.
        assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
        // Read under the lock: another window's value is not the one to put back.
        let old = fs::read_to_string(ENABLE_URING).unwrap_or_else(|e| {
            panic!(
                "-o uring=on needs {ENABLE_URING} (Linux 6.14 or later with \
                 CONFIG_FUSE_IO_URING): {e}"
            )
        });
        fs::write(ENABLE_URING, value).unwrap_or_else(|e| panic!("setting {ENABLE_URING}: {e}"));
        UringWindow { lock, old }
    }
}

impl Drop for UringWindow {
    fn drop(&mut self) {
        let _ = fs::write(ENABLE_URING, self.old.trim());
        let _ = &self.lock;
    }
}

/// A running `butter mount IMAGE DIR ARGS...`.
pub struct ButterMount {
    child: Option<Child>,
    image: PathBuf,
    dir: PathBuf,
    log: PathBuf,
}

impl ButterMount {
    /// Starts butter (stdout and stderr to `log`) and waits up to 30 s until `dir` is a FUSE
    /// mount. Panics with butter's log if it exits first or the mount does not appear.
    pub fn start(image: &Path, dir: &Path, args: &[&str], log: &Path) -> ButterMount {
        match Self::try_start(image, dir, args, log) {
            Ok(m) => m,
            Err((st, text)) => panic!(
                "butter mount {} {} {args:?} exited ({st}) before mounting:\n{text}",
                image.display(),
                dir.display(),
            ),
        }
    }

    /// As [`ButterMount::start`], but when butter exits before mounting, returns its exit
    /// status and log instead of panicking (a refusal is an answer too).
    pub fn try_start(
        image: &Path,
        dir: &Path,
        args: &[&str],
        log: &Path,
    ) -> Result<ButterMount, (ExitStatus, String)> {
        Self::try_start_env(image, dir, args, log, &[])
    }

    /// As [`ButterMount::start`], with `env` set for butter (RUST_LOG=info, say).
    #[allow(dead_code)]
    pub fn start_env(
        image: &Path,
        dir: &Path,
        args: &[&str],
        log: &Path,
        env: &[(&str, &str)],
    ) -> ButterMount {
        match Self::try_start_env(image, dir, args, log, env) {
            Ok(m) => m,
            Err((st, text)) => panic!(
                "butter mount {} {} {args:?} exited ({st}) before mounting:\n{text}",
                image.display(),
                dir.display(),
            ),
        }
    }

    /// As [`ButterMount::try_start`], with `env` set for butter.
    pub fn try_start_env(
        image: &Path,
        dir: &Path,
        args: &[&str],
        log: &Path,
        env: &[(&str, &str)],
    ) -> Result<ButterMount, (ExitStatus, String)> {
        fs::create_dir_all(dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        let dir = fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        assert!(
            mounted_type(&dir).is_none(),
            "{} is already a mount point",
            dir.display()
        );
        let out = File::create(log).unwrap_or_else(|e| panic!("create {}: {e}", log.display()));
        let err = out.try_clone().unwrap();
        let says = |o: &str| args.iter().any(|a| a.split(',').any(|x| x.starts_with(o)));
        // BUTTER_TEST_URING=1 serves every mount that does not choose through the ring, to
        // run a whole suite over it (`BUTTER_TEST_URING=1 cargo test --test fsync_matrix`).
        let all_ring = std::env::var_os("BUTTER_TEST_URING").is_some_and(|v| v == "1");
        let uring = says("uring=on") || (all_ring && !says("uring="));
        let transport: &[&str] = if says("uring=") {
            &[]
        } else if uring {
            &["-o", "uring=on"]
        } else {
            &["-o", "uring=off"]
        };
        let window = uring.then(UringWindow::open);
        let child = Command::new(BUTTER)
            .arg("mount")
            .arg(image)
            .arg(&dir)
            .args(args)
            .args(transport)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {BUTTER}: {e}"));
        let mut me = ButterMount {
            child: Some(child),
            image: image.to_path_buf(),
            dir,
            log: log.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(t) = mounted_type(&me.dir) {
                if t.starts_with("fuse") {
                    if uring {
                        me.wait_for_ring();
                    }
                    drop(window);
                    return Ok(me);
                }
            }
            if let Some(st) = me.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                me.child = None;
                return Err((st, me.log_text()));
            }
            if Instant::now() > deadline {
                panic!(
                    "butter mount: {} not mounted after 30 s:\n{}",
                    me.dir.display(),
                    me.log_text()
                );
            }
            sleep(Duration::from_millis(20));
        }
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Waits until the mount serves through its io_uring queues (their threads run; they
    /// start once INIT is answered, just after the mount appears). Panics with butter's log
    /// if they do not.
    fn wait_for_ring(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && self.alive() {
            if self.thread_names().iter().any(|n| n == "butter-ring-0") {
                return;
            }
            sleep(Duration::from_millis(20));
        }
        panic!(
            "butter mount -o uring=on of {}: no io_uring queue threads (threads {:?}):\n{}",
            self.dir.display(),
            self.thread_names(),
            self.log_text()
        );
    }

    /// The names of the butter process's threads.
    pub fn thread_names(&self) -> Vec<String> {
        let Some(pid) = self.pid() else {
            return Vec::new();
        };
        let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
            return Vec::new();
        };
        tasks
            .flatten()
            .filter_map(|t| fs::read_to_string(t.path().join("comm")).ok())
            .map(|n| n.trim().to_string())
            .collect()
    }

    pub fn image(&self) -> &Path {
        &self.image
    }

    /// The butter process id (None once it has been reaped).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// What butter printed so far.
    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// True while the butter process runs.
    pub fn alive(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Unmounts (`fusermount3 -u`, retried while busy) and waits up to `wait` for butter to
    /// exit; returns its exit status. Panics if it does not exit in time.
    pub fn unmount_within(mut self, wait: Duration) -> ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(20);
        while mounted_type(&self.dir).is_some_and(|t| t.starts_with("fuse")) {
            let out =
                kernel::run_output(Command::new(tool("fusermount3")).arg("-u").arg(&self.dir));
            if out.status.success() {
                break;
            }
            if Instant::now() > deadline {
                panic!(
                    "fusermount3 -u {} keeps failing: {}",
                    self.dir.display(),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            sleep(Duration::from_millis(100));
        }
        let mut child = self.child.take().expect("butter already reaped");
        let deadline = Instant::now() + wait;
        loop {
            if let Some(st) = child.try_wait().unwrap_or(None) {
                return st;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "butter did not exit within {wait:?} after the unmount of {}:\n{}",
                    self.dir.display(),
                    self.log_text()
                );
            }
            sleep(Duration::from_millis(20));
        }
    }

    /// Unmounts and asserts that butter exits 0 within two minutes (the final commit).
    pub fn unmount(self) {
        let log = self.log.clone();
        let dir = self.dir.clone();
        let st = self.unmount_within(Duration::from_secs(120));
        assert!(
            st.success(),
            "butter mount of {} exited with {st} after the unmount:\n{}",
            dir.display(),
            fs::read_to_string(&log).unwrap_or_default()
        );
    }

    /// Kills butter with SIGKILL, reaps it, and detaches the dead mount (`fusermount3 -u -z`,
    /// then `umount -l`), waiting until `dir` is no longer a mount point.
    pub fn kill9(mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill(); // SIGKILL
            let _ = c.wait();
        }
        detach_dead_mount(&self.dir);
    }
}

/// Detaches whatever FUSE mount is left on `dir` after its server died.
pub fn detach_dead_mount(dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while mounted_type(dir).is_some() {
        let _ = Command::new("fusermount3")
            .args(["-u", "-z"])
            .arg(dir)
            .stderr(Stdio::null())
            .status();
        if mounted_type(dir).is_some() {
            let _ = Command::new("umount")
                .arg("-l")
                .arg(dir)
                .stderr(Stdio::null())
                .status();
        }
        if Instant::now() > deadline {
            panic!("cannot detach the dead mount on {}", dir.display());
        }
        sleep(Duration::from_millis(20));
    }
}

impl Drop for ButterMount {
    fn drop(&mut self) {
        let Some(mut c) = self.child.take() else {
            return;
        };
        // A test failed while mounted: try a clean unmount first, then force it.
        let _ = Command::new("fusermount3")
            .arg("-u")
            .arg(&self.dir)
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while matches!(c.try_wait(), Ok(None)) && Instant::now() < deadline {
            sleep(Duration::from_millis(50));
        }
        let _ = c.kill();
        let _ = c.wait();
        for _ in 0..100 {
            if mounted_type(&self.dir).is_none() {
                break;
            }
            let _ = Command::new("fusermount3")
                .args(["-u", "-z"])
                .arg(&self.dir)
                .stderr(Stdio::null())
                .status();
            let _ = Command::new("umount")
                .arg("-l")
                .arg(&self.dir)
                .stderr(Stdio::null())
                .status();
            sleep(Duration::from_millis(20));
        }
    }
}

/// The number right after `key` in `line` (a count in butter's log).
#[allow(dead_code)]
pub fn number_after(line: &str, key: &str) -> Option<u64> {
    let rest = &line[line.find(key)? + key.len()..];
    rest.trim_start()
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// `butter check IMAGE`: (exit code, stdout + stderr).
pub fn butter_check(img: &Path) -> (i32, String) {
    let out = kernel::run_output(Command::new(BUTTER).arg("check").arg(img));
    let mut s = String::from_utf8_lossy(&out.stdout).into_owned();
    s.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), s)
}

/// The checks after a test changed `img` through butter (unmounted by now): `butter check`
/// and `btrfs check --readonly` are clean, and the kernel mounts it (read-only, at
/// `kmnt`); returns the kernel's manifest. With `want` (a manifest of the butter mount taken
/// before the unmount), the kernel must show the same tree: everything a FUSE mount can
/// reproduce ([`CompareOpts::fuse`]) except atime, which reading through the kernel's page
/// cache on one side and FUSE on the other may move differently.
pub fn verify_image(img: &Path, kmnt: &Path, want: Option<&Manifest>, what: &str) -> Manifest {
    let (rc, out) = butter_check(img);
    assert_eq!(
        rc,
        0,
        "{what}: butter check {} is not clean:\n{out}",
        img.display()
    );
    let (ok, text) = kernel::btrfs_check(img);
    assert!(
        ok,
        "{what}: btrfs check --readonly {} failed:\n{text}",
        img.display()
    );
    let m = LoopMount::btrfs_ro(img, kmnt);
    let got = manifest::take(m.path(), &TakeOpts::default());
    m.unmount();
    kernel_shows(got, want, what)
}

/// The kernel's view `got` read without errors and, with `want`, the same tree as the butter
/// mount showed (everything FUSE reproduces but atime); returns it.
fn kernel_shows(got: Manifest, want: Option<&Manifest>, what: &str) -> Manifest {
    let errors = got.errors();
    assert!(
        errors.is_empty(),
        "{what}: reading the kernel mount failed:\n{}",
        errors.join("\n")
    );
    if let Some(want) = want {
        let opts = CompareOpts {
            atime: false,
            ..CompareOpts::fuse()
        };
        manifest::assert_same(
            want,
            &got,
            &opts,
            &format!("{what}: butter mount vs kernel mount"),
        );
    }
    got
}

/// [`verify_image`] for a filesystem of several devices: `images` are its device files, the
/// first named as IMAGE, `others` how butter is given the rest (their paths, or NBD
/// addresses while the servers run): `butter check` with them, `btrfs check` and a kernel
/// mount of every file.
pub fn verify_image_set(
    images: &[PathBuf],
    others: &[String],
    kmnt: &Path,
    want: Option<&Manifest>,
    what: &str,
) -> Manifest {
    if images.len() == 1 {
        return verify_image(&images[0], kmnt, want, what);
    }
    let (rc, out) = butter_check_set(&images[0], others);
    assert_eq!(rc, 0, "{what}: butter check is not clean:\n{out}");
    let (ok, text) = kernel::btrfs_check_devices(images);
    assert!(ok, "{what}: btrfs check --readonly failed:\n{text}");
    let m = kernel::MultiLoopMount::new(images, kmnt, "ro,noatime");
    let got = manifest::take(m.path(), &TakeOpts::default());
    m.unmount();
    kernel_shows(got, want, what)
}

/// `butter check IMAGE --device OTHER...`: exit code and output.
pub fn butter_check_set(img: &Path, others: &[String]) -> (i32, String) {
    let mut cmd = Command::new(BUTTER);
    cmd.arg("check").arg(img);
    for o in others {
        cmd.arg("--device").arg(o);
    }
    let out = kernel::run_output(&mut cmd);
    let mut s = String::from_utf8_lossy(&out.stdout).into_owned();
    s.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), s)
}

/// Makes a fresh btrfs image of `size` bytes with mkfs.btrfs defaults.
pub fn fresh_image(img: &Path, size: u64) {
    kernel::mkfs_btrfs::<&str>(img, size, &[]);
}

/// For a prerequisite [`require`] does not know: a notice and false, or a panic under `CI`.
pub fn missing(test: &str, what: &str) -> bool {
    let msg = format!("{test} needs {what} (scripts/install-deps sets it up)");
    if std::env::var_os("CI").is_some() {
        panic!("{msg}; CI is set, so this is a failure, not a skip");
    }
    eprintln!("SKIPPED: {msg}");
    false
}

/// Runs `cmd` with stdout and stderr to `log`, killing it after `limit`; returns its exit
/// status, or None when it was killed for taking too long.
pub fn run_logged(cmd: &mut Command, log: &Path, limit: Duration) -> Option<ExitStatus> {
    let out = File::create(log).unwrap_or_else(|e| panic!("create {}: {e}", log.display()));
    let err = out.try_clone().unwrap();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {:?}: {e}", cmd.get_program()));
    let deadline = Instant::now() + limit;
    loop {
        if let Some(st) = child.try_wait().unwrap_or(None) {
            return Some(st);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        sleep(Duration::from_millis(50));
    }
}

/// A copy of the butter binary that every user can run, in `sc` (the build tree may be in
/// /root, mode 0700, where a test that switches users could not reach it).
#[allow(dead_code)] // not every test binary switches users
pub fn butter_for_anyone(sc: &kernel::ScratchDir) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let bin = sc.dir("anyone-bin").join("butter");
    fs::copy(BUTTER, &bin).unwrap();
    for (p, mode) in [(&bin, 0o755), (&sc.join("anyone-bin"), 0o755)] {
        fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
    }
    bin
}
