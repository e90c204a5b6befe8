//! A block device in memory for tests, benchmarks and fuzzing, built under `cfg(test)` and
//! the `internals` feature (reached as `butter::internals::RamDevice`): it can inject faults
//! (fail chosen reads or writes) and simulate a power cut by dropping writes that were not
//! followed by a flush ("live" bytes vs "durable" bytes).

use std::io;
use std::ops::Range;
use std::sync::Mutex;

use crate::io::device::BlockDevice;

/// What a [`RamDevice`] should fail.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// Reads touching any of these byte ranges fail with EIO.
    pub bad_read_ranges: Vec<Range<u64>>,
    /// Fail the write with this sequence number (0-based count of writes), and every later one
    /// if `sticky`.
    pub fail_write_at: Option<u64>,
    pub sticky: bool,
    /// Fail every flush.
    pub fail_flush: bool,
    /// The write at `fail_write_at` is a power cut: it and every later write and flush fail
    /// (the device is gone), so [`RamDevice::durable_bytes`] stays what survived the cut.
    /// Reads keep working (they show the writes that were issued before the cut).
    pub power_cut: bool,
    /// Writes of at least this many bytes take this long (a slow disk under a large write),
    /// so a test can see what runs while one is on its way.
    pub slow_writes: Option<(usize, std::time::Duration)>,
}

struct RamState {
    live: Vec<u8>,
    /// Writes since the last flush, in order: (offset, bytes before, bytes written). Undoing
    /// them from the end gives the durable image.
    pending: Vec<(u64, Vec<u8>, Vec<u8>)>,
    writes: u64,
    flushes: u64,
    /// A power cut happened: nothing reaches the device any more.
    dead: bool,
    faults: Faults,
}

/// An in-memory device with fault injection and power-cut simulation.
///
/// Power-cut model: a flush makes every completed write durable; a write not followed by a
/// completed flush may be lost. [`RamDevice::durable_bytes`] is the image when all of them are
/// lost, [`RamDevice::live_bytes`] when none is, and [`RamDevice::unflushed_writes`] lets a
/// test build anything in between.
pub struct RamDevice {
    st: Mutex<RamState>,
}

impl RamDevice {
    pub fn new(bytes: Vec<u8>) -> RamDevice {
        RamDevice {
            st: Mutex::new(RamState {
                live: bytes,
                pending: Vec::new(),
                writes: 0,
                flushes: 0,
                dead: false,
                faults: Faults::default(),
            }),
        }
    }
    fn lock(&self) -> std::sync::MutexGuard<'_, RamState> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }
    pub fn set_faults(&self, f: Faults) {
        self.lock().faults = f;
    }
    /// The bytes as they would be after a power cut now: only flushed writes survive.
    pub fn durable_bytes(&self) -> Vec<u8> {
        let st = self.lock();
        let mut img = st.live.clone();
        for (off, old, _) in st.pending.iter().rev() {
            let o = *off as usize;
            img[o..o + old.len()].copy_from_slice(old);
        }
        img
    }
    /// The bytes every reader currently sees.
    pub fn live_bytes(&self) -> Vec<u8> {
        self.lock().live.clone()
    }
    /// Writes issued since the last completed flush, in order: (offset, bytes). Applying any
    /// subset of them, in order, to [`RamDevice::durable_bytes`] gives an image a power cut
    /// now could leave (the device may persist any of them, or none).
    pub fn unflushed_writes(&self) -> Vec<(u64, Vec<u8>)> {
        self.lock()
            .pending
            .iter()
            .map(|(o, _, new)| (*o, new.clone()))
            .collect()
    }
    /// Number of writes issued so far (failed ones included).
    pub fn write_count(&self) -> u64 {
        self.lock().writes
    }
    /// Whether a power cut (see [`Faults::power_cut`]) happened.
    pub fn power_lost(&self) -> bool {
        self.lock().dead
    }
}

impl BlockDevice for RamDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let st = self.lock();
        let end = offset.checked_add(buf.len() as u64);
        let Some(end) = end.filter(|&e| e <= st.live.len() as u64) else {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "read beyond end of RAM device",
            ));
        };
        if st
            .faults
            .bad_read_ranges
            .iter()
            .any(|r| r.start < end && offset < r.end)
        {
            return Err(io::Error::other("injected read error"));
        }
        buf.copy_from_slice(&st.live[offset as usize..end as usize]);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let slow = self.lock().faults.slow_writes;
        if let Some((min, took)) = slow {
            if buf.len() >= min {
                std::thread::sleep(took);
            }
        }
        let mut st = self.lock();
        let n = st.writes;
        st.writes += 1;
        if st.dead {
            return Err(io::Error::other("device lost power"));
        }
        if let Some(at) = st.faults.fail_write_at {
            if st.faults.power_cut && n >= at {
                st.dead = true;
                return Err(io::Error::other("device lost power"));
            }
            if n == at || (st.faults.sticky && n > at) {
                return Err(io::Error::other("injected write error"));
            }
        }
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= st.live.len() as u64)
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "write beyond end of RAM device",
                )
            })? as usize;
        let o = offset as usize;
        let old = st.live[o..end].to_vec();
        st.live[o..end].copy_from_slice(buf);
        st.pending.push((offset, old, buf.to_vec()));
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        let mut st = self.lock();
        if st.dead {
            return Err(io::Error::other("device lost power"));
        }
        if st.faults.fail_flush {
            return Err(io::Error::other("injected flush error"));
        }
        st.pending.clear();
        st.flushes += 1;
        Ok(())
    }
    fn len(&self) -> u64 {
        self.lock().live.len() as u64
    }
}
