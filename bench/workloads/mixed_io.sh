# mixed_io: do small operations of one job slow down while another job streams large writes
# to one file through the same mount? (issue 15: butter's FUSE adapter holds its exclusive
# lock for the whole of every write, so small reads and creates queue behind the stream.)
#
# Per system (butter's read-write FUSE mount, the kernel's btrfs, ext4, and nullfs: a FUSE
# filesystem that does no work, for what FUSE itself gives; fresh equal images of
# BENCH_MIXED_IMAGE_MB, mkfs untimed, fusewrite.sh's fw_mount) and run, two fresh mounts:
#   read:   64 files x 256 KiB made and fsynced (untimed); then 4 KiB random reads with O_DIRECT
#           (butter: FOPEN_DIRECT_IO, so every read reaches the butter process) for
#           BENCH_MIXED_SECONDS, alone and while the stream runs;
#   create: open(O_CREAT|O_EXCL) + 4 KiB write + close of new files, back to back, for
#           BENCH_MIXED_SECONDS or BENCH_MIXED_MAX_CREATES files, alone and while the stream runs.
# The stream: a second process doing 1 MiB buffered pwrite()s, no fsync, to one file that it
# rewrites from offset 0 every BENCH_MIXED_STREAM_MB MiB; it starts BENCH_MIXED_WARMUP s
# before the small operations and stops when they end. Before every phase: sync and
# drop_caches. The phase order within a mount alternates by run (odd runs alone first).
# BENCH_MIXED_STREAM_RATE (MiB/s, 0 = unlimited, the default) caps the stream's rate.
# bench/lib/mixed_io.py does the measuring; latencies go to $WORK/mixed.tsv and the per-op
# files $WORK/logs/mixed-*.lat, which report.py pools into the "small operations" table.

register_workload mixed_io 70 "" \
	"4 KiB O_DIRECT random reads and create+4 KiB write+close, alone and while another job streams 1 MiB buffered writes to one file; fresh image; p50/p99/max, ops/s, stream MiB/s"

MX_SYSTEMS=${BENCH_MIXED_SYSTEMS:-butter kernel ext4 nullfs}
if ((${QUICK:-0})); then
	: "${BENCH_MIXED_SECONDS:=2}"
fi
: "${BENCH_MIXED_SECONDS:=5}" "${BENCH_MIXED_WARMUP:=1}" "${BENCH_MIXED_STREAM_MB:=256}"
: "${BENCH_MIXED_MAX_CREATES:=20000}" "${BENCH_MIXED_READ_FILES:=64}" "${BENCH_MIXED_READ_KB:=256}"
: "${BENCH_MIXED_IMAGE_MB:=2048}" "${BENCH_MIXED_BUTTER_OPTS:=}" "${BENCH_MIXED_STREAM_RATE:=0}"
MX_PY=$BENCH_ROOT/lib/mixed_io.py
export MX_PY BENCH_MIXED_SECONDS BENCH_MIXED_WARMUP BENCH_MIXED_STREAM_MB BENCH_MIXED_MAX_CREATES \
	BENCH_MIXED_READ_FILES BENCH_MIXED_READ_KB BENCH_MIXED_STREAM_RATE

# Nominal amounts: a measurement's time is the time this amount takes at the measured rate
# (the runs are time-bound, so they do different amounts).
MX_NOMINAL_OPS=10000
MX_NOMINAL_MIB=1024

mx_prep_cmd() { python3 "$MX_PY" prep "$1" "$BENCH_MIXED_READ_FILES" "$BENCH_MIXED_READ_KB"; }
# mx_phase_cmd MNT OP STREAM JSON LAT
mx_phase_cmd() {
	local max=1000000000
	[[ $2 == create ]] && max=$BENCH_MIXED_MAX_CREATES
	python3 "$MX_PY" phase "$1" "$2" "$3" "$BENCH_MIXED_SECONDS" "$BENCH_MIXED_WARMUP" \
		"$BENCH_MIXED_STREAM_MB" "$max" "$4" "$5" "$BENCH_MIXED_READ_FILES" "$BENCH_MIXED_READ_KB"
}
export -f mx_prep_cmd mx_phase_cmd

# mx_mount SYSTEM LOG -> MNT; a fresh image (fw_mount), butter with -o BENCH_MIXED_BUTTER_OPTS.
mx_mount() {
	local BENCH_FW_IMAGE_MB=$BENCH_MIXED_IMAGE_MB BUTTER_BIN=$BUTTER_BIN
	if [[ $1 == butter && -n $BENCH_MIXED_BUTTER_OPTS && -z $BUTTER_ERR ]]; then
		BUTTER_BIN=$(fs_butter_wrapper butter-mixed "$BENCH_MIXED_BUTTER_OPTS")
	fi
	fw_mount "$1" "$2"
}

# mx_json JSON -> "OPS SECONDS P50 P99 MAX STREAM_MIB_S DIRECT STREAM_WRITE_P99 STREAM_WRITE_MAX"
mx_json() {
	python3 - "$1" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(r["ops"], "%.6f" % r["seconds"], r["p50_ns"], r["p99_ns"], r["max_ns"],
      "%.3f" % r.get("stream_mib_s", 0.0), {True: "direct", False: "buffered"}.get(r["direct"], "-"),
      r.get("stream_write_p99_ns", 0), r.get("stream_write_max_ns", 0))
EOF
}

mx_row() { # OP MODE -> the table row's name
	local what
	case $1 in
	read) what="read 4k O_DIRECT" ;;
	create) what="create+4k+close" ;;
	esac
	case $2 in
	alone) printf '%s, alone' "$what" ;;
	stream) printf '%s, with stream' "$what" ;;
	mib) printf 'stream 1M writes, during %s' "$what" ;;
	esac
}

# mx_fail_all SYSTEM RUN OP MESSAGE: every row of OP failed for SYSTEM.
mx_fail_all() {
	local m
	for m in alone stream mib; do
		record mixed_io "$(mx_row "$3" $m)" "$1" "$2" 0 1 ops fail "$4"
	done
	FAILED["mixed/$3/$1"]=1
}

# One mount of SYSTEM for OP in run RUN: fresh image, prep, the two phases, unmount.
mx_measure() {
	local sys=$1 run=$2 op=$3 mode modes rc err res base
	local BENCH_TIMEOUT=$((BENCH_MIXED_SECONDS + BENCH_MIXED_WARMUP + 120))
	local blog=$WORK/logs/mixed-$op-$sys-$run.mount.log
	if ! mx_mount "$sys" "$blog"; then
		mx_fail_all "$sys" "$run" "$op" "$ERR"
		return
	fi
	err=
	if [[ $op == read ]]; then
		TLOG=$WORK/logs/mixed-$op-$sys-$run.prep.log
		timed mx_prep_cmd "$MNT" || err="prepare: $(timed_error $?)"
	fi
	modes="alone stream"
	((run % 2 == 0)) && modes="stream alone"
	declare -A got=()
	for mode in $modes; do
		[[ -z $err ]] || break
		base=$WORK/logs/mixed-$op-$mode-$sys-$run
		TLOG=$base.log
		drop_caches
		timed mx_phase_cmd "$MNT" "$op" "$([[ $mode == stream ]] && echo 1 || echo 0)" "$base.json" "$base.lat"
		rc=$?
		if ((rc != 0)); then
			err="$mode: $(timed_error $rc)"
			break
		fi
		res=$(mx_json "$base.json" 2>&1) || {
			err="$mode: report: $(oneline "$(tail -n 1 <<<"$res")")"
			break
		}
		got[$mode]=$res
	done
	fw_umount "$sys"
	if [[ -z $err && $sys == butter && ${BUTTER_RC:-0} != 0 ]]; then
		err="butter mount exited with status $BUTTER_RC after unmount: $(oneline "$(last_line "$blog")")"
	fi
	if [[ -n $err ]]; then
		mx_fail_all "$sys" "$run" "$op" "$err"
		return
	fi
	local ops secs p50 p99 max mib direct wp99 wmax
	for mode in alone stream; do
		read -r ops secs p50 p99 max mib direct wp99 wmax <<<"${got[$mode]}"
		local ns
		ns=$(awk -v o="$ops" -v s="$secs" -v n="$MX_NOMINAL_OPS" 'BEGIN { printf "%.0f", (o > 0) ? n * s / o * 1e9 : 0 }')
		record mixed_io "$(mx_row "$op" $mode)" "$sys" "$run" "$ns" "$MX_NOMINAL_OPS" ops ok \
			"$ops ops in $secs s, p50 $(fmt_ms "$p50") p99 $(fmt_ms "$p99") max $(fmt_ms "$max")$([[ $op == read ]] && echo ", $direct")"
		printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$sys" "$op" "$mode" "$run" \
			"$ops" "$secs" "$p50" "$p99" "$max" "$mib" "$direct" "$wp99" "$wmax" >>"$WORK/mixed.tsv"
		if [[ $mode == stream ]]; then
			ns=$(awk -v m="$mib" -v n="$MX_NOMINAL_MIB" 'BEGIN { printf "%.0f", (m > 0) ? n / m * 1e9 : 0 }')
			record mixed_io "$(mx_row "$op" mib)" "$sys" "$run" "$ns" "$MX_NOMINAL_MIB" MiB ok \
				"stream write p99 $(fmt_ms "$wp99") max $(fmt_ms "$wmax")"
		fi
	done
}

wl_mixed_io() {
	local run sys op
	[[ $BENCH_MIXED_SECONDS =~ ^[0-9]+(\.[0-9]+)?$ && $BENCH_MIXED_WARMUP =~ ^[0-9]+(\.[0-9]+)?$ ]] ||
		die "BENCH_MIXED_SECONDS and BENCH_MIXED_WARMUP must be numbers"
	meta "mixed_io parameters" "BENCH_MIXED_SECONDS=$BENCH_MIXED_SECONDS BENCH_MIXED_WARMUP=$BENCH_MIXED_WARMUP BENCH_MIXED_STREAM_MB=$BENCH_MIXED_STREAM_MB BENCH_MIXED_STREAM_RATE=$BENCH_MIXED_STREAM_RATE BENCH_MIXED_MAX_CREATES=$BENCH_MIXED_MAX_CREATES BENCH_MIXED_READ_FILES=$BENCH_MIXED_READ_FILES BENCH_MIXED_READ_KB=$BENCH_MIXED_READ_KB BENCH_MIXED_IMAGE_MB=$BENCH_MIXED_IMAGE_MB butter -o '${BENCH_MIXED_BUTTER_OPTS}' (empty: defaults, commit=30); systems $MX_SYSTEMS; $(python3 --version 2>&1)"
	for op in read create; do
		for mode in alone stream mib; do
			case $mode in
			mib) row_begin mixed_io "$(mx_row $op $mode)" "MiB/s" \
				"1 MiB pwrite()s, buffered, no fsync, to one file rewritten from 0 every $BENCH_MIXED_STREAM_MB MiB$( [[ $BENCH_MIXED_STREAM_RATE != 0 ]] && echo ", at most $BENCH_MIXED_STREAM_RATE MiB/s"); MiB/s over the $op window (time: $MX_NOMINAL_MIB MiB at that rate)" ;;
			*) row_begin mixed_io "$(mx_row $op $mode)" "ops/s" \
				"bench/lib/mixed_io.py phase MNT $op $([[ $mode == stream ]] && echo 1 || echo 0) $BENCH_MIXED_SECONDS s (time: $MX_NOMINAL_OPS ops at the measured rate)" ;;
			esac
		done
	done
	for ((run = 1; run <= RUNS; run++)); do
		for sys in $MX_SYSTEMS; do
			for op in read create; do
				[[ -n ${FAILED["mixed/$op/$sys"]:-} ]] && continue
				log "  $sys run $run/$RUNS: $op"
				mx_measure "$sys" "$run" "$op"
			done
		done
	done
}
