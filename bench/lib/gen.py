#!/usr/bin/env python3
"""Dataset generator and digests for the butter benchmark.

Subcommands:
  big FILE MIB [--seed S]          write MIB MiB of deterministic pseudo-random bytes
  tree DIR FILES [--seed S] [--per-dir N]
                                   make FILES small files in a two-level nested tree
  digest DIR [--listing-only]      print "files= dirs= bytes= listing= content=" for DIR
  findlisting FILE                 listing hash of `find DIR -printf '%y\\t%s\\t%T@\\t%P\\n'`
                                   output (must equal the digest's listing= of the same tree)
  damage-super IMAGE BYTES         add BYTES to bytes_used in every superblock copy of a btrfs
                                   image, resealed (damage both checkers' repairs mend)

The listing hash covers every entry below DIR (not DIR itself): relative path, type
('f' file, 'd' directory, other find %y letters) and, for regular files only, the size.
Directory sizes differ between filesystems, so they are left out. The content hash covers
path and bytes of every regular file, in sorted path order.
"""
import hashlib
import math
import os
import random
import stat as S
import sys

CHUNK = 1 << 20


def rng_bytes(rng, n):
    return rng.randbytes(n)


def cmd_big(args):
    path, mib = args[0], int(args[1])
    seed = int(opt(args, "--seed", "1"))
    rng = random.Random(seed)
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(rng_bytes(rng, CHUNK))
    return 0


def file_size(rng):
    # 5% empty, 65% up to 2000 bytes (inline extents on btrfs), 30% 2 KiB..16 KiB.
    r = rng.random()
    if r < 0.05:
        return 0
    if r < 0.70:
        return rng.randint(1, 2000)
    return rng.randint(2048, 16384)


def cmd_tree(args):
    root, nfiles = args[0], int(args[1])
    seed = int(opt(args, "--seed", "2"))
    per_dir = max(1, int(opt(args, "--per-dir", "100")))
    rng = random.Random(seed)
    leaves = max(1, math.ceil(nfiles / per_dir))
    fan = max(1, math.ceil(math.sqrt(leaves)))
    letters = "abcdefghijklmnopqrstuvwxyz0123456789_-"
    made = 0
    for leaf in range(leaves):
        d = os.path.join(root, "a%03d" % (leaf // fan), "b%03d" % (leaf % fan))
        os.makedirs(d, exist_ok=True)
        for _ in range(min(per_dir, nfiles - made)):
            suffix = "".join(rng.choice(letters) for _ in range(rng.randint(0, 40)))
            name = "f%07d%s" % (made, ("." + suffix) if suffix else "")
            with open(os.path.join(d, name), "wb") as f:
                f.write(rng_bytes(rng, file_size(rng)))
            made += 1
    return 0


def walk(root):
    """Yield (relpath bytes, type letter, size or None) for every entry below root."""
    root = os.fsencode(root)
    stack = [b""]
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(root, rel) if rel else root) as it:
            for e in it:
                p = os.path.join(rel, e.name) if rel else e.name
                st = e.stat(follow_symlinks=False)
                m = st.st_mode
                if S.S_ISDIR(m):
                    yield p, "d", None
                    stack.append(p)
                elif S.S_ISREG(m):
                    yield p, "f", st.st_size
                elif S.S_ISLNK(m):
                    yield p, "l", None
                else:
                    yield p, "o", None


def listing_hash(entries):
    h = hashlib.sha256()
    for p, t, size in sorted(entries):
        h.update(b"%s %s %s\n" % (t.encode(), b"-" if size is None else str(size).encode(), p))
    return h.hexdigest()


def cmd_digest(args):
    root = args[0]
    entries = list(walk(root))
    files = [e for e in entries if e[1] == "f"]
    out = {
        "files": len(files),
        "dirs": sum(1 for e in entries if e[1] == "d"),
        "bytes": sum(e[2] for e in files),
        "listing": listing_hash(entries),
    }
    if "--listing-only" not in args:
        h = hashlib.sha256()
        broot = os.fsencode(root)
        for p, _, _ in sorted(files):
            h.update(p + b"\0")
            with open(os.path.join(broot, p), "rb") as f:
                while True:
                    b = f.read(CHUNK)
                    if not b:
                        break
                    h.update(b)
        out["content"] = h.hexdigest()
    print(" ".join("%s=%s" % kv for kv in out.items()))
    return 0


def cmd_findlisting(args):
    entries = []
    with open(args[0], "rb") as f:
        for line in f:
            parts = line.rstrip(b"\n").split(b"\t", 3)
            if len(parts) != 4 or parts[3] == b"":
                continue  # the start directory itself, or a malformed line
            t = parts[0].decode()
            if t not in ("f", "d", "l"):
                t = "o"
            size = int(parts[1]) if t == "f" else None
            entries.append((parts[3], t, size))
    print("entries=%d listing=%s" % (len(entries), listing_hash(entries)))
    return 0


def crc32c(data):
    table = getattr(crc32c, "table", None)
    if table is None:
        table = []
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
            table.append(c)
        crc32c.table = table
    c = 0xFFFFFFFF
    for x in data:
        c = table[(c ^ x) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def cmd_damage_super(args):
    # Superblock copies at 64 KiB, 64 MiB and 256 GiB; bytes_used at byte 120, the magic at
    # 64, the crc32c of bytes 32.. in the first four bytes (a crc32c filesystem only).
    path, delta = args[0], int(args[1])
    done = 0
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        for at in (65536, 64 << 20, 256 << 30):
            if at + 4096 > size:
                continue
            f.seek(at)
            sb = bytearray(f.read(4096))
            if sb[64:72] != b"_BHRfS_M" or int.from_bytes(sb[196:198], "little") != 0:
                continue
            used = int.from_bytes(sb[120:128], "little")
            sb[120:128] = (used + delta).to_bytes(8, "little")
            sb[0:32] = bytes(32)
            sb[0:4] = crc32c(bytes(sb[32:])).to_bytes(4, "little")
            f.seek(at)
            f.write(sb)
            done += 1
    if done == 0:
        sys.stderr.write(f"{path}: no crc32c btrfs superblock found\n")
        return 1
    return 0


def opt(args, name, default):
    if name in args:
        i = args.index(name)
        if i + 1 < len(args):
            return args[i + 1]
    return default


def main():
    cmds = {"big": cmd_big, "tree": cmd_tree, "digest": cmd_digest, "findlisting": cmd_findlisting,
            "damage-super": cmd_damage_super}
    if len(sys.argv) < 3 or sys.argv[1] not in cmds:
        sys.stderr.write(__doc__)
        return 2
    return cmds[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
