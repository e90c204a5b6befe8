# restore: copy every file out of an unmounted image.
# `butter restore IMAGE DIR` vs btrfs-progs `btrfs restore IMAGE DIR` (both userspace readers of
# the same image); ext4 has no counterpart. Output goes to tmpfs (BENCH_RESTORE_TARGET=disk:
# to $WORK/restore-out on the backing filesystem) and is removed after each run.

register_workload restore 30 "bigfile tree" \
	"butter restore vs btrfs restore of the bigfile and the tree images, cold cache; MiB/s, files/s"

restore_butter() { "$3" restore "$1" "$2"; }
restore_kernel() { btrfs restore "$1" "$2"; }
export -f restore_butter restore_kernel

restore_dir() {
	if [[ ${BENCH_RESTORE_TARGET:-tmpfs} == disk ]]; then
		echo "$WORK/restore-out"
	else
		echo "$WORK/tmpfs/restore"
	fi
}

# bench_restore ROW DATASET AMOUNT UNIT
bench_restore() {
	local row=$1 ds=$2 amount=$3 unit=$4 run sys rc err out img got want
	img=$(ds_image "$ds" btrfs)
	out=$(restore_dir)
	record restore "$row" ext4 1 0 "$amount" "$unit" skip "no ext4 counterpart"
	for ((run = 1; run <= RUNS; run++)); do
		for sys in butter kernel; do
			[[ " $SYSTEMS " == *" $sys "* ]] || continue
			[[ -n ${FAILED["$row/$sys"]:-} ]] && continue
			if [[ $sys == butter && -n $BUTTER_ERR ]]; then
				record restore "$row" butter "$run" 0 "$amount" "$unit" fail "$BUTTER_ERR"
				FAILED["$row/$sys"]=1
				continue
			fi
			TLOG=$WORK/logs/restore-$ds-$sys-$run.log
			rm -rf "$out"
			mkdir -p "$out"
			drop_caches
			if [[ $sys == butter ]]; then
				timed restore_butter "$img" "$out" "$BUTTER_BIN"
			else
				timed restore_kernel "$img" "$out"
			fi
			rc=$?
			err=
			((rc != 0)) && err=$(timed_error $rc)
			if [[ -z $err && $run == 1 && $BENCH_VERIFY == 1 ]]; then
				want=$(sed -n 2p "$WORK/img/$ds.stamp")
				if [[ ! -d $out/data ]]; then
					err="wrong result: no data/ directory in the output ($(find "$out" -mindepth 1 | wc -l) entries there)"
				else
					got=$($GEN digest "$out/data" 2>&1)
					[[ $got == "$want" ]] || err="wrong result: restored $(oneline "$got"), expected $want"
				fi
			fi
			if [[ -n $err ]]; then
				record restore "$row" "$sys" "$run" "$NS" "$amount" "$unit" fail "$err"
				FAILED["$row/$sys"]=1
			else
				record restore "$row" "$sys" "$run" "$NS" "$amount" "$unit" ok ""
			fi
			rm -rf "$out"
			sync
		done
	done
}

wl_restore() {
	local row
	row="restore ($BENCH_FILE_MB MiB file)"
	row_begin restore "$row" "MiB/s" "butter restore IMAGE DIR vs btrfs restore IMAGE DIR (btrfs-progs)"
	bench_restore "$row" bigfile "$BENCH_FILE_MB" MiB
	row="restore ($BENCH_FILES files)"
	row_begin restore "$row" "files/s" "butter restore IMAGE DIR vs btrfs restore IMAGE DIR (btrfs-progs)"
	bench_restore "$row" tree "$(ds_get tree files)" files
}
