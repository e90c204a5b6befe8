#!/usr/bin/env python3
"""Turn the measurements of one bench/run into results files.

usage: report.py WORK RESULTS

Reads WORK/rows.tsv (workload, row, unit, note), WORK/raw.tsv (workload, row, system, run,
nanoseconds, amount, unit, status, message) and WORK/meta.tsv (key, value). Writes
RESULTS/latest.md, RESULTS/latest.csv (one line per row), RESULTS/latest-runs.csv (one line per
measurement) and, when matplotlib is installed, RESULTS/latest.png.
"""
import csv
import os
import statistics
import sys

SYSTEMS = [("butter", "butter"), ("kernel", "kernel btrfs"), ("ext4", "ext4")]
# Extra ratio columns (numerator, denominator) after butter/kernel; filled in main().
RATIOS = []


def read_tsv(path, ncols):
    rows = []
    if not os.path.exists(path):
        return rows
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) < ncols:
                parts += [""] * (ncols - len(parts))
            rows.append(parts[:ncols])
    return rows


class Cell:
    """The result of one system in one row."""

    def __init__(self):
        self.times = []  # seconds of the successful runs
        self.amount = None
        self.error = None
        self.skip = None

    def median(self):
        return statistics.median(self.times) if self.times else None

    def rate(self):
        m = self.median()
        return self.amount / m if m and self.error is None else None


def fmt_rate(v, unit):
    if v is None:
        return ""
    if unit == "MiB/s":
        return "%.1f %s" % (v, unit)
    return "{:,.0f} {}".format(v, unit)


def main():
    work, results = sys.argv[1], sys.argv[2]
    rows = read_tsv(os.path.join(work, "rows.tsv"), 4)
    raw = read_tsv(os.path.join(work, "raw.tsv"), 9)
    meta = read_tsv(os.path.join(work, "meta.tsv"), 2)

    # The FUSE write workloads (workloads/fusewrite.sh) also measure nullfs, a FUSE filesystem
    # that does nothing: a fourth column, and how it compares with the kernel and with butter.
    if any(r[2] == "nullfs" for r in raw):
        SYSTEMS.append(("nullfs", "nullfs (FUSE)"))
        RATIOS.extend([("nullfs", "kernel"), ("butter", "nullfs")])
    # The fsync workloads (workloads/fsync.sh) also measure butter mounted with -o fsync=commit
    # and compare butter with ext4; their fsync latencies (WORK/latency.tsv) get a table too.
    if any(r[2] == "butter-commit" for r in raw):
        SYSTEMS.append(("butter-commit", "butter fsync=commit"))
        RATIOS.extend([("butter", "ext4"), ("butter-commit", "butter")])
    # ... and with -o fsync=log-wait: seed 003 without its rule.
    if any(r[2] == "butter-wait" for r in raw):
        SYSTEMS.append(("butter-wait", "butter fsync=log-wait"))
        RATIOS.append(("butter-wait", "butter"))
    # ... and butter served through FUSE over io_uring (workloads/fusewrite.sh).
    if any(r[2] == "butter-uring" for r in raw):
        SYSTEMS.append(("butter-uring", "butter io_uring"))
        RATIOS.extend([("butter-uring", "kernel"), ("butter-uring", "butter")])
    latency = read_tsv(os.path.join(work, "latency.tsv"), 7)

    cells = {}
    for wl, row, sysname, run, ns, amount, unit, status, msg in raw:
        c = cells.setdefault((row, sysname), Cell())
        try:
            c.amount = float(amount)
        except ValueError:
            pass
        if status == "ok":
            c.times.append(int(ns) / 1e9)
        elif status == "fail":
            c.error = c.error or "run %s: %s" % (run, msg)
        elif status == "skip":
            c.skip = msg

    # Error footnotes, numbered in order of appearance; equal messages share a number.
    notes = []

    def note(msg):
        if msg not in notes:
            notes.append(msg)
        return notes.index(msg) + 1

    def cell_text(c, unit):
        if c is None:
            return "not run"
        if c.skip:
            return "—"
        if c.error:
            return "n/a [%d]" % note(c.error)
        if not c.times:
            return "not run"
        return "%s (%.3f s)" % (fmt_rate(c.rate(), unit), c.median())

    table = []
    summary = []
    for wl, row, unit, rnote in rows:
        got = {s: cells.get((row, s)) for s, _ in SYSTEMS}
        b, k = got["butter"], got["kernel"]
        ratio = None
        if b and k and b.rate() and k.rate():
            ratio = b.rate() / k.rate()
        extra = []
        for num, den in RATIOS:
            n_, d_ = got[num], got[den]
            r_ = n_.rate() / d_.rate() if n_ and d_ and n_.rate() and d_.rate() else None
            extra.append("%.2fx" % r_ if r_ is not None else "n/a")
        table.append(
            [row]
            + [cell_text(got[s], unit) for s, _ in SYSTEMS]
            + ["%.2fx" % ratio if ratio is not None else "n/a"]
            + extra
        )
        line = {"workload": wl, "row": row, "unit": unit}
        for s, _ in SYSTEMS:
            c = got[s]
            line[s + "_rate"] = "%.3f" % c.rate() if c and c.rate() else ""
            line[s + "_median_s"] = "%.4f" % c.median() if c and c.median() and not c.error else ""
            line[s + "_runs"] = len(c.times) if c else 0
            line[s + "_status"] = (
                "" if c is None else "skip" if c.skip else "fail" if c.error else "ok" if c.times else ""
            )
            line[s + "_error"] = (c.error or "") if c else ""
        line["ratio_butter_kernel"] = "%.4f" % ratio if ratio is not None else ""
        summary.append(line)

    os.makedirs(results, exist_ok=True)
    with open(os.path.join(results, "latest.csv"), "w", newline="") as f:
        fields = ["workload", "row", "unit"]
        for s, _ in SYSTEMS:
            fields += [s + "_rate", s + "_median_s", s + "_runs", s + "_status", s + "_error"]
        fields += ["ratio_butter_kernel"]
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(summary)
    with open(os.path.join(results, "latest-runs.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["workload", "row", "system", "run", "seconds", "amount", "unit", "status", "message"])
        for wl, row, sysname, run, ns, amount, unit, status, msg in raw:
            secs = "%.6f" % (int(ns) / 1e9) if status == "ok" else ""
            w.writerow([wl, row, sysname, run, secs, amount, unit, status, msg])

    chart = os.path.join(results, "latest.png")
    chart_note, chart_console = make_chart(chart, rows, cells)

    md = []
    md.append("# butter benchmark results\n")
    md.append(
        "Median of the runs; throughput with the median time in parentheses (higher throughput is "
        "better). **butter/kernel** is butter's throughput over the kernel's: above 1.00x butter "
        "is faster. Cold cache before every timed run (`sync; echo 3 > /proc/sys/vm/drop_caches`; "
        "butter and the kernel mounts are also remounted for every run). For *restore*, the "
        "kernel btrfs column is btrfs-progs `btrfs restore` (userspace), and ext4 has no "
        "counterpart.\n"
    )
    header = ["workload"] + [label for _, label in SYSTEMS] + ["butter/kernel"]
    header += ["%s/%s" % r for r in RATIOS]
    md.append("| " + " | ".join(header) + " |")
    md.append("|" + "---|" + "---:|" * (len(header) - 1))
    for t in table:
        md.append("| " + " | ".join(x.replace("|", "\\|") for x in t) + " |")
    md.append("")
    if notes:
        md.append("Errors:\n")
        for i, n in enumerate(notes, 1):
            md.append("%d. `%s`" % (i, n.replace("`", "'")))
        md.append("")
    md.extend(latency_table(rows, latency, cells))
    md.extend(rss_table(read_tsv(os.path.join(work, "rss.tsv"), 4)))
    md.extend(mixed_tables(work, results))
    md.append(chart_note + "\n")

    md.append("## Commands\n")
    for wl, row, unit, rnote in rows:
        md.append("- %s: `%s`" % (row, rnote))
    md.append("")

    md.append("## All runs (seconds)\n")
    md.append("| workload | system | runs | min | median | max |")
    md.append("|---|---|---|---:|---:|---:|")
    for wl, row, unit, rnote in rows:
        for s, label in SYSTEMS:
            c = cells.get((row, s))
            if not c or not c.times:
                continue
            md.append(
                "| %s | %s | %s | %.3f | %.3f | %.3f |"
                % (
                    row,
                    label,
                    " ".join("%.3f" % t for t in c.times),
                    min(c.times),
                    c.median(),
                    max(c.times),
                )
            )
    md.append("")

    md.append("## Machine and run\n")
    md.append("| | |")
    md.append("|---|---|")
    for k, v in meta:
        md.append("| %s | %s |" % (k, v.replace("|", "\\|")))
    md.append("")
    with open(os.path.join(results, "latest.md"), "w") as f:
        f.write("\n".join(md))

    # The table on stdout too.
    widths = [max(len(header[i]), *(len(t[i]) for t in table)) if table else len(header[i]) for i in range(len(header))]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for t in table:
        print("  ".join(x.ljust(w) for x, w in zip(t, widths)))
    for i, n in enumerate(notes, 1):
        print("[%d] %s" % (i, n))
    print(chart_console)
    print("wrote %s, latest.csv, latest-runs.csv" % os.path.join(results, "latest.md"))
    return 0


def fmt_ns(ns):
    return "%.2f ms" % (ns / 1e6)


def rss_table(rss):
    """Markdown lines: the FUSE processes' peak resident set (VmHWM) per row, largest of the runs."""
    if not rss:
        return []
    peak, order = {}, []
    for row, sysname, run, kb in rss:
        if row not in order:
            order.append(row)
        try:
            peak[(row, sysname)] = max(peak.get((row, sysname), 0), int(kb))
        except ValueError:
            pass
    systems = []
    for _, sysname, _, _ in rss:
        if sysname not in systems:
            systems.append(sysname)
    md = ["## Peak memory of the FUSE process\n"]
    md.append("VmHWM of the mount process just before its unmount, the largest of the runs (MiB).\n")
    md.append("| workload | " + " | ".join(systems) + " |")
    md.append("|---|" + "---:|" * len(systems))
    for row in order:
        cells = []
        for s in systems:
            v = peak.get((row, s))
            cells.append("%.1f" % (v / 1024) if v is not None else "")
        md.append("| %s | %s |" % (row.replace("|", "\\|"), " | ".join(cells)))
    md.append("")
    return md


def latency_table(rows, latency, cells):
    """Markdown lines: median fsync latency p50 / p99 per row and system, and their ratios."""
    runs = {}  # (row, system) -> [(p50, p99)] of the runs
    for wl, row, sysname, run, p50, p99, n in latency:
        try:
            runs.setdefault((row, sysname), []).append((int(p50), int(p99)))
        except ValueError:
            pass
    if not runs:
        return []

    def med(row, s):
        c, r = cells.get((row, s)), runs.get((row, s))
        if not r or (c and c.error):
            return None
        return statistics.median(x for x, _ in r), statistics.median(y for _, y in r)

    md = ["## fsync latency\n"]
    md.append(
        "fio's fsync latency, p50 / p99, median of the runs (lower is better). The ratios divide "
        "the first system's latency by the second's: above 1.00x the first is slower.\n"
    )
    header = ["workload"] + [label for _, label in SYSTEMS] + ["butter/kernel"] + ["%s/%s" % r for r in RATIOS]
    md.append("| " + " | ".join(header) + " |")
    md.append("|" + "---|" + "---:|" * (len(header) - 1))
    for wl, row, unit, rnote in rows:
        if not any((row, s) in runs for s, _ in SYSTEMS):
            continue
        got = {s: med(row, s) for s, _ in SYSTEMS}
        line = [row] + ["%s / %s" % (fmt_ns(v[0]), fmt_ns(v[1])) if v else "n/a" for v in got.values()]
        for num, den in [("butter", "kernel")] + RATIOS:
            a, b = got.get(num), got.get(den)
            ok = a and b and b[0] and b[1]
            line.append("%.2fx / %.2fx" % (a[0] / b[0], a[1] / b[1]) if ok else "n/a")
        md.append("| " + " | ".join(x.replace("|", "\\|") for x in line) + " |")
    md.append("")
    return md


def fmt_lat(ns):
    """A latency for the small-operations table: microseconds below 1 ms, else milliseconds."""
    if ns is None:
        return "n/a"
    if ns < 1e6:
        return "%d µs" % round(ns / 1e3)
    return "%.1f ms" % (ns / 1e6)


def read_lat(path):
    """The per-operation latencies (int64 ns) that bench/lib/mixed_io.py wrote, or None."""
    import array

    a = array.array("q")
    try:
        with open(path, "rb") as f:
            a.frombytes(f.read())
    except OSError:
        return None
    return a


def nearest_rank(sorted_ns, p):
    if not sorted_ns:
        return None
    k = max(1, -(-len(sorted_ns) * p // 100))
    return sorted_ns[int(k) - 1]


def mixed_tables(work, results):
    """Markdown lines for workloads/mixed_io.sh: each system's small operations alone and with
    the stream (latencies pooled over the runs), and the per-run values; also
    RESULTS/latest-mixed.csv, one line per phase of a run."""
    mixed = read_tsv(os.path.join(work, "mixed.tsv"), 13)
    if not mixed:
        return []
    names = dict(SYSTEMS)
    ops_label = {"read": "read 4 KiB, O_DIRECT", "create": "create + 4 KiB write + close"}
    groups = {}  # (system, op, mode) -> [line]
    for line in mixed:
        groups.setdefault(tuple(line[0:3]), []).append(line)

    def pooled(sysname, op, mode):
        lines = groups.get((sysname, op, mode))
        if not lines:
            return None
        lat = []
        ok = True
        for l in lines:
            a = read_lat(os.path.join(work, "logs", "mixed-%s-%s-%s-%s.lat" % (op, mode, sysname, l[3])))
            if a is None:
                ok = False
                break
            lat.extend(a)
        ops = sum(int(l[4]) for l in lines)
        secs = sum(float(l[5]) for l in lines)
        r = {"runs": len(lines), "ops_s": ops / secs if secs else 0.0}
        if ok and lat:
            lat.sort()
            r.update(p50=nearest_rank(lat, 50), p99=nearest_rank(lat, 99), max=lat[-1], pooled=True)
        else:  # no latency files: medians of the runs' percentiles, the largest max
            r.update(
                p50=statistics.median(int(l[6]) for l in lines),
                p99=statistics.median(int(l[7]) for l in lines),
                max=max(int(l[8]) for l in lines),
                pooled=False,
            )
        r["mib_s"] = sum(float(l[9]) * float(l[5]) for l in lines) / secs if secs else 0.0
        r["wp99"] = statistics.median(int(l[11]) for l in lines)
        r["wmax"] = max(int(l[12]) for l in lines)
        r["direct"] = sorted(set(l[10] for l in lines))
        return r

    md = ["## Small operations alone and with a streaming writer (mixed_io)\n"]
    md.append(
        "One job does small operations back to back; in the *with stream* phase a second process "
        "writes 1 MiB buffers (no fsync) to one file on the same mount the whole time. Latency "
        "percentiles are over every operation of all runs (nearest rank); ops/s is all operations "
        "over all windows. **p99 with/alone** above 1.00x means the stream slows the small "
        "operations down (within noise, 1.00x is the goal); the median of the runs' ratios compares "
        "phases a few seconds apart, which this machine's drifting background load affects alike. "
        "nullfs, a FUSE filesystem that does no work, shows what FUSE itself gives. Stream MiB/s is measured over the "
        "small operations' window; the stream's own 1 MiB write latency is p99 (median of the "
        "runs) / max.\n"
    )
    header = [
        "system", "small operation", "alone p50 / p99 / max", "with stream p50 / p99 / max",
        "p99 with/alone", "median of the runs' p99 with/alone", "ops/s alone", "ops/s with stream", "stream MiB/s", "stream write p99 / max",
    ]
    md.append("| " + " | ".join(header) + " |")
    md.append("|---|---|" + "---:|" * (len(header) - 2))
    for op in ("read", "create"):
        for s, label in SYSTEMS:
            a, w = pooled(s, op, "alone"), pooled(s, op, "stream")
            if not a and not w:
                continue
            trip = lambda r: "%s / %s / %s" % (fmt_lat(r["p50"]), fmt_lat(r["p99"]), fmt_lat(r["max"])) if r else "n/a"
            ratio = "%.2fx" % (w["p99"] / a["p99"]) if a and w and a["p99"] else "n/a"
            runs = {}
            for l in groups.get((s, op, "alone"), []) + groups.get((s, op, "stream"), []):
                runs.setdefault(l[3], {})[l[2]] = int(l[7])
            per = [r["stream"] / r["alone"] for r in runs.values() if r.get("alone") and "stream" in r]
            run_ratio = "%.2fx" % statistics.median(per) if per else "n/a"
            what = ops_label[op]
            if op == "read" and a and "buffered" in a["direct"]:
                what += " (buffered: O_DIRECT refused)"
            md.append(
                "| "
                + " | ".join(
                    [
                        label,
                        what,
                        trip(a),
                        trip(w),
                        ratio,
                        run_ratio,
                        "{:,.0f}".format(a["ops_s"]) if a else "n/a",
                        "{:,.0f}".format(w["ops_s"]) if w else "n/a",
                        "%.1f" % w["mib_s"] if w else "n/a",
                        "%s / %s" % (fmt_lat(w["wp99"]), fmt_lat(w["wmax"])) if w else "n/a",
                    ]
                )
                + " |"
            )
    md.append("")

    md.append("Per run (p99 and ops/s of each phase; the phase order alternates: odd runs alone first):\n")
    md.append("| system | small operation | run | alone p99 | with stream p99 | p99 with/alone | ops/s alone | ops/s with stream | stream MiB/s |")
    md.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    per_run = {}
    for line in mixed:
        per_run.setdefault((line[0], line[1], line[3]), {})[line[2]] = line
    order = {s: i for i, (s, _) in enumerate(SYSTEMS)}
    for (s, op, run), m in sorted(
        per_run.items(), key=lambda kv: (kv[0][1] != "read", order.get(kv[0][0], 99), int(kv[0][2]))
    ):
        a, w = m.get("alone"), m.get("stream")
        ratio = "%.2fx" % (int(w[7]) / int(a[7])) if a and w and int(a[7]) else "n/a"
        md.append(
            "| %s | %s | %s | %s | %s | %s | %s | %s | %s |"
            % (
                names.get(s, s),
                op,
                run,
                fmt_lat(int(a[7])) if a else "n/a",
                fmt_lat(int(w[7])) if w else "n/a",
                ratio,
                "{:,.0f}".format(int(a[4]) / float(a[5])) if a else "n/a",
                "{:,.0f}".format(int(w[4]) / float(w[5])) if w else "n/a",
                "%.1f" % float(w[9]) if w else "n/a",
            )
        )
    md.append("")

    with open(os.path.join(results, "latest-mixed.csv"), "w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(
            ["system", "op", "mode", "run", "ops", "seconds", "p50_ns", "p99_ns", "max_ns",
             "stream_mib_s", "read_io", "stream_write_p99_ns", "stream_write_max_ns"]
        )
        wr.writerows(mixed)
    return md


def make_chart(path, rows, cells):
    if os.path.exists(path):
        os.remove(path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        msg = (
            "Charts: skipped (matplotlib is not installed for %s; install it there, or set "
            "BENCH_PYTHON to a python that has it)." % sys.executable
        )
        return msg, msg
    if not rows:
        return "Charts: skipped (no results).", "charts skipped: no results"
    n = len(rows)
    cols = min(n, 3)
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    colors = {"butter": "#e0a800", "kernel": "#3870b0", "ext4": "#6a9a50", "nullfs": "#999999", "butter-commit": "#a06000", "butter-wait": "#c08040", "butter-uring": "#f0c040"}
    for i, (wl, row, unit, _) in enumerate(rows):
        ax = axes[i // cols][i % cols]
        labels, values, texts = [], [], []
        for s, label in SYSTEMS:
            c = cells.get((row, s))
            labels.append(label)
            r = c.rate() if c else None
            values.append(r or 0)
            texts.append("—" if c and c.skip else "n/a" if r is None else fmt_rate(r, "").strip())
        bars = ax.bar(labels, values, color=[colors[s] for s, _ in SYSTEMS])
        top = max(values) or 1
        for bar, t in zip(bars, texts):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + top * 0.02, t, ha="center", fontsize=8)
        ax.set_ylim(0, top * 1.18)
        ax.set_title(row, fontsize=9)
        ax.set_ylabel(unit)
        ax.tick_params(axis="x", labelsize=8)
    for j in range(n, nrows * cols):
        axes[j // cols][j % cols].axis("off")
    fig.suptitle("butter vs kernel btrfs vs ext4 (median throughput, higher is better)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "![throughput chart](latest.png)", "chart: %s" % path


if __name__ == "__main__":
    sys.exit(main())
