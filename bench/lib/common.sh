# Shared helpers for bench/run: logging, mounts, loop devices, timing, recording.
# Sourced by bench/run; workloads (bench/workloads/*.sh) use the functions documented here.
#
# Globals set by bench/run before workloads run:
#   BENCH_ROOT WORK RESULTS RUNS BENCH_FILE_MB BENCH_FILES BENCH_TIMEOUT BENCH_VERIFY
#   BUTTER_BIN   butter binary to run (empty when unusable)
#   BUTTER_ERR   why butter is unusable (empty when usable)
#   SYSTEMS      "butter kernel ext4"
#
# Every measurement ends up as one line of $WORK/raw.tsv:
#   workload  row  system  run  nanoseconds  amount  unit  status(ok|fail|skip)  message
# and every row once in $WORK/rows.tsv: workload  row  unit  note

log() { printf '[bench %(%H:%M:%S)T] %s\n' -1 "$*"; }
die() {
	log "error: $*" >&2
	exit 1
}

# One line, no tabs, at most 300 characters: safe for the TSV files and the table.
oneline() {
	local s=${1//$'\t'/ }
	s=${s//$'\r'/ }
	s=${s//$'\n'/ | }
	((${#s} > 300)) && s="${s:0:297}..."
	printf '%s' "$s"
}

# Last non-empty line of a log file, or "(no output)".
last_line() {
	local l
	l=$(grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -n 1)
	printf '%s' "${l:-(no output)}"
}

now_ns() { date +%s%N; }

# "1.234 s" from nanoseconds.
fmt_s() { awk -v n="$1" 'BEGIN { printf "%.3f s", n / 1e9 }'; }

drop_caches() {
	sync
	echo 3 >/proc/sys/vm/drop_caches
}

# ---------------------------------------------------------------------------------------
# Cleanup. Everything this script mounts lives under $WORK/mnt or $WORK/tmpfs and every loop
# device it attaches is backed by a file under $WORK/img, so cleanup can find leftovers by
# looking (also those of an earlier run that was killed with SIGKILL).

cleanup_all() {
	local pid m img dev
	if [[ -n $TIMED_PID ]] && kill -0 "$TIMED_PID" 2>/dev/null; then
		kill -TERM "$TIMED_PID" 2>/dev/null # timeout passes it on to the command
		sleep 0.5
		kill -KILL -- "-$TIMED_PID" 2>/dev/null
		wait "$TIMED_PID" 2>/dev/null
	fi
	# BUTTER_PID is cleared once reaped, so it cannot name a recycled pid.
	pid=${BUTTER_PID:-}
	if [[ -n $pid ]]; then
		for m in $(findmnt -rn -o TARGET | grep -F "$WORK/mnt/" | sort -r); do
			[[ $(findmnt -rn -o FSTYPE --mountpoint "$m") == fuse* ]] && fusermount3 -u "$m" 2>/dev/null
		done
		sleep 0.2
		kill -TERM "$pid" 2>/dev/null
		sleep 0.2
		kill -KILL "$pid" 2>/dev/null
		wait "$pid" 2>/dev/null
		BUTTER_PID=
	fi
	[[ -d $WORK ]] || return 0
	for m in $(findmnt -rn -o TARGET | grep -E "^$WORK/(mnt|tmpfs)(/|$)" | sort -r); do
		if [[ $(findmnt -rn -o FSTYPE --mountpoint "$m") == fuse* ]]; then
			fusermount3 -u "$m" 2>/dev/null || fusermount3 -u -z "$m" 2>/dev/null
		else
			umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null
		fi
		mountpoint -q "$m" && log "warning: could not unmount $m"
	done
	for img in "$WORK"/img/*.img; do
		[[ -e $img ]] || continue
		for dev in $(losetup -n -O NAME -j "$img" 2>/dev/null); do
			losetup -d "$dev" 2>/dev/null || log "warning: could not detach $dev ($img)"
		done
	done
}

# ---------------------------------------------------------------------------------------
# Loop devices and kernel mounts.

# attach_loop IMAGE [ro] -> prints the device. Loop I/O is buffered unless BENCH_LOOP_DIO=1.
attach_loop() {
	local args=(--show -f)
	[[ ${2:-} == ro ]] && args+=(-r)
	[[ ${BENCH_LOOP_DIO:-0} == 1 ]] && args+=(--direct-io=on)
	losetup "${args[@]}" "$1"
}

# kmount FSTYPE IMAGE MNT ro|rw: attach a loop device and mount it. Sets KDEV; ERR on failure.
kmount() {
	local fstype=$1 img=$2 mnt=$3 mode=$4 out
	KDEV=
	mkdir -p "$mnt"
	if ! KDEV=$(attach_loop "$img" "$mode" 2>&1); then
		ERR="losetup $img: $(oneline "$KDEV")"
		KDEV=
		return 1
	fi
	if ! out=$(mount -t "$fstype" -o "$mode" "$KDEV" "$mnt" 2>&1); then
		ERR="mount -t $fstype $KDEV: $(oneline "$out")"
		losetup -d "$KDEV"
		KDEV=
		return 1
	fi
}

# kumount MNT: unmount and detach the loop device KDEV that kmount attached.
kumount() {
	local mnt=$1 i
	for i in 1 2 3 4 5; do
		umount "$mnt" 2>/dev/null && break
		sleep 1
	done
	mountpoint -q "$mnt" && umount -l "$mnt"
	[[ -n ${KDEV:-} ]] && losetup -d "$KDEV" 2>/dev/null
	KDEV=
}

# ---------------------------------------------------------------------------------------
# butter FUSE mounts. `butter mount --ro IMAGE MNT` stays in the foreground until unmounted.
# BUTTER_PID: the running butter mount process (one at a time), empty once reaped.
BUTTER_PID=


# butter_mount IMAGE MNT LOG: start butter in the background and wait until MNT is a
# mountpoint. ERR on failure (butter exited, or not mounted within BENCH_MOUNT_TIMEOUT s).
butter_mount() {
	local img=$1 mnt=$2 blog=$3 deadline rc
	BUTTER_PID=
	if [[ -n $BUTTER_ERR ]]; then
		ERR=$BUTTER_ERR
		return 1
	fi
	mkdir -p "$mnt"
	if mountpoint -q "$mnt"; then
		ERR="$mnt is already a mountpoint"
		return 1
	fi
	"$BUTTER_BIN" mount --ro "$img" "$mnt" >"$blog" 2>&1 </dev/null &
	BUTTER_PID=$!
	deadline=$((SECONDS + ${BENCH_MOUNT_TIMEOUT:-30}))
	while ! mountpoint -q "$mnt"; do
		if ! kill -0 "$BUTTER_PID" 2>/dev/null; then
			wait "$BUTTER_PID"
			rc=$?
			ERR="butter mount exited with status $rc before mounting: $(oneline "$(last_line "$blog")")"
			BUTTER_PID=
			return 1
		fi
		if ((SECONDS >= deadline)); then
			ERR="butter mount: $mnt not mounted after ${BENCH_MOUNT_TIMEOUT:-30} s"
			butter_umount "$mnt"
			return 1
		fi
		sleep 0.05
	done
	[[ $(findmnt -rn -o FSTYPE --mountpoint "$mnt") == fuse* ]] ||
		log "warning: $mnt is mounted but not as fuse"
}

# butter_umount MNT: fusermount3 -u, then wait for the butter process (TERM/KILL after 10 s).
# Sets BUTTER_RC to butter's exit status.
butter_umount() {
	local mnt=$1 i hwm
	BUTTER_RC=
	# The FUSE process's peak resident set (VmHWM) for the row being measured (RSS_TAG:
	# "row<TAB>system<TAB>run"), before the unmount.
	if [[ -n $BUTTER_PID && -n ${RSS_TAG:-} ]]; then
		hwm=$(awk '/^VmHWM:/ {print $2}' "/proc/$BUTTER_PID/status" 2>/dev/null)
		[[ -n $hwm ]] && printf '%s\t%s\n' "$RSS_TAG" "$hwm" >>"$WORK/rss.tsv"
	fi
	RSS_TAG=
	if mountpoint -q "$mnt"; then
		fusermount3 -u "$mnt" 2>/dev/null || { sleep 1 && fusermount3 -u "$mnt" 2>/dev/null; } ||
			fusermount3 -u -z "$mnt"
	fi
	[[ -n $BUTTER_PID ]] || return 0
	for ((i = 0; i < 200; i++)); do
		kill -0 "$BUTTER_PID" 2>/dev/null || break
		sleep 0.05
	done
	if kill -0 "$BUTTER_PID" 2>/dev/null; then
		log "warning: butter (pid $BUTTER_PID) still running 10 s after unmount; killing it"
		kill -TERM "$BUTTER_PID" 2>/dev/null
		sleep 1
		kill -KILL "$BUTTER_PID" 2>/dev/null
	fi
	wait "$BUTTER_PID" 2>/dev/null
	BUTTER_RC=$?
	BUTTER_PID=
}

# ---------------------------------------------------------------------------------------
# Mounting a dataset the way each system sees it.
#   butter: FUSE mount of the btrfs image     kernel: loop mount of the same btrfs image
#   ext4:   loop mount of the ext4 image       all read-only
# sys_mount SYSTEM DATASET LOG -> MNT set to the mountpoint; ERR on failure.

sys_mount() {
	local sys=$1 ds=$2 blog=$3
	MNT=$WORK/mnt/$sys
	case $sys in
	butter) butter_mount "$(ds_image "$ds" btrfs)" "$MNT" "$blog" ;;
	kernel) kmount btrfs "$(ds_image "$ds" btrfs)" "$MNT" ro ;;
	ext4) kmount ext4 "$(ds_image "$ds" ext4)" "$MNT" ro ;;
	*)
		ERR="unknown system $sys"
		return 1
		;;
	esac
}

sys_umount() {
	case $1 in
	butter) butter_umount "$MNT" ;;
	*) kumount "$MNT" ;;
	esac
}

# ---------------------------------------------------------------------------------------
# Recording.

# row_begin WORKLOAD ROW UNIT [NOTE]: declare a table row; UNIT is the throughput unit
# ("MiB/s", "files/s", ...); a measurement's amount is in UNIT without "/s".
row_begin() {
	printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(oneline "${4:-}")" >>"$WORK/rows.tsv"
}

# record WORKLOAD ROW SYSTEM RUN NS AMOUNT UNIT STATUS MESSAGE
record() {
	local msg
	msg=$(oneline "${9:-}")
	printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "$6" "$7" "$8" "$msg" \
		>>"$WORK/raw.tsv"
	case $8 in
	ok) log "  $(printf '%-6s run %s/%s' "$3" "$4" "$RUNS")  $(fmt_s "$5")  $(awk -v a="$6" -v n="$5" -v u="$7" \
		'BEGIN { printf "%.1f %s/s", a / (n / 1e9), u }')${msg:+  ($msg)}" ;;
	fail) log "  $(printf '%-6s run %s/%s' "$3" "$4" "$RUNS")  FAILED: $msg" ;;
	skip) log "  $(printf '%-6s' "$3")  skipped: $msg" ;;
	esac
}

# A system that failed once in a row is not run again in that row: FAILED["row/sys"]=1.
declare -A FAILED=()

# ---------------------------------------------------------------------------------------
# Timed commands. Each runs as `timeout -s KILL $BENCH_TIMEOUT bash -c FUNCTION ARGS...`, so
# the function must be exported (export -f) and take everything it needs as arguments.
# timed FUNCTION ARGS... -> NS (elapsed nanoseconds); returns the command's status; output in
# $TLOG. Status 137 means the timeout killed it.

# The command runs in the background and the script waits for it with `wait`, so Ctrl-C
# reaches the script's trap at once (timeout runs in its own process group); the trap kills
# TIMED_PID.
TIMED_PID=

timed() {
	local t0 t1 rc
	t0=$(now_ns)
	timeout -s KILL "$BENCH_TIMEOUT" bash -c '"$@"' _ "$@" >"$TLOG" 2>&1 </dev/null &
	TIMED_PID=$!
	wait "$TIMED_PID"
	rc=$?
	t1=$(now_ns)
	TIMED_PID=
	NS=$((t1 - t0))
	return $rc
}

# failure text for a timed command that returned RC.
timed_error() {
	if (($1 == 137)); then
		printf 'timed out after %s s' "$BENCH_TIMEOUT"
	else
		printf 'exit status %s: %s' "$1" "$(oneline "$(last_line "$TLOG")")"
	fi
}

# bench_mounted WORKLOAD ROW DATASET AMOUNT UNIT CMDFN [VERIFYFN]
# For each run and each system (interleaved, so slow drift hits all systems alike): mount the
# dataset, drop caches, time `CMDFN MNT SCRATCH`, on run 1 call `VERIFYFN MNT SCRATCH`
# (untimed; prints an error and returns non-zero when the result is wrong), unmount, record.
# SCRATCH is a per-measurement file on tmpfs that CMDFN may write its output to.
bench_mounted() {
	local wl=$1 row=$2 ds=$3 amount=$4 unit=$5 cmd=$6 verify=${7:-} run sys rc err
	for ((run = 1; run <= RUNS; run++)); do
		for sys in $SYSTEMS; do
			[[ -n ${FAILED["$row/$sys"]:-} ]] && continue
			TLOG=$WORK/logs/$wl-$sys-$run.log
			local scratch=$WORK/tmpfs/$wl-$sys.out
			rm -f "$scratch"
			if ! sys_mount "$sys" "$ds" "$WORK/logs/$wl-$sys-$run.mount.log"; then
				record "$wl" "$row" "$sys" "$run" 0 "$amount" "$unit" fail "$ERR"
				FAILED["$row/$sys"]=1
				continue
			fi
			drop_caches
			timed "$cmd" "$MNT" "$scratch"
			rc=$?
			err=
			((rc != 0)) && err=$(timed_error $rc)
			if [[ -z $err && $run == 1 && -n $verify && $BENCH_VERIFY == 1 ]]; then
				local verr
				verr=$("$verify" "$MNT" "$scratch" 2>&1) || err="wrong result: $(oneline "$verr")"
			fi
			sys_umount "$sys"
			if [[ -z $err && $sys == butter && -n ${BUTTER_RC:-} && $BUTTER_RC != 0 ]]; then
				err="butter mount exited with status $BUTTER_RC after unmount: $(oneline "$(last_line "$WORK/logs/$wl-$sys-$run.mount.log")")"
			fi
			if [[ -n $err ]]; then
				record "$wl" "$row" "$sys" "$run" "$NS" "$amount" "$unit" fail "$err"
				FAILED["$row/$sys"]=1
			else
				record "$wl" "$row" "$sys" "$run" "$NS" "$amount" "$unit" ok ""
			fi
			rm -f "$scratch"
		done
	done
}
