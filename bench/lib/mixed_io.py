#!/usr/bin/env python3
"""Small operations alone and while another process streams large writes (bench/run mixed_io).

usage:
  mixed_io.py prep DIR FILES KIB
      Make DIR/readset/f000.. (FILES files of KIB KiB of random bytes), fsync each file and
      the directory. Untimed preparation for the read phases.
  mixed_io.py phase DIR OP STREAM SECONDS WARMUP STREAM_MB MAX_OPS JSON LAT [FILES KIB]
      OP: read (4 KiB random reads from the read set, O_DIRECT where the filesystem takes it)
      or create (open O_CREAT|O_EXCL, write 4 KiB, close; new files in DIR/create-alone or
      DIR/create-stream). STREAM 1: first start a second process that writes 1 MiB buffers
      (pwrite, no fsync) to DIR/stream.bin, going back to offset 0 after STREAM_MB MiB, wait
      WARMUP seconds, then measure; the stream stops when the small operations end. With
      BENCH_MIXED_STREAM_RATE (MiB/s) in the environment the stream writes at most that fast.
      The small operations run back to back for SECONDS or MAX_OPS operations, whichever comes
      first. Writes a summary to JSON and every operation's latency (int64 ns, native order)
      to LAT.

Latency is time.perf_counter_ns() around the system calls of one operation (for create:
open + write + close). The stream's MiB/s is counted over the small operations' window only.
"""
import array
import ctypes
import json
import math
import mmap
import os
import random
import signal
import struct
import sys
import time

KIB = 1024
MIB = 1024 * 1024
BLOCK = 4096
STREAM_BUF = MIB


def pct(sorted_ns, p):
    """Nearest-rank percentile of a sorted list (p in 0..100)."""
    if not sorted_ns:
        return 0
    k = max(1, math.ceil(p / 100.0 * len(sorted_ns)))
    return sorted_ns[k - 1]


def prep(d, files, kib):
    rs = os.path.join(d, "readset")
    os.makedirs(rs, exist_ok=True)
    rng = random.Random(1234)
    for i in range(files):
        p = os.path.join(rs, "f%03d" % i)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            data = rng.randbytes(kib * KIB)
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(rs, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def die_with_parent():
    # The stream process goes when the measuring process goes (also on SIGKILL).
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def stream_child(d, cap_mb, shm, wfd):
    """Writes 1 MiB buffers to d/stream.bin until SIGUSR1; bytes written so far in shm[0:8]."""
    die_with_parent()
    stop = [False]

    def on_usr1(signum, frame):
        stop[0] = True

    signal.signal(signal.SIGUSR1, on_usr1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    buf = os.urandom(STREAM_BUF)
    cap = cap_mb * MIB
    # BENCH_MIXED_STREAM_RATE MiB/s > 0: at most that rate (sleeping between writes).
    rate = float(os.environ.get("BENCH_MIXED_STREAM_RATE") or 0) * MIB
    lat = array.array("q")
    total = 0
    err = ""
    try:
        fd = os.open(os.path.join(d, "stream.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        off = 0
        begin = time.perf_counter_ns()
        while not stop[0]:
            if rate > 0:
                ahead = begin + total / rate * 1e9 - time.perf_counter_ns()
                if ahead > 0:
                    time.sleep(ahead / 1e9)
                    continue
            t0 = time.perf_counter_ns()
            n = os.pwrite(fd, buf, off)
            lat.append(time.perf_counter_ns() - t0)
            if n <= 0:
                raise OSError("pwrite returned %d" % n)
            total += n
            off += n
            if off >= cap:
                off = 0
            struct.pack_into("q", shm, 0, total)
        os.close(fd)
    except OSError as e:
        err = "stream: %s" % e
    s = sorted(lat)
    out = {
        "stream_bytes": total,
        "stream_writes": len(s),
        "stream_write_p50_ns": pct(s, 50),
        "stream_write_p99_ns": pct(s, 99),
        "stream_write_max_ns": s[-1] if s else 0,
        "stream_error": err,
    }
    os.write(wfd, json.dumps(out).encode())
    os.close(wfd)
    os._exit(0)


def open_readset(d, files):
    """fds of the read set, O_DIRECT if the filesystem takes it (else buffered)."""
    rs = os.path.join(d, "readset")
    direct = True
    fds = []
    for i in range(files):
        p = os.path.join(rs, "f%03d" % i)
        if direct:
            try:
                fds.append(os.open(p, os.O_RDONLY | os.O_DIRECT))
                continue
            except OSError:
                direct = False
                for fd in fds:
                    os.close(fd)
                fds = [os.open(os.path.join(rs, "f%03d" % j), os.O_RDONLY) for j in range(i)]
        fds.append(os.open(p, os.O_RDONLY))
    return fds, direct


def phase(argv):
    d, op, stream = argv[0], argv[1], argv[2] == "1"
    seconds, warmup = float(argv[3]), float(argv[4])
    stream_mb, max_ops = int(argv[5]), int(argv[6])
    out_json, out_lat = argv[7], argv[8]
    files = int(argv[9]) if len(argv) > 9 else 64
    kib = int(argv[10]) if len(argv) > 10 else 256
    if op not in ("read", "create"):
        sys.exit("unknown op %r" % op)

    buf = mmap.mmap(-1, BLOCK)  # page aligned, for O_DIRECT
    result = {"op": op, "stream": stream, "direct": None}
    if op == "read":
        fds, direct = open_readset(d, files)
        result["direct"] = direct
        blocks = kib * KIB // BLOCK
        # Warm pass (untimed): every block once, so the measured reads do not wait for the
        # physical disk under the image (they still go through each filesystem every time).
        for fd in fds:
            for b in range(blocks):
                if os.preadv(fd, [buf], b * BLOCK) != BLOCK:
                    sys.exit("short read in the warm pass")
        rng = random.Random(42)
    else:
        cdir = os.path.join(d, "create-stream" if stream else "create-alone")
        os.mkdir(cdir)
        data = os.urandom(BLOCK)

    shm = mmap.mmap(-1, 8)
    child = None
    rfd = None
    if stream:
        rfd, wfd = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(rfd)
            stream_child(d, stream_mb, shm, wfd)
        os.close(wfd)
        time.sleep(warmup)

    lat = array.array("q")
    bytes0 = struct.unpack_from("q", shm, 0)[0]
    t_start = time.perf_counter_ns()
    deadline = t_start + int(seconds * 1e9)
    n = 0
    err = ""
    try:
        if op == "read":
            nf = len(fds)
            while n < max_ops:
                fd = fds[rng.randrange(nf)]
                off = rng.randrange(blocks) * BLOCK
                t0 = time.perf_counter_ns()
                got = os.preadv(fd, [buf], off)
                t1 = time.perf_counter_ns()
                if got != BLOCK:
                    raise OSError("short read: %d bytes" % got)
                lat.append(t1 - t0)
                n += 1
                if t1 >= deadline:
                    break
        else:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
            while n < max_ops:
                p = os.path.join(cdir, "c%07d" % n)
                t0 = time.perf_counter_ns()
                fd = os.open(p, flags, 0o644)
                os.write(fd, data)
                os.close(fd)
                t1 = time.perf_counter_ns()
                lat.append(t1 - t0)
                n += 1
                if t1 >= deadline:
                    break
    except OSError as e:
        err = "%s after %d ops: %s" % (op, n, e)
    t_end = time.perf_counter_ns()
    bytes1 = struct.unpack_from("q", shm, 0)[0]
    secs = (t_end - t_start) / 1e9

    if child:
        os.kill(child, signal.SIGUSR1)
        chunks = []
        while True:
            c = os.read(rfd, 65536)
            if not c:
                break
            chunks.append(c)
        os.waitpid(child, 0)
        try:
            result.update(json.loads(b"".join(chunks) or b"{}"))
        except ValueError:
            result["stream_error"] = "no report from the stream process"
        result["stream_mib_s"] = (bytes1 - bytes0) / MIB / secs if secs > 0 else 0.0
        result["stream_window_bytes"] = bytes1 - bytes0
    if op == "read":
        for fd in fds:
            os.close(fd)

    s = sorted(lat)
    result.update(
        {
            "ops": n,
            "seconds": secs,
            "ops_per_s": n / secs if secs > 0 else 0.0,
            "p50_ns": pct(s, 50),
            "p99_ns": pct(s, 99),
            "max_ns": s[-1] if s else 0,
            "mean_ns": sum(s) // len(s) if s else 0,
            "error": err,
        }
    )
    with open(out_lat, "wb") as f:
        lat.tofile(f)
    with open(out_json, "w") as f:
        json.dump(result, f)
    if err or result.get("stream_error"):
        sys.exit(err or result["stream_error"])
    if stream and not result.get("stream_window_bytes"):
        sys.exit("the stream wrote nothing during the window")
    print(json.dumps(result))


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "prep" and len(sys.argv) == 5:
        prep(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif len(sys.argv) >= 11 and sys.argv[1] == "phase":
        phase(sys.argv[2:])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
