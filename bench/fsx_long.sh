#!/usr/bin/env bash
# bench/fsx_long.sh: the long fsx run on a read-write butter mount (the test suite's
# crates/butter-cli/tests/fuse_fsx.rs runs a short one).
#
#   sudo bench/fsx_long.sh [OPS] [SEED]        defaults: 100000 ops, seed 7001
#
# Makes a fresh 1 GiB btrfs image, mounts it with `butter mount`, runs fsx (same
# configuration as the test: every operation fsx has on Linux, including mmap reads and
# writes, truncate, posix_fallocate, hole punching, copy_file_range) for OPS operations with
# SEED, unmounts, then requires `butter check` and `btrfs check --readonly` to be clean and a
# kernel mount to show the same file content as the butter mount did. Prints one summary
# line: ops, seed, result, seconds. Needs root, fsx (scripts/install-deps), fusermount3.
# Environment: BUTTER (binary; default: cargo build --release), FSX_DIR (work dir; default
# /tmp/butter-fsx-long, removed on success, kept on failure).
set -uo pipefail
OPS=${1:-100000}
SEED=${2:-7001}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${FSX_DIR:-/tmp/butter-fsx-long}
((EUID == 0)) || { echo "fsx_long: needs root" >&2; exit 2; }
FSX=$(command -v fsx || echo /usr/local/bin/fsx)
[[ -x $FSX ]] || { echo "fsx_long: fsx not installed (scripts/install-deps)" >&2; exit 2; }
if [[ -z ${BUTTER:-} ]]; then
	(cd "$REPO" && cargo build --release -q -p butter-cli) || exit 2
	target=${CARGO_TARGET_DIR:-$REPO/target}
	[[ $target == /* ]] || target=$REPO/$target
	BUTTER=$target/release/butter
fi

mkdir -p "$DIR"
IMG=$DIR/fsx.img MNT=$DIR/mnt KMNT=$DIR/kmnt
BPID=
cleanup() {
	mountpoint -q "$MNT" && { fusermount3 -u "$MNT" 2>/dev/null || fusermount3 -u -z "$MNT"; }
	[[ -n $BPID ]] && kill "$BPID" 2>/dev/null
	mountpoint -q "$KMNT" && umount "$KMNT"
}
trap cleanup EXIT
fail() {
	echo "fsx_long: FAILED: $*; files kept in $DIR" >&2
	echo "RESULT ops=$OPS seed=$SEED result=FAIL ($*) seconds=$((SECONDS - T0))"
	exit 1
}

# The fsx configuration is the test's (one source of truth).
sed -n '/^pub const FSX_CONFIG: &str = r#"/,/^"#;/p' "$REPO/crates/butter-cli/tests/fuse_fsx.rs" |
	sed '1d;$d' >"$DIR/fsx.toml"
grep -q '^\[weights\]' "$DIR/fsx.toml" || { echo "fsx_long: cannot extract FSX_CONFIG" >&2; exit 2; }

rm -f "$IMG"
truncate -s 1G "$IMG"
mkfs.btrfs -q -f "$IMG" >/dev/null || exit 2
mkdir -p "$MNT" "$KMNT" "$DIR/artifacts"
"$BUTTER" mount "$IMG" "$MNT" >"$DIR/butter.log" 2>&1 </dev/null &
BPID=$!
for _ in $(seq 300); do mountpoint -q "$MNT" && break; sleep 0.1; done
mountpoint -q "$MNT" || fail "butter did not mount: $(tail -3 "$DIR/butter.log")"

T0=$SECONDS
echo "fsx_long: $OPS ops, seed $SEED, on $MNT (butter $BUTTER)"
"$FSX" -f "$DIR/fsx.toml" -N "$OPS" -S "$SEED" -P "$DIR/artifacts" "$MNT/fsx.bin" >"$DIR/fsx.log" 2>&1
rc=$?
FSX_SECONDS=$((SECONDS - T0))
tail -3 "$DIR/fsx.log"
((rc == 0)) || fail "fsx exit status $rc (log $DIR/fsx.log)"
want=$(sha256sum <"$MNT/fsx.bin")
fusermount3 -u "$MNT" || fail "unmount"
wait "$BPID"
brc=$?
BPID=
((brc == 0)) || fail "butter exited with $brc after unmount"
"$BUTTER" check "$IMG" >"$DIR/butter-check.log" 2>&1 || fail "butter check (log $DIR/butter-check.log)"
btrfs check --readonly "$IMG" >"$DIR/btrfs-check.log" 2>&1 || fail "btrfs check (log $DIR/btrfs-check.log)"
mount -o loop,ro "$IMG" "$KMNT" || fail "kernel mount"
got=$(sha256sum <"$KMNT/fsx.bin")
umount "$KMNT"
[[ $got == "$want" ]] || fail "kernel sees different content than butter showed"
echo "RESULT ops=$OPS seed=$SEED result=PASS fsx_seconds=$FSX_SECONDS seconds=$((SECONDS - T0))"
trap - EXIT
rm -rf "$DIR"
