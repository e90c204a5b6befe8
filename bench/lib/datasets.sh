# Datasets: the content of a pair of equal-size images, one btrfs and one ext4, both under
# $WORK/img on the same backing filesystem. A dataset NAME is defined by four functions:
#   ds_NAME_params        one line naming everything the content depends on (for --reuse)
#   ds_NAME_image_mb      image size in MiB (sparse files; the same for btrfs and ext4)
#   ds_NAME_ext4_opts     extra mkfs.ext4 options (may print nothing)
#   ds_NAME_populate DIR  write the content into DIR (an empty directory)
# The content sits in /data on both images (ext4's root holds lost+found). The btrfs image is
# populated through a kernel loop mount, the ext4 image gets a `cp -a` of it, and both are
# unmounted before any timed run. $WORK/img/NAME.stamp holds the params line and the digest
# (files= dirs= bytes= listing= content=, see lib/gen.py) that workloads verify results against.

GEN="python3 $BENCH_ROOT/lib/gen.py"

# Bump when the generator or image layout changes, so --reuse rebuilds old images.
DATASET_FORMAT=1

ds_image() { printf '%s/img/%s.%s.img' "$WORK" "$1" "$2"; }

# ds_get NAME KEY: a value from the dataset's digest (files, dirs, bytes, listing, content).
ds_get() {
	sed -n 2p "$WORK/img/$1.stamp" | tr ' ' '\n' | sed -n "s/^$2=//p"
}

ds_exists() { declare -F "ds_$1_populate" >/dev/null; }

# ds_build NAME: make (or with --reuse, keep) the image pair.
ds_build() {
	local ds=$1 params bimg eimg stamp size out bdev edev t0 digest edigest
	params="format=$DATASET_FORMAT $ds $("ds_${ds}_params")"
	bimg=$(ds_image "$ds" btrfs)
	eimg=$(ds_image "$ds" ext4)
	stamp=$WORK/img/$ds.stamp
	if [[ $REUSE == 1 && -f $stamp && -f $bimg && -f $eimg && $(sed -n 1p "$stamp") == "$params" ]]; then
		log "dataset $ds: reusing images ($params)"
		return 0
	fi
	size=$("ds_${ds}_image_mb")
	log "dataset $ds: making ${size} MiB btrfs and ext4 images ($params)"
	t0=$SECONDS
	rm -f "$bimg" "$eimg" "$stamp"
	truncate -s "${size}M" "$bimg" "$eimg" || die "truncate failed"
	out=$(mkfs.btrfs -f -q -L "bench-$ds" "$bimg" 2>&1) || die "mkfs.btrfs $bimg: $out"
	# Initialise inode tables and journal now, so no lazy-init thread writes during timed runs.
	# shellcheck disable=SC2046
	out=$(mkfs.ext4 -F -q -L "bench-$ds" -E lazy_itable_init=0,lazy_journal_init=0 \
		$("ds_${ds}_ext4_opts") "$eimg" 2>&1) || die "mkfs.ext4 $eimg: $out"

	kmount btrfs "$bimg" "$WORK/mnt/pop-btrfs" rw || die "$ERR"
	bdev=$KDEV
	mkdir "$WORK/mnt/pop-btrfs/data"
	log "dataset $ds: populating the btrfs image through the kernel ($bdev)"
	"ds_${ds}_populate" "$WORK/mnt/pop-btrfs/data" || die "populating dataset $ds failed"
	kmount ext4 "$eimg" "$WORK/mnt/pop-ext4" rw || die "$ERR"
	edev=$KDEV
	log "dataset $ds: copying it to the ext4 image ($edev)"
	cp -a "$WORK/mnt/pop-btrfs/data" "$WORK/mnt/pop-ext4/" || die "cp -a to ext4 failed"
	sync
	digest=$($GEN digest "$WORK/mnt/pop-btrfs/data") || die "digest failed"
	edigest=$($GEN digest "$WORK/mnt/pop-ext4/data") || die "digest failed"
	[[ $digest == "$edigest" ]] || die "dataset $ds differs between btrfs and ext4: $digest vs $edigest"
	KDEV=$edev kumount "$WORK/mnt/pop-ext4"
	KDEV=$bdev kumount "$WORK/mnt/pop-btrfs"
	printf '%s\n%s\n' "$params" "$digest" >"$stamp"
	log "dataset $ds: ready in $((SECONDS - t0)) s ($digest)"
	log "dataset $ds: disk use $(du -sh --apparent-size "$bimg" | cut -f1) apparent, btrfs $(du -sh "$bimg" | cut -f1), ext4 $(du -sh "$eimg" | cut -f1)"
}

max() { echo $(($1 > $2 ? $1 : $2)); }

# bigfile: one file data/big.bin of BENCH_FILE_MB MiB of pseudo-random bytes.
ds_bigfile_params() { echo "mib=$BENCH_FILE_MB"; }
ds_bigfile_image_mb() { max 2048 $((BENCH_FILE_MB * 5 / 4 + 512)); }
ds_bigfile_ext4_opts() { :; }
ds_bigfile_populate() { $GEN big "$1/big.bin" "$BENCH_FILE_MB"; }

# tree: BENCH_FILES files (0..16 KiB, 65% of them 1..2000 bytes, so inline on btrfs) in
# BENCH_FILES_PER_DIR-file leaf directories two levels deep (data/aNNN/bNNN/fNNNNNNN.suffix).
ds_tree_params() { echo "files=$BENCH_FILES per_dir=$BENCH_FILES_PER_DIR"; }
ds_tree_image_mb() { max 2048 $((BENCH_FILES * 16 / 1024 + 512)); }
ds_tree_ext4_opts() { echo "-N $((BENCH_FILES + BENCH_FILES / 20 + 4096))"; }
ds_tree_populate() { $GEN tree "$1" "$BENCH_FILES" --per-dir "$BENCH_FILES_PER_DIR"; }
