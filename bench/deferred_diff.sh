#!/usr/bin/env bash
# bench/deferred_diff.sh: the long run of the mount's differential operations test
# (crates/butter-cli/tests/deferred_diff.rs; the test suite runs a short one).
#
#   sudo bench/deferred_diff.sh [TOTAL_OPS] [OPS_PER_SEQUENCE] [FIRST_SEED]
#        defaults: 1000000 operations in all, 2000 per sequence, seed 50000
#
# Seeded random sequences of file operations (writes of every size, appends, O_DIRECT,
# truncates, every fallocate mode, copy_file_range, clones, mmap writes, renames, links,
# unlinks of open files, fsyncs, xattrs) run on a butter mount and on an ext4 reference at
# once, blind (nothing looks at butter's files between operations) and looking (reads, stats
# and SEEK_DATA/SEEK_HOLE in between); every errno, and at the end every name, size, content,
# link, mode, xattr and the hole layout must agree; then unmount, both checkers and a kernel
# mount. Each round runs the test binary once for SEEDS_PER_ROUND seeds under every option
# set (defaults, nodelalloc, compress-force=zstd, fsync=commit, nobulk), both modes, until
# TOTAL_OPS operations ran or DIFF_SECONDS passed. Prints per round and at the end:
# operations, sequences, seeds, option sets and differences found. Exit 1 if any.
#
# Environment: SEEDS_PER_ROUND (default 5), DIFF_SECONDS (stop starting rounds after this
# many seconds; default none), DIFF_DIR (logs; default /tmp/butter-deferred-diff, removed on
# success, kept on failure), BUTTER_DIFF_MINIMIZE (seconds to shrink a failing sequence,
# default 300 here). Needs root, /dev/fuse, fusermount3, mkfs.ext4, btrfs-progs.
set -uo pipefail
TOTAL=${1:-1000000}
OPS=${2:-2000}
SEED=${3:-50000}
PER_ROUND=${SEEDS_PER_ROUND:-5}
LIMIT=${DIFF_SECONDS:-0}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${DIFF_DIR:-/tmp/butter-deferred-diff}
((EUID == 0)) || { echo "deferred_diff: needs root" >&2; exit 2; }

mkdir -p "$DIR"
# Build once; find the test binary cargo made.
exe=$(cd "$REPO" && cargo test --release -p butter-cli --test deferred_diff --no-run 2>&1 |
	sed -n 's/.*Executable tests\/deferred_diff.rs (\(.*\))/\1/p' | tail -1)
[[ -n $exe ]] || { echo "deferred_diff: cannot build the test binary" >&2; exit 2; }
[[ $exe == /* ]] || exe=$REPO/$exe
[[ -x $exe ]] || { echo "deferred_diff: $exe is not executable" >&2; exit 2; }

T0=$SECONDS
ops_done=0 seqs=0 diffs=0 seeds=0 rounds=0 failed_rounds=0
variants=""
while ((ops_done < TOTAL)); do
	if ((LIMIT > 0 && SECONDS - T0 >= LIMIT)); then
		echo "deferred_diff: time limit of ${LIMIT}s reached"
		break
	fi
	log=$DIR/round-$rounds.log
	# The test binary runs each option set as its own test, two at a time (2 cores).
	(cd "$REPO/crates/butter-cli" &&
		BUTTER_DIFF_SEED=$SEED BUTTER_DIFF_SEEDS=$PER_ROUND BUTTER_DIFF_OPS=$OPS \
			BUTTER_DIFF_MINIMIZE=${BUTTER_DIFF_MINIMIZE:-300} \
			"$exe" --test-threads=2 --nocapture) >"$log" 2>&1
	rc=$?
	r_ops=$(sed -n 's/.*DIFF_SUMMARY.* ops=\([0-9]*\).*/\1/p' "$log" | awk '{s+=$1} END {print s+0}')
	r_seqs=$(sed -n 's/.*DIFF_SUMMARY.* sequences=\([0-9]*\).*/\1/p' "$log" | awk '{s+=$1} END {print s+0}')
	r_diffs=$(sed -n 's/.*DIFF_SUMMARY.* differences=\([0-9]*\).*/\1/p' "$log" | awk '{s+=$1} END {print s+0}')
	r_vars=$(sed -n 's/.*DIFF_SUMMARY variant=\([^ ]*\).*/\1/p' "$log" | sort -u | tr '\n' ' ')
	for v in $r_vars; do [[ " $variants " == *" $v "* ]] || variants="$variants $v"; done
	ops_done=$((ops_done + r_ops))
	seqs=$((seqs + r_seqs))
	diffs=$((diffs + r_diffs))
	seeds=$((seeds + PER_ROUND))
	if ((rc != 0)); then
		failed_rounds=$((failed_rounds + 1))
		echo "deferred_diff: round $rounds (seeds $SEED..$((SEED + PER_ROUND - 1))) FAILED (exit $rc), log $log:"
		grep -E 'DIFFERENCE:|panicked|NOTICE' "$log" | head -20
	fi
	grep -h NOTICE "$log" | sort -u
	echo "round $rounds: seeds $SEED..$((SEED + PER_ROUND - 1)), option sets: $r_vars, $r_seqs sequences, $r_ops ops, $r_diffs differences, $((SECONDS - T0)) s so far ($ops_done ops in all)"
	if ((r_ops == 0)); then
		echo "deferred_diff: round $rounds ran no operation (log $log)" >&2
		failed_rounds=$((failed_rounds + 1))
		break
	fi
	SEED=$((SEED + PER_ROUND))
	rounds=$((rounds + 1))
done
echo "RESULT operations=$ops_done sequences=$seqs seeds=$seeds option_sets=$(echo $variants | wc -w) ($variants ) differences=$diffs failed_rounds=$failed_rounds seconds=$((SECONDS - T0))"
if ((diffs > 0 || failed_rounds > 0)); then
	echo "deferred_diff: logs kept in $DIR (search for DIFFERENCE:)"
	exit 1
fi
rm -rf "$DIR"
