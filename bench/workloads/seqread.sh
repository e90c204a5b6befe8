# seqread: sequential read of one big file with a cold cache.
# butter FUSE mount vs the kernel's btrfs mount of the same image vs ext4 (same file).

register_workload seqread 10 bigfile \
	"sequential read (dd bs=1M) of a BENCH_FILE_MB MiB file, cold cache; MiB/s"

seqread_cmd() { dd if="$1/data/big.bin" of=/dev/null bs=1M status=none; }
export -f seqread_cmd

# Untimed, first run only: the whole file must read back as the bytes that were written.
seqread_verify() {
	local got want
	got=$($GEN digest "$1/data") || return 1
	want=$(sed -n 2p "$WORK/img/bigfile.stamp")
	[[ $got == "$want" ]] || {
		echo "read back $got, expected $want"
		return 1
	}
}

wl_seqread() {
	local row="seqread ($BENCH_FILE_MB MiB file)"
	row_begin seqread "$row" "MiB/s" "dd if=MNT/data/big.bin of=/dev/null bs=1M"
	bench_mounted seqread "$row" bigfile "$BENCH_FILE_MB" MiB seqread_cmd seqread_verify
}
