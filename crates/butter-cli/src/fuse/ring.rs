//! FUSE over io_uring: the transport the kernel offers (Linux 6.14 and later, when root has
//! set `/sys/module/fuse/parameters/enable_uring` to Y) beside `/dev/fuse`. Each CPU gets a
//! queue: a thread pinned to it with its own io_uring, and [`DEPTH`] entries (a header
//! buffer and a payload buffer each) registered with the kernel. A request from a program
//! running on that CPU lands in a free entry of that CPU's queue and completes the entry's
//! outstanding command; the thread serves it (crate::fuse::wire, then the adapter's
//! operation) and commits the reply with the command that also fetches the entry's next
//! request: one system call per request and no read or write of `/dev/fuse` in between.
//! `docs/fuse-over-io-uring.md` has the protocol and the measurements behind it.
//!
//! What stays on `/dev/fuse`: INIT (before the queues exist), FORGET and INTERRUPT, and
//! notifications; fuser's loops keep serving those.
//!
//! Failure: the kernel holds every request while the queues are incomplete, so a mount
//! whose queues fail to start would hang. [`start`] therefore waits until every queue has
//! registered its entries; if one fails, it sends one registration the kernel must refuse,
//! which turns the ring off for the connection, and the mount carries on through
//! `/dev/fuse`.

use super::wire::{self, Args, InHeader, IN_HEADER};
use super::Adapter;
use fuser::{InitFlags, KernelConfig};
use io_uring::{cqueue, opcode, squeue, types, IoUring};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

/// Whether a mount uses FUSE over io_uring (`-o uring=auto|on|off`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Uring {
    /// When the kernel offers it.
    #[default]
    Auto,
    /// As auto, with a warning when the kernel does not offer it.
    On,
    /// Never: `/dev/fuse` only.
    Off,
}

impl std::str::FromStr for Uring {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Uring::Auto),
            "on" => Ok(Uring::On),
            "off" => Ok(Uring::Off),
            _ => Err(format!("uring={s}: expected auto, on or off")),
        }
    }
}

/// Entries per queue at most: requests the kernel can hand a queue before it waits for one.
/// Fewer on hosts with many CPUs ([`depth`]): each entry has a payload buffer of [`PAYLOAD`].
const DEPTH: usize = 4;

/// Entries per queue for `queues` queues: [`DEPTH`] up to 4 CPUs, down to 2 from 8 on, so
/// the buffers stay near 16 MiB of address space or 2 entries a CPU.
fn depth(queues: usize) -> usize {
    (16 / queues.max(1)).clamp(2, DEPTH)
}
/// Helper threads per queue, for requests that may wait (fsync) or move much data.
const HELPERS_PER_QUEUE: usize = 2;
/// `struct fuse_uring_req_header`: in_out (128), op_in (128), ring_ent_in_out (32).
const HEADER_SIZE: usize = 288;
const OP_IN: usize = 128;
const OP_IN_SIZE: usize = 128;
const ENT_COMMIT_ID: usize = 256 + 8;
const ENT_PAYLOAD_SZ: usize = 256 + 16;
/// The payload buffer: at least the kernel's largest request or reply (max_write, and
/// max_pages of 4 KiB).
const PAYLOAD: usize = super::MAX_WRITE as usize + 4096;
/// enum fuse_uring_cmd.
const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;
/// user_data of the stop event's poll.
const STOP: u64 = u64::MAX;
/// user_data of the poll of the eventfd helpers wake a queue with.
const HELPED: u64 = u64::MAX - 1;

/// The io_uring side of a mount.
#[derive(Default)]
pub(crate) struct Ring {
    mode: Uring,
    /// The kernel agreed in INIT: the queues must start.
    negotiated: AtomicBool,
    /// Each queue's thread and the eventfd that stops it.
    queues: Mutex<Vec<(JoinHandle<()>, OwnedFd)>>,
    /// The helper threads; they end when the last queue has ended.
    helpers: Mutex<Vec<JoinHandle<()>>>,
}

impl Ring {
    pub(crate) fn new(mode: Uring) -> Self {
        Ring {
            mode,
            ..Ring::default()
        }
    }

    /// Stops the queues' threads and waits for them (the session's end).
    pub(crate) fn stop(&self) {
        let queues = std::mem::take(&mut *self.queues.lock().unwrap_or_else(|e| e.into_inner()));
        for (_, efd) in &queues {
            wake(efd.as_raw_fd());
        }
        for (t, _) in queues {
            let _ = t.join();
        }
        let helpers = std::mem::take(&mut *self.helpers.lock().unwrap_or_else(|e| e.into_inner()));
        for t in helpers {
            let _ = t.join();
        }
    }
}

fn wake(efd: RawFd) {
    let one = 1u64.to_ne_bytes();
    // SAFETY: writes 8 bytes from a live buffer to an eventfd we own.
    unsafe { libc::write(efd, one.as_ptr().cast(), 8) };
}

/// INIT: asks for FUSE_OVER_IO_URING when the mount wants it, the kernel offers it and this
/// process can build the rings.
pub(crate) fn negotiate(a: &Adapter, config: &mut KernelConfig) {
    let mode = a.ring.mode;
    if mode == Uring::Off {
        return;
    }
    if !config
        .capabilities()
        .contains(InitFlags::FUSE_OVER_IO_URING)
    {
        if mode == Uring::On {
            log::warn!(
                "-o uring: the kernel does not offer FUSE over io_uring (Linux 6.14 or later, \
                 and as root: echo Y > /sys/module/fuse/parameters/enable_uring); serving \
                 through /dev/fuse"
            );
        }
        return;
    }
    if let Err(e) = preflight() {
        log::warn!("FUSE over io_uring is offered but io_uring cannot serve it here ({e}); serving through /dev/fuse");
        return;
    }
    if config
        .add_capabilities(InitFlags::FUSE_OVER_IO_URING)
        .is_ok()
    {
        a.ring.negotiated.store(true, Ordering::SeqCst);
    }
}

/// A ring with 128-byte entries and the command opcode, as the queues need.
fn preflight() -> std::io::Result<()> {
    let ring: IoUring<squeue::Entry128, cqueue::Entry> = IoUring::builder().build(2)?;
    let mut probe = io_uring::Probe::new();
    ring.submitter().register_probe(&mut probe)?;
    if probe.is_supported(opcode::UringCmd80::CODE) {
        Ok(())
    } else {
        Err(std::io::Error::other("no IORING_OP_URING_CMD"))
    }
}

/// The number of queues the kernel makes: one per possible CPU.
fn possible_cpus() -> std::io::Result<usize> {
    let s = std::fs::read_to_string("/sys/devices/system/cpu/possible")?;
    let mut max = None;
    for part in s.trim().split(',') {
        let last = part.rsplit('-').next().unwrap_or(part);
        let n: usize = last
            .parse()
            .map_err(|_| std::io::Error::other(format!("odd cpu list {s:?}")))?;
        max = max.max(Some(n));
    }
    max.map(|m| m + 1)
        .ok_or_else(|| std::io::Error::other("empty cpu list"))
}

/// Starts the queues once INIT is answered (the session exists), when the kernel agreed.
/// Returns when every queue has registered its entries, or the ring was turned off again
/// and requests go through `/dev/fuse`; an error only when neither worked (the mount
/// cannot serve anything).
pub(crate) fn start(a: &Arc<Adapter>, fuse: BorrowedFd<'_>) -> std::io::Result<()> {
    if !a.ring.negotiated.load(Ordering::SeqCst) {
        return Ok(());
    }
    let fd = Arc::new(fuse.try_clone_to_owned()?);
    let started = possible_cpus().and_then(|n| {
        let (tx, helpers) = spawn_helpers(a, HELPERS_PER_QUEUE * n)?;
        *a.ring.helpers.lock().unwrap_or_else(|e| e.into_inner()) = helpers;
        // The queues hold the only senders: the helpers end after the last queue.
        start_queues(a, &fd, n, tx)
    });
    match started {
        Ok(queues) => {
            log::info!(
                "serving through FUSE over io_uring: {} queues of {}",
                queues.len(),
                depth(queues.len())
            );
            *a.ring.queues.lock().unwrap_or_else(|e| e.into_inner()) = queues;
            Ok(())
        }
        Err(e) => {
            a.ring.stop();
            log::warn!("FUSE over io_uring did not start ({e}); serving through /dev/fuse");
            refuse_ring(&fd)
        }
    }
}

fn start_queues(
    a: &Arc<Adapter>,
    fd: &Arc<OwnedFd>,
    n: usize,
    helpers: mpsc::Sender<Job>,
) -> std::io::Result<Vec<(JoinHandle<()>, OwnedFd)>> {
    let n = u16::try_from(n).map_err(|_| std::io::Error::other("too many CPUs"))?;
    let mut queues = Vec::new();
    let mut failed = None;
    for qid in 0..n {
        // SAFETY: eventfd returns a new descriptor or -1.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if efd < 0 {
            failed = Some(std::io::Error::last_os_error());
            break;
        }
        // SAFETY: a descriptor just made and owned by nobody else.
        let efd = unsafe { OwnedFd::from_raw_fd(efd) };
        let (tx, rx) = mpsc::channel();
        let (a, fd, stop, helpers) = (a.clone(), fd.clone(), efd.as_raw_fd(), helpers.clone());
        let t = std::thread::Builder::new()
            .name(format!("butter-ring-{qid}"))
            .spawn(move || match Queue::new(&fd, (qid, n), stop, helpers) {
                Ok(mut q) => {
                    let _ = tx.send(Ok(()));
                    q.run(&a);
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                }
            })?;
        let r = rx
            .recv()
            .unwrap_or_else(|_| Err(std::io::Error::other("queue thread ended")));
        queues.push((t, efd));
        if let Err(e) = r {
            failed = Some(std::io::Error::other(format!("queue {qid}: {e}")));
            break;
        }
    }
    match failed {
        None => Ok(queues),
        Some(e) => {
            for (_, efd) in &queues {
                wake(efd.as_raw_fd());
            }
            for (t, _) in queues {
                let _ = t.join();
            }
            Err(e)
        }
    }
}

/// Turns the ring off for the connection: a registration with a queue number the kernel
/// does not have fails, and a failed registration makes the kernel serve the connection
/// through `/dev/fuse` again (it wakes the requests it held).
fn refuse_ring(fd: &Arc<OwnedFd>) -> std::io::Result<()> {
    let n = possible_cpus().unwrap_or(u16::MAX as usize - 1);
    let qid = u16::try_from(n).unwrap_or(u16::MAX);
    let mut q = Queue::bare(fd, qid)?;
    let mut e = Entry::new()?;
    q.push(e.register_sqe(fd_index(), qid, 0))?;
    q.ring.submit_and_wait(1)?;
    let res = q.ring.completion().next().map(|c| c.result());
    drop(e); // the buffers lived until the kernel answered
    match res {
        Some(r) if r < 0 => Ok(()),
        _ => Err(std::io::Error::other(
            "the kernel took a registration it should have refused; the mount cannot serve",
        )),
    }
}

fn fd_index() -> types::Fixed {
    types::Fixed(0)
}

/// A page-aligned buffer the kernel reads and writes between a command and its completion.
struct Buf(NonNull<u8>, Layout);

// SAFETY: a plain heap allocation; the queue thread that owns it is the only user (the
// kernel writes it only while that thread waits for the entry's completion).
unsafe impl Send for Buf {}

impl Buf {
    fn new(size: usize) -> std::io::Result<Buf> {
        let layout = Layout::from_size_align(size, 4096).map_err(std::io::Error::other)?;
        // SAFETY: a non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        NonNull::new(p)
            .map(|p| Buf(p, layout))
            .ok_or_else(|| std::io::Error::other("out of memory for a ring buffer"))
    }

    fn ptr(&self) -> *mut u8 {
        self.0.as_ptr()
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in Buf::new.
        unsafe { dealloc(self.0.as_ptr(), self.1) }
    }
}

/// One entry of a queue: its two buffers, the iovecs that name them to the kernel, and the
/// reply being built.
struct Entry {
    header: Buf,
    payload: Buf,
    iov: Box<[libc::iovec; 2]>,
    body: Vec<u8>,
}

impl Entry {
    fn new() -> std::io::Result<Entry> {
        let header = Buf::new(4096)?;
        let payload = Buf::new(PAYLOAD)?;
        let iov = Box::new([
            libc::iovec {
                iov_base: header.ptr().cast(),
                iov_len: HEADER_SIZE,
            },
            libc::iovec {
                iov_base: payload.ptr().cast(),
                iov_len: PAYLOAD,
            },
        ]);
        Ok(Entry {
            header,
            payload,
            iov,
            body: Vec::new(),
        })
    }

    /// The command that hands this entry to the kernel the first time.
    fn register_sqe(&mut self, fd: types::Fixed, qid: u16, user_data: u64) -> squeue::Entry128 {
        let mut sqe = opcode::UringCmd80::new(fd, CMD_REGISTER)
            .cmd(command(0, qid))
            .addr(Some(self.iov.as_ptr() as u64))
            .build()
            .user_data(user_data);
        // The iovec count goes in the SQE's len field (offset 24), which the io-uring crate
        // has no setter for on this opcode.
        // SAFETY: Entry128 is repr(C), 128 bytes, starting with the 64-byte SQE whose u32
        // len field sits at byte 24.
        unsafe {
            let p = (&mut sqe as *mut squeue::Entry128).cast::<u8>();
            p.add(24).cast::<u32>().write_unaligned(2);
        }
        sqe
    }
}

/// `struct fuse_uring_cmd_req` in the command area: flags, commit_id, qid.
fn command(commit_id: u64, qid: u16) -> [u8; 80] {
    let mut c = [0u8; 80];
    c[8..16].copy_from_slice(&commit_id.to_le_bytes());
    c[16..18].copy_from_slice(&qid.to_le_bytes());
    c
}

/// An entry's buffers as raw pointers: what serving a request reads and writes, on the queue's
/// thread or on a helper's.
#[derive(Clone, Copy)]
struct Bufs {
    header: *mut u8,
    payload: *mut u8,
}

// SAFETY: an entry is used by one thread at a time: the queue's, or the one helper it handed
// the entry to, which gives it back through [`Helped`] before the queue touches it again.
unsafe impl Send for Bufs {}

/// The request in an entry, as far as the queue needs it before serving it.
struct Peek<'a> {
    h: InHeader,
    first: &'a [u8],
    payload_sz: usize,
}

impl Bufs {
    fn of(e: &Entry) -> Bufs {
        Bufs {
            header: e.header.ptr(),
            payload: e.payload.ptr(),
        }
    }

    /// # Safety
    /// The caller has the entry to itself: the kernel completed its command (and wrote the
    /// request) and no other thread uses it.
    unsafe fn hdr<'a>(self) -> &'a [u8] {
        std::slice::from_raw_parts(self.header, HEADER_SIZE)
    }

    /// # Safety
    /// As [`Bufs::hdr`].
    unsafe fn commit_id(self) -> u64 {
        let h = self.hdr();
        u64::from_le_bytes(
            h[ENT_COMMIT_ID..ENT_COMMIT_ID + 8]
                .try_into()
                .unwrap_or([0; 8]),
        )
    }

    /// The request's header, first argument and payload size; `None` when they make no
    /// sense (a header that does not parse, a payload larger than the buffer).
    ///
    /// # Safety
    /// As [`Bufs::hdr`].
    unsafe fn peek<'a>(self) -> Option<Peek<'a>> {
        let hdr = self.hdr();
        let payload_sz = u32::from_le_bytes(
            hdr[ENT_PAYLOAD_SZ..ENT_PAYLOAD_SZ + 4]
                .try_into()
                .unwrap_or([0; 4]),
        ) as usize;
        let h = InHeader::parse(&hdr[..IN_HEADER]).filter(|_| payload_sz <= PAYLOAD)?;
        let first_len = (h.len as usize)
            .saturating_sub(IN_HEADER + payload_sz)
            .min(OP_IN_SIZE);
        Some(Peek {
            h,
            first: &hdr[OP_IN..OP_IN + first_len],
            payload_sz,
        })
    }

    /// Serves the request in the entry and writes the reply into it (`body` is scratch).
    ///
    /// # Safety
    /// As [`Bufs::hdr`].
    unsafe fn serve(self, a: &Adapter, qid: u16, body: &mut Vec<u8>) {
        self.serve_peeked(a, qid, body, self.peek())
    }

    /// [`Bufs::serve`] with the request already peeked at (`peek`, from [`Bufs::peek`]).
    ///
    /// # Safety
    /// As [`Bufs::hdr`].
    unsafe fn serve_peeked(self, a: &Adapter, qid: u16, body: &mut Vec<u8>, peek: Option<Peek>) {
        let (unique, error) = match peek {
            Some(p) => {
                let rest = std::slice::from_raw_parts(self.payload, p.payload_sz);
                let r = wire::serve(a, &p.h, Args::new(p.first, rest), body);
                (p.h.unique, r.unwrap_or(0))
            }
            None => {
                log::error!("io_uring queue {qid}: a request whose header makes no sense");
                body.clear();
                (self.commit_id(), -libc::EIO)
            }
        };
        let (error, len) = if body.len() > PAYLOAD {
            log::error!(
                "io_uring queue {qid}: a reply of {} bytes exceeds the payload buffer",
                body.len()
            );
            (-libc::EIO, 0)
        } else {
            (error, body.len())
        };
        std::ptr::copy_nonoverlapping(body.as_ptr(), self.payload, len);
        let hdr = self.header;
        // struct fuse_out_header: len, error, unique; then the payload's size.
        hdr.cast::<u32>().write_unaligned((16 + len) as u32);
        hdr.add(4).cast::<i32>().write_unaligned(error);
        hdr.add(8).cast::<u64>().write_unaligned(unique);
        hdr.add(ENT_PAYLOAD_SZ)
            .cast::<u32>()
            .write_unaligned(len as u32);
    }
}

/// Where helpers give a queue's entries back: their indexes, and the eventfd that wakes the
/// queue's thread (its ring polls it).
struct Helped {
    list: Mutex<Vec<usize>>,
    efd: OwnedFd,
}

/// A request a queue hands to a helper thread: one that may wait (fsync) or moves much data,
/// which served on the queue's thread would hold up every request from its CPU.
pub(crate) struct Job {
    bufs: Bufs,
    i: usize,
    qid: u16,
    back: Arc<Helped>,
}

/// The helper threads: they serve the jobs of every queue.
fn spawn_helpers(
    a: &Arc<Adapter>,
    n: usize,
) -> std::io::Result<(mpsc::Sender<Job>, Vec<JoinHandle<()>>)> {
    let (tx, rx) = mpsc::channel::<Job>();
    let rx = Arc::new(Mutex::new(rx));
    let mut threads = Vec::new();
    for k in 0..n {
        let (a, rx) = (a.clone(), rx.clone());
        threads.push(
            std::thread::Builder::new()
                .name(format!("butter-help-{k}"))
                .spawn(move || {
                    let mut body = Vec::new();
                    loop {
                        let job = match rx.lock().unwrap_or_else(|e| e.into_inner()).recv() {
                            Ok(j) => j,
                            Err(_) => return,
                        };
                        // SAFETY: the queue handed this entry over and waits for it back.
                        unsafe { job.bufs.serve(&a, job.qid, &mut body) };
                        job.back
                            .list
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push(job.i);
                        wake(job.back.efd.as_raw_fd());
                    }
                })?,
        );
    }
    Ok((tx, threads))
}

/// A queue: its ring, its entries, and the eventfds that stop it and bring entries back from
/// helpers. The ring is declared first so that it is dropped (and its commands cancelled)
/// before the buffers they name.
struct Queue {
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    qid: u16,
    entries: Vec<Entry>,
    stop: RawFd,
    helped: Option<Arc<Helped>>,
    helpers: Option<mpsc::Sender<Job>>,
    /// Entries out with helpers.
    out: usize,
    done: Vec<(u64, i32)>,
}

impl Queue {
    fn bare(fd: &OwnedFd, qid: u16) -> std::io::Result<Queue> {
        let ring: IoUring<squeue::Entry128, cqueue::Entry> = IoUring::builder()
            .setup_cqsize(4 * DEPTH as u32)
            .build(2 * DEPTH as u32)?;
        ring.submitter().register_files(&[fd.as_raw_fd()])?;
        Ok(Queue {
            ring,
            qid,
            entries: Vec::new(),
            stop: -1,
            helped: None,
            helpers: None,
            out: 0,
            done: Vec::new(),
        })
    }

    /// Pins the calling thread to CPU `qid` (the kernel's deliveries to this queue run on
    /// this thread, for programs on that CPU), makes the ring and registers the entries.
    fn new(
        fd: &OwnedFd,
        (qid, queues): (u16, u16),
        stop: RawFd,
        helpers: mpsc::Sender<Job>,
    ) -> std::io::Result<Queue> {
        pin_to_cpu(qid as usize);
        let mut q = Queue::bare(fd, qid)?;
        q.stop = stop;
        // SAFETY: eventfd returns a new descriptor or -1.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if efd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        q.helped = Some(Arc::new(Helped {
            list: Mutex::new(Vec::new()),
            // SAFETY: a descriptor just made and owned by nobody else.
            efd: unsafe { OwnedFd::from_raw_fd(efd) },
        }));
        q.helpers = Some(helpers);
        for i in 0..depth(usize::from(queues)) {
            let mut e = Entry::new()?;
            let sqe = e.register_sqe(fd_index(), qid, i as u64);
            q.entries.push(e);
            q.push(sqe)?;
        }
        q.push_poll(q.stop, STOP)?;
        q.push_poll(efd, HELPED)?;
        q.ring.submit()?;
        // A registration the kernel refuses completes at once; one it takes completes only
        // with a request. The last queue's registration makes the ring ready, and requests
        // the kernel held meanwhile may land in its entries at once: those are served first.
        let early: Vec<(u64, i32)> = q
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        if let Some((_, e)) = early.iter().find(|&&(ud, r)| ud < HELPED && r < 0) {
            return Err(std::io::Error::from_raw_os_error(-e));
        }
        q.done = early;
        Ok(q)
    }

    fn push(&mut self, sqe: squeue::Entry128) -> std::io::Result<()> {
        // SAFETY: every buffer an SQE names (iovecs, header, payload) lives in
        // self.entries, heap allocations that do not move and are dropped after the ring
        // (fields drop in declaration order; closing the ring cancels its commands).
        let r = unsafe { self.ring.submission().push(&sqe) };
        if r.is_err() {
            self.ring.submit()?;
            // SAFETY: as above.
            unsafe { self.ring.submission().push(&sqe) }
                .map_err(|_| std::io::Error::other("submission queue full"))?;
        }
        Ok(())
    }

    fn push_poll(&mut self, fd: RawFd, user_data: u64) -> std::io::Result<()> {
        let poll = opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32)
            .build()
            .user_data(user_data);
        self.push(poll.into())
    }

    fn commit(&mut self, i: usize) -> std::io::Result<()> {
        // SAFETY: the entry's request was served; its header holds the commit id.
        let commit_id = unsafe { Bufs::of(&self.entries[i]).commit_id() };
        let sqe = opcode::UringCmd80::new(fd_index(), CMD_COMMIT_AND_FETCH)
            .cmd(command(commit_id, self.qid))
            .build()
            .user_data(i as u64);
        self.push(sqe)
    }

    /// Commits the entries helpers gave back; returns how many.
    fn take_helped(&mut self) -> std::io::Result<usize> {
        let Some(helped) = self.helped.clone() else {
            return Ok(0);
        };
        let mut count = [0u8; 8];
        // SAFETY: reads 8 bytes into a live buffer (the eventfd's counter, now reset).
        unsafe { libc::read(helped.efd.as_raw_fd(), count.as_mut_ptr().cast(), 8) };
        let back = std::mem::take(&mut *helped.list.lock().unwrap_or_else(|e| e.into_inner()));
        self.out -= back.len().min(self.out);
        for &i in &back {
            self.commit(i)?;
        }
        Ok(back.len())
    }

    /// Serves requests until the connection ends or [`Ring::stop`]; then waits for the
    /// entries out with helpers, which write into buffers this queue owns.
    fn run(&mut self, a: &Adapter) {
        if let Err(e) = self.serve_all(a) {
            log::error!("io_uring queue {}: {e}; the queue stops", self.qid);
        }
        self.helpers = None;
        while self.out > 0 {
            let Some(efd) = self.helped.as_ref().map(|h| h.efd.as_raw_fd()) else {
                break;
            };
            let mut p = libc::pollfd {
                fd: efd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one live pollfd.
            unsafe { libc::poll(&mut p, 1, 1000) };
            let _ = self.take_helped();
        }
    }

    fn serve_all(&mut self, a: &Adapter) -> std::io::Result<()> {
        let mut live = self.entries.len();
        // Completions that came with the registrations (Queue::new) are served first.
        let mut first = true;
        while live > 0 {
            if !std::mem::take(&mut first) || self.done.is_empty() {
                match self.ring.submit_and_wait(1) {
                    Ok(_) => {}
                    Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                    Err(e) => return Err(e),
                }
                self.done.clear();
                self.done
                    .extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
            }
            for k in 0..self.done.len() {
                let (ud, res) = self.done[k];
                match ud {
                    STOP => return Ok(()),
                    HELPED => {
                        self.take_helped()?;
                        let efd = self.helped.as_ref().map_or(-1, |h| h.efd.as_raw_fd());
                        self.push_poll(efd, HELPED)?;
                        continue;
                    }
                    _ => {}
                }
                let i = ud as usize;
                if i >= self.entries.len() {
                    continue;
                }
                match res {
                    0 => {
                        let bufs = Bufs::of(&self.entries[i]);
                        // SAFETY: the kernel completed the entry's command: it is ours.
                        let peek = unsafe { bufs.peek() };
                        let slow = peek
                            .as_ref()
                            .is_some_and(|p| wire::may_wait(&p.h, p.first, p.payload_sz));
                        if !(slow && self.hand_over(i)) {
                            let mut body = std::mem::take(&mut self.entries[i].body);
                            // SAFETY: as above.
                            unsafe { bufs.serve_peeked(a, self.qid, &mut body, peek) };
                            self.entries[i].body = body;
                            self.commit(i)?;
                        }
                    }
                    r if r == -libc::ENOTCONN || r == -libc::ECONNABORTED || r == -libc::ENODEV => {
                        live -= 1
                    }
                    r => {
                        log::error!(
                            "io_uring queue {}: entry {i} failed: {}",
                            self.qid,
                            std::io::Error::from_raw_os_error(-r)
                        );
                        live -= 1;
                    }
                }
            }
        }
        Ok(())
    }

    /// Hands entry `i` (a request that may wait or moves much data) to a helper; false when
    /// there is none to take it (the queue is ending): then it is served here.
    fn hand_over(&mut self, i: usize) -> bool {
        let bufs = Bufs::of(&self.entries[i]);
        let (Some(tx), Some(back)) = (&self.helpers, &self.helped) else {
            return false;
        };
        let job = Job {
            bufs,
            i,
            qid: self.qid,
            back: back.clone(),
        };
        if tx.send(job).is_err() {
            return false;
        }
        self.out += 1;
        true
    }
}

fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is valid; CPU_SET stays within it for cpu < CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if cpu < libc::CPU_SETSIZE as usize {
            libc::CPU_SET(cpu, &mut set);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                log::debug!(
                    "pinning io_uring queue thread to CPU {cpu}: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fewer_entries_per_queue_on_many_cpus() {
        assert_eq!([1, 2, 4, 8, 64].map(depth), [4, 4, 4, 2, 2]);
    }

    #[test]
    fn registration_commands_carry_two_iovecs_and_the_queue() {
        let mut e = Entry::new().unwrap();
        let sqe = e.register_sqe(fd_index(), 3, 7);
        // SAFETY: Entry128 is repr(C), 128 bytes.
        let b: [u8; 128] = unsafe { std::mem::transmute(sqe) };
        assert_eq!(u32::from_le_bytes(b[24..28].try_into().unwrap()), 2);
        assert_eq!(
            u64::from_le_bytes(b[16..24].try_into().unwrap()),
            e.iov.as_ptr() as u64
        );
        // struct fuse_uring_cmd_req at the command area (byte 48): qid at 16.
        assert_eq!(u16::from_le_bytes(b[64..66].try_into().unwrap()), 3);
        assert_eq!(e.iov[0].iov_len, HEADER_SIZE);
        assert!(e.iov[1].iov_len >= super::super::MAX_WRITE as usize);
    }
}
