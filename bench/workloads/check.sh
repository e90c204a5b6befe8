# check: the offline checker against btrfs-progs' on the same image.
# One image of a BENCH_FILES-file tree (lib/gen.py tree) made by `butter mkfs --rootdir`
# (issue 34 measures a /usr image the same way: BENCH_CHECK_SRC=/usr uses that tree
# instead). The row, cold cache (dropped before every run: btrfs check drops the image's
# cached pages itself when it opens it, so it always reads cold), median of BENCH_RUNS:
# `butter check IMAGE` vs `btrfs check --readonly IMAGE`, each run's peak RSS (GNU time) in
# its message. ext4 has no counterpart. A second row repairs the same image with its
# superblocks' bytes_used made wrong (lib/gen.py damage-super; the one damage both repairs
# mend that a shell can make): `butter check --repair` vs `btrfs check --repair --force`
# (--force: no 10-second pause before writing), each run on a fresh copy of the damaged
# image; a run counts only when `btrfs check` finds the result clean.
# BENCH_CHECK_IMAGE=IMG checks that image instead (a kernel-made one with snapshots and
# reflinks, say; issue 34's second image): a copy is checked, so IMG is never written; its
# row counts the inodes butter check reports.

register_workload check 45 "" \
	"butter check vs btrfs check --readonly on one image made by butter mkfs --rootdir; files/s, peak RSS"

# ARGS: IMAGE [BUTTER] RSSFILE
check_butter() { /usr/bin/time -f %M -o "$3" "$2" check "$1" >/dev/null; }
check_kernel() { /usr/bin/time -f %M -o "$2" btrfs check --readonly "$1" >/dev/null; }
repair_butter() { /usr/bin/time -f %M -o "$3" "$2" check --repair "$1" >/dev/null; }
repair_kernel() { /usr/bin/time -f %M -o "$2" btrfs check --repair --force "$1" >/dev/null 2>&1; }
export -f check_butter check_kernel repair_butter repair_kernel

# ARGS: IMAGE ROW FILES. The check row's runs, butter and btrfs check in turn, cold.
check_runs() {
	local img=$1 row=$2 files=$3 run sys rc rss mib
	for ((run = 1; run <= RUNS; run++)); do
		for sys in butter kernel; do
			[[ -n ${FAILED["$row/$sys"]:-} ]] && continue
			drop_caches
			TLOG=$WORK/logs/check-$sys-$run.log
			rss=$WORK/tmpfs/check-rss
			if [[ $sys == butter ]]; then
				timed check_butter "$img" "$BUTTER_BIN" "$rss"
			else
				timed check_kernel "$img" "$rss"
			fi
			rc=$?
			mib=$(($(tail -1 "$rss" 2>/dev/null || echo 0) / 1024))
			if ((rc != 0)); then
				record check "$row" "$sys" "$run" "$NS" "$files" files fail "$(timed_error $rc)"
				FAILED["$row/$sys"]=1
			else
				record check "$row" "$sys" "$run" "$NS" "$files" files ok "peak RSS $mib MiB"
			fi
		done
	done
}

wl_check() {
	local src=${BENCH_CHECK_SRC:-} row files size run sys rc err img rss mib
	if [[ ! -x /usr/bin/time ]]; then
		record check "check" butter 1 0 0 files skip "GNU time (/usr/bin/time) is not installed"
		return
	fi
	if [[ -n ${BENCH_CHECK_IMAGE:-} ]]; then
		wl_check_image "$BENCH_CHECK_IMAGE"
		return
	fi
	if [[ -z $src ]]; then
		src=$WORK/tmpfs/check-src
		rm -rf "$src"
		mkdir -p "$src"
		log "check: building a $BENCH_FILES-file tree on the tmpfs"
		if ! $GEN tree "$src" "$BENCH_FILES" --per-dir "$BENCH_FILES_PER_DIR" >"$WORK/logs/check-gen.log" 2>&1; then
			die "check: generating the tree failed: $(last_line "$WORK/logs/check-gen.log")"
		fi
	fi
	files=$(find "$src" -xdev | wc -l)
	size=$(($(du -smx "$src" | cut -f1) * 2 + 512))M
	img=$WORK/img/check.img
	rm -f "$img"
	truncate -s "$size" "$img"
	if [[ -n $BUTTER_ERR ]] || ! "$BUTTER_BIN" mkfs -q -f --rootdir "$src" "$img" >"$WORK/logs/check-mkfs.log" 2>&1; then
		record check "check ($files files)" butter 1 0 "$files" files fail "making the image: ${BUTTER_ERR:-$(last_line "$WORK/logs/check-mkfs.log")}"
		return
	fi
	row="check ($files files)"
	row_begin check "$row" "files/s" "butter check vs btrfs check --readonly, one image made by butter mkfs --rootdir, cold cache"
	record check "$row" ext4 1 0 "$files" files skip "no ext4 counterpart"
	check_runs "$img" "$row" "$files"
	wl_check_repair "$img" "$files"
	[[ -z ${BENCH_CHECK_SRC:-} ]] && rm -rf "$src"
	rm -f "$img"
}

# ARGS: IMAGE FILES. The repair row (see the top of this file).
wl_check_repair() {
	local img=$1 files=$2 bad=$WORK/img/check-damaged.img copy=$WORK/img/check-repair.img
	local row="repair ($files files)" run sys rc rss mib
	cp --sparse=always "$img" "$bad"
	if ! $GEN damage-super "$bad" 65536 >"$WORK/logs/check-damage.log" 2>&1; then
		record check "$row" butter 1 0 "$files" files fail "damaging the image: $(last_line "$WORK/logs/check-damage.log")"
		rm -f "$bad"
		return
	fi
	row_begin check "$row" "files/s" "butter check --repair vs btrfs check --repair --force, superblock bytes_used damaged, a fresh copy each run, cold cache"
	record check "$row" ext4 1 0 "$files" files skip "no ext4 counterpart"
	for ((run = 1; run <= RUNS; run++)); do
		for sys in butter kernel; do
			[[ -n ${FAILED["$row/$sys"]:-} ]] && continue
			cp --sparse=always "$bad" "$copy"
			drop_caches
			TLOG=$WORK/logs/check-repair-$sys-$run.log
			rss=$WORK/tmpfs/check-rss
			if [[ $sys == butter ]]; then
				timed repair_butter "$copy" "$BUTTER_BIN" "$rss"
			else
				timed repair_kernel "$copy" "$rss"
			fi
			rc=$?
			mib=$(($(tail -1 "$rss" 2>/dev/null || echo 0) / 1024))
			if ((rc != 0)); then
				record check "$row" "$sys" "$run" "$NS" "$files" files fail "$(timed_error $rc)"
				FAILED["$row/$sys"]=1
			elif ! btrfs check --readonly "$copy" >"$WORK/logs/check-after-$sys.log" 2>&1; then
				record check "$row" "$sys" "$run" "$NS" "$files" files fail "btrfs check finds the repaired image damaged"
				FAILED["$row/$sys"]=1
			else
				record check "$row" "$sys" "$run" "$NS" "$files" files ok "peak RSS $mib MiB"
			fi
		done
	done
	rm -f "$bad" "$copy"
}

# ARGS: IMAGE. The check and repair rows on a copy of an existing image (BENCH_CHECK_IMAGE).
wl_check_image() {
	local img=$WORK/img/check.img files row run sys rc rss mib
	if [[ ! -f $1 ]]; then
		record check "check (image)" butter 1 0 0 files fail "BENCH_CHECK_IMAGE=$1 is not a file"
		return
	fi
	cp --sparse=always "$1" "$img"
	files=$("$BUTTER_BIN" check "$img" 2>/dev/null | sed -n 's/.* \([0-9][0-9]*\) inodes.*/\1/p')
	if [[ -z $files ]]; then
		record check "check (image)" butter 1 0 0 files fail "butter check could not count the image's inodes"
		rm -f "$img"
		return
	fi
	row="check ($files inodes, $(basename "$1"))"
	row_begin check "$row" "files/s" "butter check vs btrfs check --readonly of a copy of $(basename "$1"), cold cache"
	record check "$row" ext4 1 0 "$files" files skip "no ext4 counterpart"
	check_runs "$img" "$row" "$files"
	wl_check_repair "$img" "$files"
	rm -f "$img"
}
