# mkfs_rootdir: make a populated image from a directory tree.
# `butter mkfs --rootdir SRC IMAGE` vs `mkfs.btrfs --rootdir SRC IMAGE` (btrfs-progs) of the same
# BENCH_FILES-file tree (lib/gen.py tree, built once on the tmpfs), each into a fresh sparse
# image file of the same size; the time includes an fsync of the image. Run 1 of each is
# verified: the image is mounted by the kernel and its digest (names, sizes, content) must match
# the source's, and `diff -r` of the two images' trees must be empty. ext4 has no counterpart.

register_workload mkfs_rootdir 40 "" \
	"butter mkfs --rootdir vs mkfs.btrfs --rootdir of a BENCH_FILES-file tree into an image file; files/s"

# ARGS: SRC IMAGE [BUTTER] SIZE
mkfs_rootdir_butter() { "$3" mkfs -q -f -b "$4" --rootdir "$1" "$2" && sync "$2"; }
mkfs_rootdir_kernel() { mkfs.btrfs -q -f -b "$3" --rootdir "$1" "$2" && sync "$2"; }
export -f mkfs_rootdir_butter mkfs_rootdir_kernel

wl_mkfs_rootdir() {
	local src=$WORK/tmpfs/rootdir-src row files size run sys rc err want got img mnt out
	rm -rf "$src"
	mkdir -p "$src"
	log "mkfs_rootdir: building a $BENCH_FILES-file tree on the tmpfs"
	if ! $GEN tree "$src" "$BENCH_FILES" --per-dir "$BENCH_FILES_PER_DIR" >"$WORK/logs/mkfs_rootdir-gen.log" 2>&1; then
		die "mkfs_rootdir: generating the tree failed: $(last_line "$WORK/logs/mkfs_rootdir-gen.log")"
	fi
	want=$($GEN digest "$src") || die "mkfs_rootdir: digest of the source failed"
	files=$(sed -n 's/.*files=\([0-9]*\).*/\1/p' <<<"$want")
	# Same size for both: what du says the tree needs, twice, plus 512 MiB.
	size=$(($(du -sm "$src" | cut -f1) * 2 + 512))M
	row="mkfs --rootdir ($BENCH_FILES files)"
	row_begin mkfs_rootdir "$row" "files/s" "butter mkfs --rootdir vs mkfs.btrfs --rootdir, $size image file, fsync included"
	record mkfs_rootdir "$row" ext4 1 0 "$files" files skip "no ext4 counterpart"
	for ((run = 1; run <= RUNS; run++)); do
		for sys in butter kernel; do
			[[ -n ${FAILED["$row/$sys"]:-} ]] && continue
			if [[ $sys == butter && -n $BUTTER_ERR ]]; then
				record mkfs_rootdir "$row" butter "$run" 0 "$files" files fail "$BUTTER_ERR"
				FAILED["$row/$sys"]=1
				continue
			fi
			img=$WORK/img/rootdir.$sys.img
			TLOG=$WORK/logs/mkfs_rootdir-$sys-$run.log
			rm -f "$img"
			truncate -s "$size" "$img"
			sync
			if [[ $sys == butter ]]; then
				timed mkfs_rootdir_butter "$src" "$img" "$BUTTER_BIN" "$size"
			else
				timed mkfs_rootdir_kernel "$src" "$img" "$size"
			fi
			rc=$?
			err=
			((rc != 0)) && err=$(timed_error $rc)
			if [[ -z $err && $run == 1 && $BENCH_VERIFY == 1 ]]; then
				mnt=$WORK/mnt/rootdir-$sys
				if ! kmount btrfs "$img" "$mnt" ro; then
					err="the kernel cannot mount the image: $ERR"
				else
					got=$($GEN digest "$mnt" 2>&1)
					[[ $got == "$want" ]] || err="wrong result: image has $(oneline "$got"), source $want"
					kumount "$mnt"
				fi
				if [[ -z $err ]]; then
					out=$(btrfs check --readonly "$img" 2>&1) || err="btrfs check: $(oneline "$(tail -3 <<<"$out")")"
				fi
			fi
			if [[ -n $err ]]; then
				record mkfs_rootdir "$row" "$sys" "$run" "$NS" "$files" files fail "$err"
				FAILED["$row/$sys"]=1
			else
				record mkfs_rootdir "$row" "$sys" "$run" "$NS" "$files" files ok ""
			fi
		done
	done
	# Both images side by side: the same tree.
	if [[ $BENCH_VERIFY == 1 && -z ${FAILED["$row/butter"]:-} && -z ${FAILED["$row/kernel"]:-} ]]; then
		local bdev kdev
		if kmount btrfs "$WORK/img/rootdir.butter.img" "$WORK/mnt/rootdir-butter" ro; then
			bdev=$KDEV
			if kmount btrfs "$WORK/img/rootdir.kernel.img" "$WORK/mnt/rootdir-kernel" ro; then
				kdev=$KDEV
				if out=$(diff -r --no-dereference "$WORK/mnt/rootdir-butter" "$WORK/mnt/rootdir-kernel" 2>&1); then
					log "  diff -r of the two images: identical"
				else
					log "  diff -r of the two images differs: $(oneline "$(head -5 <<<"$out")")"
				fi
				KDEV=$kdev kumount "$WORK/mnt/rootdir-kernel"
			fi
			KDEV=$bdev
			kumount "$WORK/mnt/rootdir-butter"
		fi
	fi
	rm -rf "$src"
	rm -f "$WORK"/img/rootdir.*.img
}
