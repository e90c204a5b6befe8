//! Examples and exit statuses of every command: shown after `--help` and as the EXAMPLES and
//! EXIT STATUS sections of the man pages, and what shell completion offers for option values.

use clap::builder::{PossibleValue, TypedValueParser};

/// (what it does, the command) pairs for the command named `path` ("mkfs", "subvolume
/// snapshot", "" for butter itself).
pub fn examples(path: &str) -> &'static [(&'static str, &'static str)] {
    match path {
        "" => &[
            ("Make a 1 GiB image holding a copy of a directory, check it, and look inside", "butter mkfs -b 1G --rootdir ./rootfs disk.img && butter check disk.img && butter ls -l disk.img /"),
            ("Mount it read-write through FUSE, change it, unmount (the final commit is on disk when unmount returns)", "butter mount -d disk.img /mnt && cp notes.txt /mnt/ && butter unmount /mnt"),
            ("Snapshot it read-only and send the snapshot into a second image", "butter subvolume snapshot -r disk.img / monday && butter send disk.img monday | butter receive backup.img /"),
            ("Copy everything out", "butter restore disk.img ./out"),
        ],
        "mkfs" => &[
            ("An empty 1 GiB filesystem (the file is created, sparse)", "butter mkfs -b 1G disk.img"),
            ("An image of a directory holding @ and @home, each made a subvolume, @ the default one, compressed and cut to its contents", "butter mkfs --rootdir ./layout --subvol default:@ --subvol @home --compress zstd --shrink os.img"),
            ("The same bytes on every build", "SOURCE_DATE_EPOCH=1700000000 DETERMINISTIC_SEED=1 butter mkfs --rootdir ./rootfs os.img"),
            ("Owners and device nodes as root without being root", "fakeroot sh -c 'tar -xpf rootfs.tar -C rootfs && butter mkfs --rootdir rootfs os.img'"),
            ("A RAID1 of two 4 GiB image files (metadata and data mirrored), then its devices", "butter mkfs -b 4G -m raid1 -d raid1 a.img b.img && butter filesystem show a.img --device b.img"),
        ],
        "mount" => &[
            ("Mount in the foreground (Ctrl-C unmounts)", "butter mount disk.img /mnt"),
            ("In the background, compressing new data, committing every 10 s", "butter mount -d -o compress=zstd:3,commit=10 disk.img /mnt"),
            ("A subvolume, read-only", "butter mount -d -o ro,subvol=@home disk.img /home"),
            ("Through mount(8) (after scripts/install), or an fstab line: disk.img /mnt fuse.butter defaults 0 0", "mount -t fuse.butter disk.img /mnt -o noatime"),
        ],
        "unmount" => &[
            ("Unmount, returning once the final commit is on disk", "butter unmount /mnt"),
            ("Detach a busy mount now; butter finishes when the last file is closed", "butter unmount --lazy /mnt"),
        ],
        "check" => &[
            ("Check the metadata", "butter check disk.img"),
            ("Also read every data block and compare its checksum", "butter check --check-data-csum disk.img"),
            ("See what a repair would change, then repair", "butter check --repair --dry-run disk.img && butter check --repair disk.img"),
            ("Make the checksum tree again from the data, then repair the rest", "butter check --repair --init-csum-tree disk.img"),
            ("Make the extent tree again from the other trees, then repair the rest", "butter check --repair --init-extent-tree disk.img"),
        ],
        "rescue" | "rescue zero-log" => &[
            ("Drop an fsync log that cannot be replayed (the last fsyncs are lost)", "butter rescue zero-log disk.img"),
        ],
        "rescue super-recover" => &[
            ("Rewrite damaged superblock copies from the newest good one", "butter rescue super-recover -v disk.img"),
        ],
        "rescue fix-device-size" => &[
            ("Align the device sizes, as newer kernels require", "butter rescue fix-device-size disk.img"),
        ],
        "rescue clear-uuid-tree" => &[
            ("Delete the uuid tree; the kernel builds it again at the next mount", "butter rescue clear-uuid-tree disk.img"),
        ],
        "rescue fix-data-checksum" => &[
            ("List the data sectors whose checksums do not match, with their files", "butter rescue fix-data-checksum disk.img"),
            ("Make their checksums those of the data the first copy holds", "butter rescue fix-data-checksum -m 1 disk.img"),
        ],
        "rescue clear-space-cache" => &[
            ("Delete the old v1 space cache files", "butter rescue clear-space-cache v1 disk.img"),
            ("Delete the free space tree; a mount with -o space_cache=v2 builds it again", "butter rescue clear-space-cache v2 disk.img"),
        ],
        "ls" => &[
            ("List the root of the default subvolume", "butter ls -l disk.img"),
            ("List a directory of another subvolume, by the path `butter subvolumes` prints", "butter ls --subvol-id 5 disk.img @home/alice"),
        ],
        "cat" => &[("Print a file", "butter cat disk.img etc/hostname")],
        "subvolumes" | "subvolume list" => &[
            ("All subvolumes, with their uuids and the uuids they were snapshotted from", "butter subvolumes -u -q disk.img"),
            ("Only the read-only ones", "butter subvolumes -r disk.img"),
        ],
        "subvolume" => &[
            ("A subvolume, a read-only snapshot of it, and its details", "butter subvolume create disk.img data && butter subvolume snapshot -r disk.img data data-monday && butter subvolume show disk.img data-monday"),
            ("Make @ what a mount shows", "butter subvolume set-default disk.img @"),
        ],
        "subvolume create" => &[("A new subvolume in directory srv", "butter subvolume create disk.img srv/www")],
        "subvolume snapshot" => &[
            ("A read-only snapshot of the default subvolume", "butter subvolume snapshot -r disk.img / snaps/monday"),
            ("A writable snapshot of @ beside it, by top-level paths", "butter subvolume snapshot --subvol-id 5 disk.img @ @-before-upgrade"),
        ],
        "subvolume delete" => &[
            ("Delete a snapshot", "butter subvolume delete disk.img snaps/monday"),
            ("Delete by id", "butter subvolume delete --subvolid 258 disk.img"),
        ],
        "subvolume show" => &[("Details of a snapshot", "butter subvolume show disk.img snaps/monday")],
        "subvolume get-default" => &[("Which subvolume a mount shows", "butter subvolume get-default disk.img")],
        "subvolume set-default" => &[
            ("Make @ the default subvolume", "butter subvolume set-default --subvol-id 5 disk.img @"),
            ("Back to the top level", "butter subvolume set-default --id 5 disk.img"),
        ],
        "subvolume sync" => &[("Finish dropping deleted subvolumes", "butter subvolume sync disk.img")],
        "property" | "property get" | "property set" => &[
            ("Is the snapshot read-only?", "butter property get disk.img snaps/monday ro"),
            ("Make it writable", "butter property set disk.img snaps/monday ro false"),
        ],
        "restore" => &[
            ("Copy everything off the surviving disk of a broken two-disk RAID1", "butter restore --degraded disk1.img ./rescued"),
            ("Copy the default subvolume (and subvolumes below it) into ./out", "butter restore disk.img ./out"),
            ("Only @home, by its path from the top level", "butter restore --subvol @home disk.img ./home"),
            ("What would be restored", "butter restore --dry-run -v disk.img ./out"),
        ],
        "send" => &[
            ("A full stream of a read-only snapshot", "butter send -f monday.stream disk.img snaps/monday"),
            ("Only what changed since monday", "butter send -p snaps/monday -f tuesday.stream disk.img snaps/tuesday"),
            ("Into the kernel's btrfs", "butter send disk.img snaps/monday | btrfs receive /mnt/backup"),
        ],
        "receive" => &[
            ("Receive a stream into the top of an image", "butter receive -f monday.stream backup.img /"),
            ("From the kernel's btrfs", "btrfs send /mnt/snaps/monday | butter receive backup.img /"),
            ("Print a stream's commands", "butter receive --dump -f monday.stream"),
        ],
        "compsize" => &[("Compression of /usr", "butter compsize disk.img /usr")],
        "filesystem" | "filesystem usage" | "filesystem df" => &[
            ("Space per block group type", "butter filesystem df disk.img"),
            ("Device allocation and free space", "butter filesystem usage disk.img"),
        ],
        "filesystem show" => &[
            ("The devices of a RAID1 of two image files", "butter filesystem show a.img --device b.img"),
            ("With one of them gone", "butter filesystem show a.img --degraded"),
        ],
        "scrub" | "scrub start" => &[
            ("Verify every copy and parity block of a RAID5 of three images, repairing what is bad", "butter scrub start -d a.img --device b.img --device c.img"),
            ("Only report", "butter scrub start -r a.img --device b.img --device c.img"),
        ],
        "filesystem du" => &[("Shared and exclusive bytes of each home", "butter filesystem du -s disk.img home/*")],
        "balance" | "balance start" => &[
            ("Compact block groups less than half full", "butter balance start -dusage=50 -musage=50 os.img"),
            ("Metadata from DUP to single (less redundancy needs --force)", "butter balance start -f -mconvert=single os.img"),
            ("Data of two images to RAID1", "butter balance start -dconvert=raid1 a.img --device b.img"),
        ],
        "balance status" => &[("Is a balance paused on the image?", "butter balance status os.img")],
        "balance resume" => &[("Finish a balance that was interrupted (by butter or the kernel)", "butter balance resume os.img")],
        "balance cancel" => &[("Drop a paused balance", "butter balance cancel os.img")],
        "device" | "device add" => &[
            ("Add a second image file to a filesystem, then use both", "truncate -s 4G b.img && butter device add a.img b.img && butter filesystem show a.img --device b.img"),
            ("Add one to a running butter mount (as root)", "butter device add /mnt/os b.img"),
        ],
        "device remove" => &[
            ("Take device 2 out, its chunks moved to the others", "butter device remove a.img --device b.img --device c.img 2"),
        ],
        "device replace" => &[
            ("Move everything from b.img to c.img", "butter device replace a.img --device b.img b.img c.img"),
            ("Replace a lost device of a RAID1", "butter device replace --degraded a.img missing c.img"),
            ("Replace the image a running butter mount was made from (as root)", "butter device replace /mnt/os a.img c.img"),
        ],
        "filesystem resize" => &[
            ("Grow an image by 2 GiB (the file grows with it)", "butter filesystem resize os.img +2G"),
            ("Fill the whole of a device or file made larger, as image tools do on first boot", "truncate -s 8G os.img && butter filesystem resize os.img max"),
            ("Shrink it as far as it goes, its block groups packed, the file cut there", "butter filesystem resize os.img min"),
            ("Shrink to 1 GiB, moving what lies past it", "butter filesystem resize os.img 1G"),
            ("Grow device 2 of a RAID1", "butter filesystem resize a.img 2:+1G --device b.img"),
            ("Grow the filesystem of a running butter mount by 1 GiB (as root)", "butter filesystem resize /mnt/os +1G"),
        ],
        "filesystem label" => &[
            ("Print the label", "butter filesystem label disk.img"),
            ("Set it", "butter filesystem label disk.img rootfs"),
        ],
        "dump-super" => &[("The superblock and its backup roots", "butter dump-super -f disk.img")],
        "dump-tree" => &[
            ("The chunk tree", "butter dump-tree -t chunk disk.img"),
            ("One block and what is below it", "butter dump-tree -b 30408704 --follow disk.img"),
        ],
        "manpages" => &[("Install the man pages", "butter manpages /usr/local/share/man/man1")],
        "completions" => &[("Bash completion", "butter completions bash > /usr/share/bash-completion/completions/butter")],
        _ => &[],
    }
}

/// The EXIT STATUS of the command named `path`.
pub fn exit_status(path: &str) -> &'static str {
    match path {
        "check" => "0 when no errors were found (warnings may have been printed), or --repair left none; 1 when errors were found (or left by --repair), or the image could not be read.",
        "mkfs" => "0 when the filesystem is complete; 1 when it could not be made (nothing valid is left); 130 when interrupted (SIGINT, SIGTERM): the image is not a filesystem, and one mkfs created is removed.",
        "mount" => "0 after a clean unmount (in the foreground) or once the mount is usable (-d); 1 when it could not be mounted, or the final commit failed (what was committed before is intact).",
        "receive" => "0 when every command of the stream was applied (or printed, with --dump); 1 when the stream is damaged or a command failed (more than -E N of them); the subvolume being received stays writable, without a received uuid.",
        "scrub" | "scrub start" => "0 when no errors are left (all found were repaired); 1 when errors are left: found by -r, or with no good copy to repair them from, or the filesystem could not be read.",
        "unmount" => "0 once the mount is gone and the butter process serving it has exited; 1 when it is not a butter mount or is busy.",
        _ => "0 on success; 1 on failure, with a message on standard error that says what failed and what to do.",
    }
}

/// The examples of `path` as `--help` shows them after the options.
pub fn help_examples(path: &str) -> Option<String> {
    let ex = examples(path);
    if ex.is_empty() {
        return None;
    }
    let mut s = String::from("Examples:\n");
    for (what, cmd) in ex {
        s.push_str(&format!("  {what}:\n    {cmd}\n"));
    }
    s.push_str(&format!("\nExit status: {}", exit_status(path)));
    Some(s)
}

/// Text for roff: backslashes and dashes escaped, no line starting with a control character.
fn roff_text(s: &str) -> String {
    let t = s.replace('\\', "\\e").replace('-', "\\-");
    if t.starts_with('.') || t.starts_with('\'') {
        format!("\\&{t}")
    } else {
        t
    }
}

/// EXAMPLES and EXIT STATUS sections of the man page of `path`, in roff.
pub fn man_sections(path: &str) -> String {
    let mut s = String::new();
    let ex = examples(path);
    if !ex.is_empty() {
        s.push_str(".SH EXAMPLES\n");
        for (what, cmd) in ex {
            s.push_str(&format!(
                ".PP\n{}:\n.RS 4\n.nf\n{}\n.fi\n.RE\n",
                roff_text(what),
                roff_text(cmd)
            ));
        }
    }
    s.push_str(&format!(
        ".SH \"EXIT STATUS\"\n{}\n",
        roff_text(exit_status(path))
    ));
    s
}

/// Takes any text (the command checks it and says what is wrong) and offers `values` to shell
/// completion. Its possible values are hidden from `--help`, which says them in words.
#[derive(Clone)]
pub struct Suggest<P> {
    inner: P,
    values: &'static [&'static str],
}

pub fn suggest<P>(inner: P, values: &'static [&'static str]) -> Suggest<P> {
    Suggest { inner, values }
}

impl<P: TypedValueParser> TypedValueParser for Suggest<P> {
    type Value = P::Value;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<Self::Value, clap::Error> {
        self.inner.parse_ref(cmd, arg, value)
    }

    fn possible_values(&self) -> Option<Box<dyn Iterator<Item = PossibleValue> + '_>> {
        Some(Box::new(self.values.iter().map(|v| PossibleValue::new(*v))))
    }
}

/// What completion offers for compression: `--compress` of mkfs, `compress=` of mount.
pub const COMPRESS_VALUES: &[&str] = &[
    "zstd", "zstd:1", "zstd:3", "zstd:9", "zstd:15", "zlib", "zlib:9", "lzo", "no",
];

/// What completion offers for `mount -o`.
pub const MOUNT_OPTIONS: &[&str] = &[
    "ro",
    "rw",
    "noatime",
    "relatime",
    "commit=",
    "compress=zstd",
    "compress=zstd:3",
    "compress=zlib",
    "compress=lzo",
    "compress-force=zstd",
    "subvol=",
    "subvolid=",
    "nokeep_cache",
    "cache=strict",
    "entry_timeout=",
    "attr_timeout=",
    "allow_other",
    "allow_root",
    "nodev",
    "nosuid",
    "noexec",
    "nologreplay",
    "fsync=log",
    "fsync=commit",
    "max_inline=",
    "nodelalloc",
    "device=",
    "degraded",
    "defaults",
];
