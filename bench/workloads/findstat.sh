# findstat: walk a tree of many small files and stat every entry, cold cache.

register_workload findstat 20 tree \
	"find -printf (lstat of every entry) over a BENCH_FILES-file nested tree, cold cache; entries/s"

# %s and %T@ make find lstat every entry; the output goes to a file on tmpfs.
findstat_cmd() { find "$1/data" -printf '%y\t%s\t%T@\t%P\n' >"$2"; }
export -f findstat_cmd

# Untimed, first run only: names, types and file sizes must match the dataset.
findstat_verify() {
	local got want
	got=$($GEN findlisting "$2") || return 1
	want="entries=$(($(ds_get tree files) + $(ds_get tree dirs))) listing=$(ds_get tree listing)"
	[[ $got == "$want" ]] || {
		echo "find saw $got, expected $want"
		return 1
	}
}

wl_findstat() {
	local entries row
	entries=$(($(ds_get tree files) + $(ds_get tree dirs)))
	row="findstat ($BENCH_FILES files, $entries entries)"
	row_begin findstat "$row" "entries/s" "find MNT/data -printf '%y %s %T@ %P'"
	bench_mounted findstat "$row" tree "$entries" entries findstat_cmd findstat_verify
}
