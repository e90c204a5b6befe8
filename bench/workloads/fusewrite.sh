# fusewrite: write workloads on a read-write butter FUSE mount vs the kernel's btrfs vs ext4,
# plus nullfs (crates/butter-cli/examples/nullfs.rs, a FUSE filesystem that keeps names and
# sizes in memory and throws data away) to show how much of butter's time is FUSE itself.
#
# Every run gets fresh, equal, loop-backed images (mkfs untimed), so the systems write to the
# same kind of backing file; nullfs has no image. Preparation (fio's file layout, sysbench's
# prepare) is untimed, then caches are dropped and the timed command runs.
#
#   fio_randwrite  fio 4 KiB random writes, direct=1 (the seed 000 benchmark, scaled down)
#   sysbench_seqwr sysbench fileio seqwr (seed 002)       sysbench_rndwr  sysbench fileio rndwr
#   meta           create, stat, delete BENCH_META_FILES small files (three rows)
#
# fio and sysbench come from Debian and are installed here on first use (not in CI).

register_workload fio_randwrite 50 "" \
	"fio 4 KiB random writes, direct=1, BENCH_FIO_JOBS jobs x BENCH_FIO_MB MiB, fresh image; MiB/s"
register_workload sysbench_seqwr 51 "" \
	"sysbench fileio seqwr over BENCH_SB_FILES files / BENCH_SB_MB MiB, fresh image; MiB/s"
register_workload sysbench_rndwr 52 "" \
	"sysbench fileio rndwr (4 KiB, BENCH_SB_EVENTS writes) over the same files, fresh image; MiB/s"
register_workload meta 53 "" \
	"create, stat, then delete BENCH_META_FILES small files in 100 dirs, fresh image; files/s"

# butter serves through /dev/fuse (-o uring=off); butter-uring through FUSE over io_uring
# (the fuse module's enable_uring is set to Y for its mount only, then put back).
FW_SYSTEMS=${BENCH_FW_SYSTEMS:-"butter butter-uring kernel ext4 nullfs"}
: "${BENCH_FW_IMAGE_MB:=2048}" "${BENCH_FIO_JOBS:=2}" "${BENCH_FIO_MB:=64}"
: "${BENCH_SB_FILES:=16}" "${BENCH_SB_MB:=256}" "${BENCH_SB_THREADS:=4}" "${BENCH_SB_EVENTS:=16384}"
: "${BENCH_META_FILES:=100000}"
NULLFS_BIN=${NULLFS:-}
NULLFS_PID=

# Installs Debian packages for commands that are missing (bench only, never CI).
fw_need() { # COMMAND PACKAGE ...
	local missing=() cmd pkg
	while (($# >= 2)); do
		cmd=$1 pkg=$2
		shift 2
		command -v "$cmd" >/dev/null || missing+=("$pkg")
	done
	((${#missing[@]})) || return 0
	log "installing ${missing[*]} (apt-get)"
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >"$WORK/logs/apt.log" 2>&1 ||
		{ apt-get update -qq >/dev/null 2>&1 &&
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >"$WORK/logs/apt.log" 2>&1; } ||
		die "apt-get install ${missing[*]} failed (see $WORK/logs/apt.log)"
}

# The nullfs example, next to the butter binary (built once per bench/run unless NULLFS=...).
fw_nullfs_bin() {
	[[ -n $NULLFS_BIN && -x $NULLFS_BIN ]] && return 0
	local target=${CARGO_TARGET_DIR:-$REPO/target}
	[[ $target == /* ]] || target=$REPO/$target
	NULLFS_BIN=$target/release/examples/nullfs
	if ((NO_BUILD)) && [[ -x $NULLFS_BIN ]]; then return 0; fi
	log "building nullfs: cargo build --release -p butter-cli --example nullfs"
	(cd "$REPO" && cargo build --release -p butter-cli --example nullfs) >"$WORK/logs/build-nullfs.log" 2>&1 ||
		NULLFS_BIN=
}

# fw_mount SYSTEM LOG -> MNT; ERR on failure. A fresh image per call (untimed).
fw_mount() {
	local sys=$1 blog=$2 img=$WORK/img/fusewrite-$1.img out deadline
	MNT=$WORK/mnt/fw-$sys
	mkdir -p "$MNT"
	case $sys in
	butter | butter-uring | kernel)
		rm -f "$img"
		truncate -s "${BENCH_FW_IMAGE_MB}M" "$img"
		out=$(mkfs.btrfs -f -q "$img" 2>&1) || {
			ERR="mkfs.btrfs: $(oneline "$out")"
			return 1
		}
		if [[ $sys == kernel ]]; then
			kmount btrfs "$img" "$MNT" rw
			return
		fi
		[[ -z $BUTTER_ERR ]] || {
			ERR=$BUTTER_ERR
			return 1
		}
		if [[ $sys == butter-uring ]]; then
			fw_uring_mount "$img" "$blog" || return 1
		else
			"$BUTTER_BIN" mount -o uring=off "$img" "$MNT" >"$blog" 2>&1 </dev/null &
			BUTTER_PID=$!
		fi
		;;
	ext4)
		rm -f "$img"
		truncate -s "${BENCH_FW_IMAGE_MB}M" "$img"
		out=$(mkfs.ext4 -F -q -E lazy_itable_init=0,lazy_journal_init=0 "$img" 2>&1) || {
			ERR="mkfs.ext4: $(oneline "$out")"
			return 1
		}
		kmount ext4 "$img" "$MNT" rw
		return
		;;
	nullfs)
		fw_nullfs_bin
		[[ -n $NULLFS_BIN ]] || {
			ERR="cannot build nullfs (see $WORK/logs/build-nullfs.log)"
			return 1
		}
		"$NULLFS_BIN" "$MNT" >"$blog" 2>&1 </dev/null &
		BUTTER_PID=$! # stopped like butter: fusermount3 -u, then wait
		;;
	esac
	deadline=$((SECONDS + ${BENCH_MOUNT_TIMEOUT:-30}))
	while ! mountpoint -q "$MNT"; do
		if ! kill -0 "$BUTTER_PID" 2>/dev/null; then
			wait "$BUTTER_PID"
			ERR="$sys mount exited with status $? before mounting: $(oneline "$(last_line "$blog")")"
			BUTTER_PID=
			return 1
		fi
		if ((SECONDS >= deadline)); then
			ERR="$sys: $MNT not mounted after ${BENCH_MOUNT_TIMEOUT:-30} s"
			butter_umount "$MNT"
			return 1
		fi
		sleep 0.05
	done
}

# butter mounted with FUSE over io_uring: the kernel offers it while enable_uring is Y, which
# only matters at the mount's INIT; the old value is put back once the mount is up.
fw_uring_mount() { # IMAGE LOG
	local p=/sys/module/fuse/parameters/enable_uring old deadline
	[[ -w $p ]] || {
		ERR="$p missing or not writable: this kernel has no FUSE over io_uring"
		return 1
	}
	old=$(cat "$p")
	echo Y >"$p"
	"$BUTTER_BIN" mount -o uring=on "$1" "$MNT" >"$2" 2>&1 </dev/null &
	BUTTER_PID=$!
	deadline=$((SECONDS + ${BENCH_MOUNT_TIMEOUT:-30}))
	while ! mountpoint -q "$MNT" && kill -0 "$BUTTER_PID" 2>/dev/null && ((SECONDS < deadline)); do
		sleep 0.05
	done
	echo "$old" >"$p"
	! grep -q "through /dev/fuse" "$2" || log "warning: butter-uring serves through /dev/fuse: $(oneline "$(grep "through /dev/fuse" "$2" | tail -1)")"
}

fw_umount() { # SYSTEM
	case $1 in
	butter | butter-uring | nullfs) butter_umount "$MNT" ;;
	*) kumount "$MNT" ;;
	esac
	rm -f "$WORK/img/fusewrite-$1.img"
}

# fw_measure WORKLOAD ROW AMOUNT UNIT PREPFN CMDFN: for each run and system (interleaved):
# fresh mount, `PREPFN MNT` untimed, drop caches, `CMDFN MNT SCRATCH` timed, unmount (for
# butter the exit status must be 0), record.
fw_measure() {
	local wl=$1 row=$2 amount=$3 unit=$4 prep=$5 cmd=$6 run sys rc err
	for ((run = 1; run <= RUNS; run++)); do
		for sys in $FW_SYSTEMS; do
			[[ -n ${FAILED["$row/$sys"]:-} ]] && continue
			TLOG=$WORK/logs/$wl-$sys-$run.log
			local blog=$WORK/logs/$wl-$sys-$run.mount.log
			if ! fw_mount "$sys" "$blog"; then
				record "$wl" "$row" "$sys" "$run" 0 "$amount" "$unit" fail "$ERR"
				FAILED["$row/$sys"]=1
				continue
			fi
			err=
			if [[ -n $prep ]] && ! "$prep" "$MNT" >"$WORK/logs/$wl-$sys-$run.prep.log" 2>&1; then
				err="prepare failed: $(oneline "$(last_line "$WORK/logs/$wl-$sys-$run.prep.log")")"
			fi
			if [[ -z $err ]]; then
				drop_caches
				timed "$cmd" "$MNT" "$WORK/tmpfs/$wl-$sys.out"
				rc=$?
				((rc != 0)) && err=$(timed_error $rc)
			fi
			RSS_TAG="$row	$sys	$run"
			fw_umount "$sys"
			if [[ -z $err && $sys == butter && -n ${BUTTER_RC:-} && $BUTTER_RC != 0 ]]; then
				err="butter mount exited with status $BUTTER_RC after unmount: $(oneline "$(last_line "$blog")")"
			fi
			if [[ -n $err ]]; then
				record "$wl" "$row" "$sys" "$run" "${NS:-0}" "$amount" "$unit" fail "$err"
				FAILED["$row/$sys"]=1
			else
				record "$wl" "$row" "$sys" "$run" "$NS" "$amount" "$unit" ok ""
			fi
			rm -f "$WORK/tmpfs/$wl-$sys.out"
		done
	done
}

# ---------------------------------------------------------------------------------------
# fio: 4 KiB random writes with O_DIRECT, psync engine, fixed seed; files laid out untimed.
fio_args() { # MNT
	printf '%s\n' --name=randwrite --directory="$1" --rw=randwrite --bs=4k --direct=1 \
		--ioengine=psync --iodepth=1 --numjobs="$BENCH_FIO_JOBS" --size="${BENCH_FIO_MB}M" \
		--randrepeat=1 --randseed=42 --group_reporting=1 --end_fsync=1
}
fio_prep() { fio $(fio_args "$1") --create_only=1 >/dev/null; }
fio_cmd() { fio $(fio_args "$1") --output-format=terse --output="$2"; }
export -f fio_args fio_cmd
export BENCH_FIO_JOBS BENCH_FIO_MB

wl_fio_randwrite() {
	fw_need fio fio
	local mb=$((BENCH_FIO_JOBS * BENCH_FIO_MB))
	local row="fio randwrite 4k direct ($BENCH_FIO_JOBS jobs, $mb MiB)"
	row_begin fio_randwrite "$row" "MiB/s" "fio --rw=randwrite --bs=4k --direct=1 --ioengine=psync --numjobs=$BENCH_FIO_JOBS --size=${BENCH_FIO_MB}M --end_fsync=1"
	fw_measure fio_randwrite "$row" "$mb" MiB fio_prep fio_cmd
}

# ---------------------------------------------------------------------------------------
# sysbench fileio: prepare untimed, then a fixed number of writes (--time=0 --events=N).
sb_args() { # MODE
	printf '%s\n' --file-num="$BENCH_SB_FILES" --file-total-size="${BENCH_SB_MB}M" --rand-seed=1
}
sb_prep() { (cd "$1" && sysbench fileio $(sb_args) prepare >/dev/null); }
sysbench_seqwr_cmd() {
	cd "$1" && sysbench fileio $(sb_args) --threads=1 --file-test-mode=seqwr \
		--file-block-size=16384 --time=0 --events=$((BENCH_SB_MB * 64)) run >"$2"
}
sysbench_rndwr_cmd() {
	cd "$1" && sysbench fileio $(sb_args) --threads="$BENCH_SB_THREADS" --file-test-mode=rndwr \
		--file-block-size=4096 --time=0 --events="$BENCH_SB_EVENTS" run >"$2"
}
export -f sb_args sysbench_seqwr_cmd sysbench_rndwr_cmd
export BENCH_SB_FILES BENCH_SB_MB BENCH_SB_THREADS BENCH_SB_EVENTS

wl_sysbench_seqwr() {
	fw_need sysbench sysbench
	local row="sysbench seqwr ($BENCH_SB_FILES files, $BENCH_SB_MB MiB, 16 KiB)"
	row_begin sysbench_seqwr "$row" "MiB/s" "sysbench fileio --file-test-mode=seqwr --threads=1 --file-fsync-freq=100 (prepare untimed)"
	fw_measure sysbench_seqwr "$row" "$BENCH_SB_MB" MiB sb_prep sysbench_seqwr_cmd
}

wl_sysbench_rndwr() {
	fw_need sysbench sysbench
	local mb=$((BENCH_SB_EVENTS * 4 / 1024))
	local row="sysbench rndwr ($BENCH_SB_THREADS threads, $BENCH_SB_EVENTS x 4 KiB)"
	row_begin sysbench_rndwr "$row" "MiB/s" "sysbench fileio --file-test-mode=rndwr --threads=$BENCH_SB_THREADS --file-fsync-freq=100 over $BENCH_SB_FILES files / $BENCH_SB_MB MiB (prepare untimed)"
	fw_measure sysbench_rndwr "$row" "$mb" MiB sb_prep sysbench_rndwr_cmd
}

# ---------------------------------------------------------------------------------------
# meta: one python process per phase; 100-byte files in 100 directories; each phase ends
# with an fsync of the top directory (a commit in butter and the kernel's btrfs).
meta_py() { # PHASE MNT N
	python3 - "$@" <<'EOF'
import os, sys
phase, mnt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
top = os.path.join(mnt, "meta")
data = b"m" * 100
if phase == "create":
    os.mkdir(top)
    for d in range(100):
        os.mkdir(os.path.join(top, "d%03d" % d))
for i in range(n):
    p = os.path.join(top, "d%03d" % (i % 100), "file-%07d" % i)
    if phase == "create":
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, data)
        os.close(fd)
    elif phase == "stat":
        if os.stat(p).st_size != 100:
            sys.exit("wrong size: " + p)
    else:
        os.unlink(p)
if phase == "delete":
    for d in range(100):
        os.rmdir(os.path.join(top, "d%03d" % d))
fd = os.open(top, os.O_RDONLY)
os.fsync(fd)
os.close(fd)
EOF
}
meta_create_cmd() { meta_py create "$1" "$BENCH_META_FILES"; }
meta_stat_cmd() { meta_py stat "$1" "$BENCH_META_FILES"; }
meta_delete_cmd() { meta_py delete "$1" "$BENCH_META_FILES"; }
export -f meta_py meta_create_cmd meta_stat_cmd meta_delete_cmd
export BENCH_META_FILES

# Three rows from one mount per run: create (timed), drop caches, stat (timed), delete (timed).
wl_meta() {
	local n=$BENCH_META_FILES run sys rc err phase
	local rows=("meta create ($n files)" "meta stat ($n files, cold cache)" "meta delete ($n files)")
	row_begin meta "${rows[0]}" "files/s" "python: open(O_CREAT|O_EXCL), write 100 bytes, close; fsync of the top dir"
	row_begin meta "${rows[1]}" "files/s" "python: stat every file after drop_caches"
	row_begin meta "${rows[2]}" "files/s" "python: unlink every file, rmdir the dirs; fsync of the top dir"
	for ((run = 1; run <= RUNS; run++)); do
		for sys in $FW_SYSTEMS; do
			[[ -n ${FAILED["${rows[0]}/$sys"]:-} ]] && continue
			local blog=$WORK/logs/meta-$sys-$run.mount.log
			if ! fw_mount "$sys" "$blog"; then
				for r in "${rows[@]}"; do record meta "$r" "$sys" "$run" 0 "$n" files fail "$ERR"; done
				FAILED["${rows[0]}/$sys"]=1
				continue
			fi
			err=
			local i=0
			for phase in create stat delete; do
				TLOG=$WORK/logs/meta-$phase-$sys-$run.log
				[[ $phase == stat ]] && drop_caches
				if [[ -z $err ]]; then
					timed "meta_${phase}_cmd" "$MNT"
					rc=$?
					((rc != 0)) && err="$phase: $(timed_error $rc)"
				fi
				if [[ -n $err ]]; then
					record meta "${rows[$i]}" "$sys" "$run" "${NS:-0}" "$n" files fail "$err"
				else
					record meta "${rows[$i]}" "$sys" "$run" "$NS" "$n" files ok ""
				fi
				i=$((i + 1))
			done
			RSS_TAG="meta ($n files)	$sys	$run"
			fw_umount "$sys"
			if [[ -z $err && $sys == butter && -n ${BUTTER_RC:-} && $BUTTER_RC != 0 ]]; then
				record meta "${rows[2]}" "$sys" "$run" 0 "$n" files fail \
					"butter mount exited with status $BUTTER_RC after unmount: $(oneline "$(last_line "$blog")")"
				err=1
			fi
			[[ -n $err ]] && FAILED["${rows[0]}/$sys"]=1
		done
	done
}

# ---------------------------------------------------------------------------------------
# ddwrite: one streaming write of BENCH_DD_MB MiB in 16 KiB writes, fsync at the end
# (conv=fsync). The source is pseudo-random bytes in the tmpfs, made once (untimed).
register_workload ddwrite 54 "" \
	"dd bs=16k of BENCH_DD_MB MiB of random bytes into a new file, conv=fsync, fresh image; MiB/s"
: "${BENCH_DD_MB:=256}"
export BENCH_DD_MB
dd_cmd() { dd if="$BENCH_TMPFS/dd-src.bin" of="$1/big.bin" bs=16k conv=fsync status=none; }
export -f dd_cmd
wl_ddwrite() {
	export BENCH_TMPFS=$WORK/tmpfs
	[[ -s $BENCH_TMPFS/dd-src.bin && $(stat -c %s "$BENCH_TMPFS/dd-src.bin") == $((BENCH_DD_MB << 20)) ]] ||
		head -c $((BENCH_DD_MB << 20)) /dev/urandom >"$BENCH_TMPFS/dd-src.bin"
	local row="write $BENCH_DD_MB MiB, 16 KiB (dd conv=fsync)"
	row_begin ddwrite "$row" "MiB/s" "dd if=random of=MNT/big.bin bs=16k conv=fsync"
	fw_measure ddwrite "$row" "$BENCH_DD_MB" MiB "" dd_cmd
}

# ---------------------------------------------------------------------------------------
# untar: extract a tarball of BENCH_UNTAR_DIRS x BENCH_UNTAR_FILES entries (sizes 0-16 KiB,
# seeded, made once in the tmpfs, untimed), then fsync the top directory.
register_workload untar 55 "" \
	"tar -x of a tree of BENCH_UNTAR_DIRS dirs x BENCH_UNTAR_FILES files (0-16 KiB), fsync of the top dir, fresh image; entries/s"
: "${BENCH_UNTAR_DIRS:=30}" "${BENCH_UNTAR_FILES:=119}"
untar_cmd() { tar -xf "$BENCH_TMPFS/untar.tar" -C "$1" && sync "$1/tree"; }
export -f untar_cmd
wl_untar() {
	export BENCH_TMPFS=$WORK/tmpfs
	local tar=$BENCH_TMPFS/untar.tar entries=$((BENCH_UNTAR_DIRS * (BENCH_UNTAR_FILES + 1) + 1))
	if [[ ! -s $tar ]] || [[ $(tar -tf "$tar" | wc -l) != "$entries" ]]; then
		rm -rf "$BENCH_TMPFS/untar-src"
		python3 - "$BENCH_TMPFS/untar-src/tree" "$BENCH_UNTAR_DIRS" "$BENCH_UNTAR_FILES" <<'PY'
import os, random, sys
top, dirs, files = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(7)
for d in range(dirs):
    p = os.path.join(top, "dir%03d" % d)
    os.makedirs(p)
    for f in range(files):
        with open(os.path.join(p, "file-%04d.txt" % f), "wb") as fh:
            fh.write(rng.randbytes(rng.choice([0, 100, 1000, 3000, 4096, 9000, 16384])))
PY
		tar -cf "$tar" -C "$BENCH_TMPFS/untar-src" tree
		rm -rf "$BENCH_TMPFS/untar-src"
	fi
	local row="untar ($entries entries)"
	row_begin untar "$row" "entries/s" "tar -xf (files 0-16 KiB) then sync of the top dir"
	fw_measure untar "$row" "$entries" entries "" untar_cmd
}
