#!/usr/bin/env bash
# bench/multi_device.sh: butter against the kernel's btrfs on the same image files of a
# filesystem of several devices, in one run on this machine:
#   - sequential write (dd bs=1M conv=fsync) and cold read (after drop_caches) of one file of
#     BENCH_FILE_MB MiB on two-device RAID0 and RAID1 (the kernel through loop devices, butter
#     through its FUSE mount with -o device=);
#   - scrub of BENCH_SCRUB_MB MiB of data on a two-device RAID1 (the kernel's `btrfs scrub
#     start -B` on a mount, `butter scrub start` offline), caches dropped before each;
#   - what NBD costs: butter reading the file of a two-device RAID1 through its mount when
#     the second device is an nbdkit export on 127.0.0.1 (and the first is missing, so every
#     read crosses the protocol), against the same read from the local files.
# Prints a table with MiB/s and butter/kernel ratios (above 1.00x butter is faster) and writes
# it to bench/results/multi-device.md. Needs root. Never run from tests.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUTTER=${BUTTER:-$REPO/target/release/butter}
MB=${BENCH_FILE_MB:-1024}
SMB=${BENCH_SCRUB_MB:-4096}
W=${BENCH_DIR:-$REPO/bench/work}/multi-device
OUT=${BENCH_RESULTS:-$REPO/bench/results}/multi-device.md
DEV_MB=$(((SMB > MB ? SMB : MB) * 2 + 1024))

[ "$(id -u)" = 0 ] || { echo "bench/multi_device.sh needs root (loop mounts, drop_caches)" >&2; exit 1; }
[ -x "$BUTTER" ] || (cd "$REPO" && cargo build --release -q)
mkdir -p "$W" "$(dirname "$OUT")"
LOOPS=()
cleanup() {
	umount "$W/kmnt" 2>/dev/null || true
	"$BUTTER" unmount "$W/bmnt" 2>/dev/null || true
	for l in "${LOOPS[@]}"; do
		btrfs device scan --forget "$l" 2>/dev/null || true
		losetup -d "$l" 2>/dev/null || true
	done
	LOOPS=()
}
trap cleanup EXIT
mkdir -p "$W/kmnt" "$W/bmnt"

now() { date +%s.%N; }
secs() { echo "$2 - $1" | bc -l; }
rate() { echo "scale=1; $1 / $2" | bc -l; }
drop() { sync; echo 3 >/proc/sys/vm/drop_caches; }

# mkfs PROFILE N: N fresh images, mkfs.btrfs -d/-m PROFILE over them.
make_fs() {
	local p=$1 n=$2 i
	IMGS=()
	for ((i = 0; i < n; i++)); do
		rm -f "$W/dev$i.img"
		truncate -s "${DEV_MB}M" "$W/dev$i.img"
		IMGS+=("$W/dev$i.img")
	done
	mkfs.btrfs -f -q -d "$p" -m "$p" "${IMGS[@]}" >/dev/null
}
kernel_mount() { # OPTIONS
	local opts=$1 img l
	LOOPS=()
	for img in "${IMGS[@]}"; do
		l=$(losetup -f --show "$img")
		LOOPS+=("$l")
		opts="$opts,device=$l"
	done
	mount -t btrfs -o "${opts#,}" "${LOOPS[0]}" "$W/kmnt"
}
kernel_umount() { umount "$W/kmnt"; cleanup; }
butter_mount() { # extra -o options
	local opts=$1 img
	for img in "${IMGS[@]:1}"; do opts="$opts,device=$img"; done
	"$BUTTER" mount -d "${IMGS[0]}" "$W/bmnt" -o "${opts#,}"
}
butter_devices() {
	local img
	for img in "${IMGS[@]:1}"; do printf -- '--device %s ' "$img"; done
}

SRC=/dev/shm/butter-bench-src
[ -f "$SRC" ] && [ "$(stat -c %s "$SRC")" = $((MB << 20)) ] || head -c "$((MB << 20))" /dev/urandom >"$SRC"

ROWS=()
row() { # WHAT KERNEL_SECS BUTTER_SECS MB
	local k=$2 b=$3 mb=$4
	ROWS+=("| $1 | $(rate "$mb" "$k") MiB/s ($(printf %.2f "$k") s) | $(rate "$mb" "$b") MiB/s ($(printf %.2f "$b") s) | $(printf %.2f "$(echo "$k / $b" | bc -l)")x |")
	echo "${ROWS[-1]}"
}

for profile in raid0 raid1; do
	make_fs "$profile" 2
	kernel_mount noatime
	t0=$(now); dd if="$SRC" of="$W/kmnt/f" bs=1M conv=fsync status=none; t1=$(now)
	kw=$(secs "$t0" "$t1")
	kernel_umount; drop
	kernel_mount noatime,ro
	t0=$(now); dd if="$W/kmnt/f" of=/dev/null bs=1M status=none; t1=$(now)
	kr=$(secs "$t0" "$t1")
	kernel_umount
	make_fs "$profile" 2
	butter_mount noatime
	t0=$(now); dd if="$SRC" of="$W/bmnt/f" bs=1M conv=fsync status=none; t1=$(now)
	bw=$(secs "$t0" "$t1")
	"$BUTTER" unmount "$W/bmnt"; drop
	butter_mount noatime,ro
	t0=$(now); dd if="$W/bmnt/f" of=/dev/null bs=1M status=none; t1=$(now)
	br=$(secs "$t0" "$t1")
	"$BUTTER" unmount "$W/bmnt"
	"$BUTTER" check "${IMGS[0]}" $(butter_devices) >/dev/null
	row "$profile, 2 devices: write $MB MiB" "$kw" "$bw" "$MB"
	row "$profile, 2 devices: read $MB MiB, cold" "$kr" "$br" "$MB"
done

make_fs raid1 2
kernel_mount noatime
left=$SMB
i=0
while [ "$left" -gt 0 ]; do
	n=$((left < MB ? left : MB))
	dd if="$SRC" of="$W/kmnt/s$i" bs=1M count="$n" status=none
	left=$((left - n)); i=$((i + 1))
done
sync
kernel_umount; drop
kernel_mount noatime
t0=$(now); btrfs scrub start -B "$W/kmnt" >/dev/null; t1=$(now)
ks=$(secs "$t0" "$t1")
kernel_umount; drop
t0=$(now); "$BUTTER" scrub start -q "${IMGS[0]}" $(butter_devices); t1=$(now)
bs=$(secs "$t0" "$t1")
row "raid1, 2 devices: scrub $SMB MiB of data" "$ks" "$bs" "$SMB"

if command -v nbdkit >/dev/null; then
	make_fs raid1 2
	butter_mount noatime
	dd if="$SRC" of="$W/bmnt/f" bs=1M conv=fsync status=none
	"$BUTTER" unmount "$W/bmnt"; drop
	"$BUTTER" mount -d "${IMGS[1]}" "$W/bmnt" -o ro,noatime,degraded
	t0=$(now); dd if="$W/bmnt/f" of=/dev/null bs=1M status=none; t1=$(now)
	local_s=$(secs "$t0" "$t1")
	"$BUTTER" unmount "$W/bmnt"; drop
	port=$((20000 + RANDOM % 20000))
	nbdkit --exit-with-parent -f -i 127.0.0.1 -p "$port" file "${IMGS[1]}" &
	NBD_PID=$!
	sleep 1
	"$BUTTER" mount -d "nbd://127.0.0.1:$port/x" "$W/bmnt" -o ro,noatime,degraded
	t0=$(now); dd if="$W/bmnt/f" of=/dev/null bs=1M status=none; t1=$(now)
	nbd_s=$(secs "$t0" "$t1")
	"$BUTTER" unmount "$W/bmnt"
	kill "$NBD_PID"
	ROWS+=("| raid1 read $MB MiB, cold, one device: local file vs NBD (butter both) | $(rate "$MB" "$local_s") MiB/s local | $(rate "$MB" "$nbd_s") MiB/s over NBD | $(printf %.2f "$(echo "$local_s / $nbd_s" | bc -l)")x |")
	echo "${ROWS[-1]}"
fi

{
	echo "# Several devices: butter against the kernel's btrfs"
	echo
	echo "\`bench/multi_device.sh\` on $(date -u +%F), $(uname -r), $(nproc) CPUs, butter $(cd "$REPO" && git rev-parse --short HEAD)."
	echo "Image files on $(df --output=fstype "$W" | tail -1); the kernel through loop devices, butter through"
	echo "its FUSE mount (\`-o device=\`) and offline scrub. Rates count the file's bytes once (a RAID1"
	echo "write puts them on both devices; its scrub reads both copies)."
	echo
	echo "| workload | kernel btrfs | butter | butter/kernel |"
	echo "|---|---:|---:|---:|"
	printf '%s\n' "${ROWS[@]}"
} >"$OUT"
echo "wrote $OUT"
rm -f "${IMGS[@]}"
