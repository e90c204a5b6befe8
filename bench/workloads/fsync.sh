# fsync: buffered writes with fsync (issue 5, seed 003: fsync through the btrfs log tree) on a
# read-write butter FUSE mount vs the kernel's btrfs vs ext4, plus "butter-commit": butter
# mounted with `-o fsync=commit`, where every fsync is a full transaction commit instead of a
# log tree write, and "butter-wait": butter mounted with `-o fsync=log-wait`, whose fsync
# completes the file's ordered extents before logging, i.e. without seed 003's rule (a system
# whose mount fails, for instance while butter does not know the option yet, is recorded as
# failed and the others still run).
#
#   fsync_seq   fio 64 KiB sequential writes, an fsync after every write
#   fsync_rand  fio 4 KiB random writes, an fsync after every 16 writes
#
# One row per job count in BENCH_FSYNC_JOBS (1 2 4); every job writes and fsyncs its own file
# and the jobs share the total size (BENCH_FSYNC_MB, BENCH_FSYNC_RAND_MB), so every row writes
# as much. Buffered I/O (ioengine=sync, no O_DIRECT), files created by fio on a fresh image
# (fusewrite.sh's fw_mount, BENCH_FSYNC_IMAGE_MB) in every run. fio stops a job after
# BENCH_FSYNC_MAX_S seconds. Throughput and the fsync latency percentiles come from fio's JSON
# report; the latencies go to $WORK/latency.tsv, which report.py turns into a second table.

register_workload fsync_seq 60 "" \
	"fio 64 KiB sequential writes, fsync=1, BENCH_FSYNC_JOBS jobs sharing BENCH_FSYNC_MB MiB, buffered, fresh image; MiB/s, fsync p50/p99"
register_workload fsync_rand 61 "" \
	"fio 4 KiB random writes, fsync=16, BENCH_FSYNC_JOBS jobs sharing BENCH_FSYNC_RAND_MB MiB, buffered, fresh image; MiB/s, fsync p50/p99"

FS_SYSTEMS=${BENCH_FSYNC_SYSTEMS:-"butter butter-uring kernel ext4 butter-commit butter-wait"}
: "${BENCH_FSYNC_IMAGE_MB:=1024}" "${BENCH_FSYNC_MB:=192}" "${BENCH_FSYNC_RAND_MB:=96}"
: "${BENCH_FSYNC_JOBS:=1 2 4}" "${BENCH_FSYNC_MAX_S:=12}"
# butter's periodic commit stays at its default (30 s, as the kernel's btrfs).
: "${BENCH_FSYNC_BUTTER_OPTS:=commit=30}" "${BENCH_FSYNC_COMMIT_OPTS:=commit=30,fsync=commit}"
: "${BENCH_FSYNC_WAIT_OPTS:=commit=30,fsync=log-wait}"

# fs_butter_wrapper NAME OPTIONS -> the path of a script that runs butter with `-o OPTIONS`
# after its subcommand, so fw_mount (which runs `$BUTTER_BIN mount IMAGE MNT`) mounts with them.
fs_butter_wrapper() {
	local w=$WORK/tmpfs/$1
	printf '#!/bin/bash\nsub=$1\nshift\nexec %q "$sub" -o %q "$@"\n' "$BUTTER_BIN" "$2" >"$w"
	chmod +x "$w"
	printf '%s' "$w"
}

# fs_mount SYSTEM LOG -> MNT; ERR on failure. A fresh image per call (untimed).
fs_mount() {
	local BENCH_FW_IMAGE_MB=$BENCH_FSYNC_IMAGE_MB BUTTER_BIN=$BUTTER_BIN
	case $1 in
	butter) BUTTER_BIN=$(fs_butter_wrapper butter-fsync-log "$BENCH_FSYNC_BUTTER_OPTS") ;;
	butter-commit) BUTTER_BIN=$(fs_butter_wrapper butter-fsync-commit "$BENCH_FSYNC_COMMIT_OPTS") ;;
	butter-wait) BUTTER_BIN=$(fs_butter_wrapper butter-fsync-wait "$BENCH_FSYNC_WAIT_OPTS") ;;
	butter-uring) BUTTER_BIN=$(fs_butter_wrapper butter-fsync-uring "$BENCH_FSYNC_BUTTER_OPTS") ;;
	esac
	fw_mount "$(fs_transport "$1")" "$2"
}
fs_umount() { fw_umount "$(fs_transport "$1")"; }
# The system fw_mount knows: butter's fsync variants are butter mounts, butter-uring its own.
fs_transport() { if [[ $1 == butter-uring ]]; then echo "$1"; else echo "${1%-*}"; fi; }

fs_fio() { # MNT JSON FIOARGS...
	local mnt=$1 json=$2
	shift 2
	fio --directory="$mnt" "$@" --ioengine=sync --direct=0 --fallocate=none --group_reporting=1 \
		--runtime="$BENCH_FSYNC_MAX_S" --output-format=json --output="$json"
}
export -f fs_fio
export BENCH_FSYNC_MAX_S

# fs_result JSON MIB -> "NS P50_NS P99_NS FSYNCS WRITTEN_MIB": NS is the time MIB takes at fio's
# bandwidth (fio's runtime when the jobs finished before BENCH_FSYNC_MAX_S). Fails with a
# message when the report is missing, fio saw an error, or nothing was written or fsynced.
fs_result() {
	python3 - "$@" <<'EOF'
import json, sys
path, mib = sys.argv[1], float(sys.argv[2])
text = open(path, errors="replace").read()
start = text.find("{")
if start < 0:
    sys.exit("no JSON in fio's report")
job = json.loads(text[start:])["jobs"][0]
if job.get("error"):
    sys.exit("fio error %s" % job["error"])
w, s = job["write"], job["sync"]
if not w.get("bw_bytes") or not s.get("total_ios"):
    sys.exit("fio wrote %s bytes with %s fsyncs" % (w.get("io_bytes"), s.get("total_ios")))
p = s["lat_ns"]["percentile"]
print(
    "%d %d %d %d %.1f"
    % (mib * 1048576 * 1e9 / w["bw_bytes"], p["50.000000"], p["99.000000"], s["total_ios"],
       w["io_bytes"] / 1048576)
)
EOF
}

fmt_ms() { awk -v n="$1" 'BEGIN { printf "%.2f ms", n / 1e6 }'; }

# fs_measure WORKLOAD ID ROW MIB FIOARGS...: for each run and system (interleaved): fresh
# mount, drop caches, fio timed, unmount (butter must exit 0), record fio's throughput as the
# measurement and the fsync latencies in $WORK/latency.tsv.
fs_measure() {
	local wl=$1 id=$2 row=$3 mib=$4 run sys rc err res ns p50 p99 n got
	shift 4
	for ((run = 1; run <= RUNS; run++)); do
		for sys in $FS_SYSTEMS; do
			[[ -n ${FAILED["$row/$sys"]:-} ]] && continue
			local base=$WORK/logs/$id-$sys-$run
			TLOG=$base.log
			if ! fs_mount "$sys" "$base.mount.log"; then
				record "$wl" "$row" "$sys" "$run" 0 "$mib" MiB fail "$ERR"
				FAILED["$row/$sys"]=1
				continue
			fi
			drop_caches
			timed fs_fio "$MNT" "$base.json" "$@"
			rc=$?
			err=
			((rc != 0)) && err=$(timed_error $rc)
			RSS_TAG="$row	$sys	$run"
			fs_umount "$sys"
			if [[ -z $err && $sys == butter* && ${BUTTER_RC:-0} != 0 ]]; then
				err="butter mount exited with status $BUTTER_RC after unmount: $(oneline "$(last_line "$base.mount.log")")"
			fi
			[[ -n $err ]] || res=$(fs_result "$base.json" "$mib" 2>&1) || err="fio report: $(oneline "$(tail -n 1 <<<"$res")")"
			if [[ -n $err ]]; then
				record "$wl" "$row" "$sys" "$run" "${NS:-0}" "$mib" MiB fail "$err"
				FAILED["$row/$sys"]=1
				continue
			fi
			read -r ns p50 p99 n got <<<"$res"
			record "$wl" "$row" "$sys" "$run" "$ns" "$mib" MiB ok \
				"fsync p50 $(fmt_ms "$p50"), p99 $(fmt_ms "$p99"), $n fsyncs$(
					[[ ${got%.*} -lt $mib ]] && printf ', stopped after %s s at %s MiB' "$BENCH_FSYNC_MAX_S" "$got"
				)"
			printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$wl" "$row" "$sys" "$run" "$p50" "$p99" "$n" \
				>>"$WORK/latency.tsv"
		done
	done
}

# fs_rows WORKLOAD ID-PREFIX WHAT MIB FIOARGS...: one row per job count, each job its own file.
fs_rows() {
	local wl=$1 prefix=$2 what=$3 mib=$4 jobs
	shift 4
	fw_need fio fio
	[[ -n ${FS_META_DONE:-} ]] || meta "fsync parameters" "BENCH_FSYNC_MB=$BENCH_FSYNC_MB BENCH_FSYNC_RAND_MB=$BENCH_FSYNC_RAND_MB BENCH_FSYNC_JOBS='$BENCH_FSYNC_JOBS' BENCH_FSYNC_MAX_S=$BENCH_FSYNC_MAX_S BENCH_FSYNC_IMAGE_MB=$BENCH_FSYNC_IMAGE_MB butter -o $BENCH_FSYNC_BUTTER_OPTS; butter-commit -o $BENCH_FSYNC_COMMIT_OPTS; butter-wait -o $BENCH_FSYNC_WAIT_OPTS; $(fio --version)"
	FS_META_DONE=1
	for jobs in $BENCH_FSYNC_JOBS; do
		local size=$((mib / jobs)) row
		row="$what ($jobs job$( ((jobs > 1)) && echo s), $((size * jobs)) MiB)"
		row_begin "$wl" "$row" "MiB/s" "fio $* --numjobs=$jobs --size=${size}M --ioengine=sync --direct=0 --fallocate=none --runtime=$BENCH_FSYNC_MAX_S (buffered)"
		fs_measure "$wl" "$prefix-j$jobs" "$row" "$((size * jobs))" "$@" --numjobs="$jobs" --size="${size}M"
	done
}

wl_fsync_seq() {
	fs_rows fsync_seq fsync-seq "fsync seq 64k fsync=1" "$BENCH_FSYNC_MB" \
		--name=seq --rw=write --bs=64k --fsync=1
}

wl_fsync_rand() {
	fs_rows fsync_rand fsync-rand "fsync rand 4k fsync=16" "$BENCH_FSYNC_RAND_MB" \
		--name=rand --rw=randwrite --bs=4k --fsync=16 --randrepeat=1 --randseed=42
}
