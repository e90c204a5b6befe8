#!/usr/bin/env bash
# bench/relocation.sh: butter's offline relocation against the kernel's online one, on copies
# of one image, in one run on this machine:
#   - shrink: a BENCH_RELOC_MB MiB image (4 GiB) filled by the kernel to about 90% with
#     files of 64 KiB to 4 MiB, every other file then deleted (about half free, every chunk
#     half used), shrunk to 70% of its size (60% is past what the kernel can): the kernel's `btrfs filesystem resize` on a loop
#     mount (mount, resize, unmount) against `butter filesystem resize IMAGE SIZE` on the
#     file; then butter's `min` alone (the kernel has none), with the size it reaches;
#   - balance -dusage=50 of the same filled image: `btrfs balance start -dusage=50` on a
#     mount against `butter balance start -dusage=50`.
# Prints a table with seconds and kernel/butter ratios (above 1.00x butter is faster), and
# writes it to bench/results/relocation.md. Each result is checked with `btrfs check`.
# Needs root. Never run from tests.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUTTER=${BUTTER:-$REPO/target/release/butter}
MB=${BENCH_RELOC_MB:-4096}
W=${BENCH_DIR:-$REPO/bench/work}/relocation
OUT=${BENCH_RESULTS:-$REPO/bench/results}/relocation.md

[ "$(id -u)" = 0 ] || { echo "bench/relocation.sh needs root (loop mounts)" >&2; exit 1; }
[ -x "$BUTTER" ] || (cd "$REPO" && cargo build --release -q)
mkdir -p "$W/mnt" "$(dirname "$OUT")"
cleanup() { umount "$W/mnt" 2>/dev/null || true; }
trap cleanup EXIT

now() { date +%s.%N; }
secs() { echo "$2 - $1" | bc -l; }

# The filled image, made once per size.
BASE=$W/base-$MB.img
if [ ! -f "$BASE" ]; then
	rm -f "$W"/base-*.img
	truncate -s "${MB}M" "$BASE"
	mkfs.btrfs -q -f "$BASE"
	mount -o loop "$BASE" "$W/mnt"
	python3 - "$W/mnt" "$MB" <<'EOF'
import os, random, sys
root, mb = sys.argv[1], int(sys.argv[2])
random.seed(7)
budget, i = mb * 9 // 10 << 20, 0
block = os.urandom(4 << 20)
while budget > 0:
    n = random.choice([64 << 10, 256 << 10, 1 << 20, 4 << 20])
    d = os.path.join(root, "d%03d" % (i // 500))
    os.makedirs(d, exist_ok=True)
    try:
        with open(os.path.join(d, "f%06d" % i), "wb") as f:
            f.write(block[:n])
    except OSError:
        break
    budget -= n
    i += 1
for j in range(0, i, 2):
    os.remove(os.path.join(root, "d%03d" % (j // 500), "f%06d" % j))
EOF
	umount "$W/mnt"
fi
used_mb=$(btrfs inspect-internal dump-super "$BASE" | awk '/^bytes_used/ {print int($2 / 1048576)}')
TARGET=$((MB * 7 / 10))

copy() { rm -f "$1" && cp --sparse=always "$BASE" "$1"; sync; }
check() { btrfs check --readonly "$1" >/dev/null 2>&1 || { echo "btrfs check failed on $1" >&2; exit 1; }; }

# Shrink to TARGET.
copy "$W/k.img"
t0=$(now)
mount -o loop "$W/k.img" "$W/mnt"
btrfs filesystem resize "${TARGET}M" "$W/mnt" >/dev/null
umount "$W/mnt"
t1=$(now)
k_shrink=$(secs "$t0" "$t1")
check "$W/k.img"
copy "$W/b.img"
t0=$(now)
"$BUTTER" filesystem resize "$W/b.img" "${TARGET}M" >/dev/null
t1=$(now)
b_shrink=$(secs "$t0" "$t1")
check "$W/b.img"

# min (butter only).
copy "$W/b.img"
t0=$(now)
"$BUTTER" filesystem resize "$W/b.img" min >/dev/null
t1=$(now)
b_min=$(secs "$t0" "$t1")
min_mb=$(($(stat -c %s "$W/b.img") >> 20))
check "$W/b.img"

# balance -dusage=50.
copy "$W/k.img"
t0=$(now)
mount -o loop "$W/k.img" "$W/mnt"
btrfs balance start -dusage=50 "$W/mnt" >/dev/null
umount "$W/mnt"
t1=$(now)
k_bal=$(secs "$t0" "$t1")
check "$W/k.img"
copy "$W/b.img"
t0=$(now)
"$BUTTER" balance start -dusage=50 "$W/b.img" >/dev/null
t1=$(now)
b_bal=$(secs "$t0" "$t1")
check "$W/b.img"
rm -f "$W/k.img" "$W/b.img"

ratio() { echo "scale=2; $1 / $2" | bc -l; }
{
	echo "# Relocation: butter offline against the kernel online"
	echo
	echo "$(date -u +%Y-%m-%d), $(nproc) cores, kernel $(uname -r), $(btrfs --version | head -1)."
	echo "Image: ${MB} MiB, ${used_mb} MiB used after every other file was deleted."
	echo
	echo "| operation | kernel btrfs (s) | butter (s) | kernel/butter |"
	echo "|---|---:|---:|---:|"
	printf '| shrink to %s MiB | %.2f | %.2f | %sx |\n' "$TARGET" "$k_shrink" "$b_shrink" "$(ratio "$k_shrink" "$b_shrink")"
	printf '| balance -dusage=50 | %.2f | %.2f | %sx |\n' "$k_bal" "$b_bal" "$(ratio "$k_bal" "$b_bal")"
	printf '| shrink to min (butter only) | | %.2f | %s MiB |\n' "$b_min" "$min_mb"
	echo
	echo "The kernel's times include its mount and unmount; butter's its open and close."
} | tee "$OUT"
