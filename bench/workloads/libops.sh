# libops: issue 31's library-only rows. The mount's metadata and fsync workloads with no FUSE:
# butter through the library (crates/butter/examples/libops.rs `lib IMAGE`) against the
# kernel's btrfs and ext4 through system calls from the same compiled loop (`dir MNT`), fresh
# equal loop-backed images, caches dropped before every phase. Rows: create, stat (cold
# cache), delete of BENCH_LIB_FILES files in 100 directories (100 bytes each), and
# BENCH_LIB_WRITES 4 KiB random writes with an fsync every 16 into a BENCH_LIB_MB MiB file
# (written untimed first). Each phase is its own process: opening the image (or the mounted
# directory) is part of the phase, and so is its end (a commit, or an fsync of the top).

register_workload libops 70 "" \
	"library vs system calls: create, stat, delete BENCH_LIB_FILES files; 4 KiB random writes with fsync every 16; fresh image; ops/s"

: "${BENCH_LIB_FILES:=100000}" "${BENCH_LIB_MB:=256}" "${BENCH_LIB_WRITES:=8192}" "${BENCH_LIB_IMAGE_MB:=2048}"
LIBOPS_BIN=${LIBOPS:-}
export BENCH_LIB_FILES BENCH_LIB_MB BENCH_LIB_WRITES

libops_bin() {
	[[ -n $LIBOPS_BIN && -x $LIBOPS_BIN ]] && return 0
	local target=${CARGO_TARGET_DIR:-$REPO/target}
	[[ $target == /* ]] || target=$REPO/$target
	LIBOPS_BIN=$target/release/examples/libops
	if ((NO_BUILD)) && [[ -x $LIBOPS_BIN ]]; then return 0; fi
	log "building libops: cargo build --release -p butter --example libops"
	(cd "$REPO" && cargo build --release -p butter --example libops) >"$WORK/logs/build-libops.log" 2>&1 ||
		LIBOPS_BIN=
}

# lib_run SYSTEM TARGET PHASE ARGS... (TARGET: the image for butter, the mount point else)
lib_run() {
	local sys=$1 target=$2
	shift 2
	if [[ $sys == butter ]]; then
		"$LIBOPS" lib "$target" "$@"
	else
		"$LIBOPS" dir "$target" "$@"
	fi
}
export -f lib_run

wl_libops() {
	libops_bin
	export LIBOPS=$LIBOPS_BIN
	local n=$BENCH_LIB_FILES w=$BENCH_LIB_WRITES run sys img mnt err i phase rc
	local rows=("library create ($n files)" "library stat ($n files, cold cache)" "library delete ($n files)"
		"library 4k random writes, fsync/16 ($w writes)")
	row_begin libops "${rows[0]}" "files/s" "butter: Fs::create + write through the library; others: open(O_CREAT|O_EXCL), write 100 bytes, close; commit / fsync of the top dir"
	row_begin libops "${rows[1]}" "files/s" "butter: Fs::lookup_item; others: stat(2); after drop_caches"
	row_begin libops "${rows[2]}" "files/s" "butter: Fs::unlink, rmdir; others: unlink(2), rmdir(2)"
	row_begin libops "${rows[3]}" "writes/s" "4 KiB pwrite at seeded random offsets of a ${BENCH_LIB_MB} MiB file, fsync every 16"
	for ((run = 1; run <= RUNS; run++)); do
		for sys in butter kernel ext4; do
			[[ -n ${FAILED["${rows[0]}/$sys"]:-} ]] && continue
			if [[ -z $LIBOPS ]]; then
				for r in "${rows[@]}"; do record libops "$r" "$sys" "$run" 0 1 ops fail "cannot build libops (see $WORK/logs/build-libops.log)"; done
				FAILED["${rows[0]}/$sys"]=1
				continue
			fi
			img=$WORK/img/libops-$sys.img
			mnt=$WORK/mnt/libops-$sys
			rm -f "$img"
			truncate -s "${BENCH_LIB_IMAGE_MB}M" "$img"
			if [[ $sys == ext4 ]]; then
				mkfs.ext4 -F -q -E lazy_itable_init=0,lazy_journal_init=0 "$img" >/dev/null 2>&1
			else
				mkfs.btrfs -f -q "$img" >/dev/null 2>&1
			fi
			err=
			i=0
			for phase in "create $n" "stat $n" "delete $n" "randprep $BENCH_LIB_MB" "randwrite $BENCH_LIB_MB $w"; do
				local target=$img
				if [[ $sys != butter ]]; then
					kmount "$( [[ $sys == ext4 ]] && echo ext4 || echo btrfs)" "$img" "$mnt" rw || { err="mount: $ERR"; }
					target=$mnt
				fi
				TLOG=$WORK/logs/libops-${phase%% *}-$sys-$run.log
				if [[ -z $err ]]; then
					drop_caches
					# shellcheck disable=SC2086
					timed lib_run "$sys" "$target" $phase
					rc=$?
					((rc != 0)) && err="${phase%% *}: $(timed_error $rc)"
				fi
				[[ $sys != butter ]] && kumount "$mnt"
				if [[ ${phase%% *} != randprep ]]; then
					if [[ -n $err ]]; then
						record libops "${rows[$i]}" "$sys" "$run" "${NS:-0}" "$( ((i == 3)) && echo "$w" || echo "$n")" ops fail "$err"
					else
						record libops "${rows[$i]}" "$sys" "$run" "$NS" "$( ((i == 3)) && echo "$w" || echo "$n")" ops ok ""
					fi
					i=$((i + 1))
				fi
			done
			[[ -n $err ]] && FAILED["${rows[0]}/$sys"]=1
			if [[ $sys == butter && -z $err ]]; then
				local out
				out=$("$BUTTER_BIN" check "$img" 2>&1) || log "  warning: butter check of the libops image failed: $(oneline "$out")"
			fi
			rm -f "$img"
		done
	done
}
