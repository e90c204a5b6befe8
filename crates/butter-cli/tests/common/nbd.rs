//! NBD servers for tests, serving an image file on loopback with no root: nbdkit (over TCP
//! on 127.0.0.1 or a Unix socket, with its filters), qemu-nbd and nbd-server (over TCP).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// An NBD server process, killed when dropped.
pub struct Server {
    child: Child,
    /// The address butter is given.
    pub addr: String,
    /// A server that daemonizes (nbd-server): the file its daemon's pid is in.
    pidfile: Option<std::path::PathBuf>,
}

/// A TCP port of 127.0.0.1 that was free a moment ago.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Server {
    /// nbdkit serving `img` (`filter` args before the plugin) on a free TCP port of
    /// 127.0.0.1, or on the Unix socket `unix`.
    pub fn start(img: &Path, unix: Option<&Path>, filter: &[&str], plugin_args: &[&str]) -> Server {
        let mut cmd = Command::new("nbdkit");
        cmd.args(["--foreground", "--exit-with-parent"]);
        let addr = match unix {
            Some(sock) => {
                cmd.arg("--unix").arg(sock);
                format!("nbd+unix:///export?socket={}", sock.display())
            }
            None => {
                let port = std::net::TcpListener::bind("127.0.0.1:0")
                    .unwrap()
                    .local_addr()
                    .unwrap()
                    .port();
                cmd.args(["--ipaddr", "127.0.0.1", "--port", &port.to_string()]);
                format!("nbd://127.0.0.1:{port}/export")
            }
        };
        cmd.args(filter)
            .arg("file")
            .arg(format!("file={}", img.display()))
            .args(plugin_args)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = cmd.spawn().expect("start nbdkit");
        let s = Server {
            child,
            addr,
            pidfile: None,
        };
        s.wait_ready(unix);
        s
    }

    /// qemu-nbd (Debian's qemu-utils) serving `img` as a raw image on a free TCP port.
    pub fn qemu(img: &Path) -> Server {
        let port = free_port();
        let child = Command::new("qemu-nbd")
            .args([
                "-f",
                "raw",
                "-x",
                "export",
                "-b",
                "127.0.0.1",
                "--persistent",
            ])
            .args(["-p", &port.to_string()])
            .arg(img)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start qemu-nbd");
        let s = Server {
            child,
            addr: format!("nbd://127.0.0.1:{port}/export"),
            pidfile: None,
        };
        s.wait_ready(None);
        s
    }

    /// nbd-server (Debian's nbd-server) serving `img` on a free TCP port, with flush and FUA;
    /// its configuration and pid file go in `dir`.
    pub fn nbd_server(img: &Path, dir: &Path) -> Server {
        let port = free_port();
        let conf = dir.join(format!("nbd-server-{port}.conf"));
        let pidfile = dir.join(format!("nbd-server-{port}.pid"));
        std::fs::write(
            &conf,
            format!(
                "[generic]\nlistenaddr = 127.0.0.1\nport = {port}\nallowlist = false\n\
                 [export]\nexportname = {}\nflush = true\nfua = true\n",
                img.display()
            ),
        )
        .unwrap();
        // It daemonizes: the process started here ends once the daemon is up.
        let child = Command::new("nbd-server")
            .arg("-C")
            .arg(&conf)
            .arg("-p")
            .arg(&pidfile)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nbd-server");
        let s = Server {
            child,
            addr: format!("nbd://127.0.0.1:{port}/export"),
            pidfile: Some(pidfile),
        };
        s.wait_ready(None);
        s
    }

    fn wait_ready(&self, unix: Option<&Path>) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let up = match unix {
                Some(p) => std::os::unix::net::UnixStream::connect(p).is_ok(),
                None => {
                    let hp = self.addr.trim_start_matches("nbd://");
                    let hp = hp.split('/').next().unwrap();
                    std::net::TcpStream::connect(hp).is_ok()
                }
            };
            if up {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "nbdkit did not come up at {}",
                self.addr
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(p) = &self.pidfile {
            if let Some(pid) = std::fs::read_to_string(p)
                .ok()
                .and_then(|t| t.trim().parse::<i32>().ok())
            {
                // SAFETY: kill has no memory effects; the pid is the daemon this test started.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
    }
}
