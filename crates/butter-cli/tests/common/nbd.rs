//! NBD servers for tests: nbdkit (Debian's NBD server, no root needed) serving an image file
//! on loopback, over TCP on 127.0.0.1 or a Unix socket.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// An nbdkit process, killed when dropped.
pub struct Server {
    child: Child,
    /// The address butter is given.
    pub addr: String,
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
        let s = Server { child, addr };
        s.wait_ready(unix);
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
    }
}
