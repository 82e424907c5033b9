"""Summarizes Nsight Compute's source page (ncu --page source --csv --print-source sass):
for each profiled kernel, the SASS instructions where the warps were sampled most
(stall sampling), with their share of the kernel's samples. Where the warps wait is
where the time goes (a mbarrier wait = data not there yet, a global load's first use =
its latency, a barrier = the slowest warp).

    python3 benchmarks/profiling/ncu_source_top.py decode_ncu_source.csv [--top 30]
    python3 benchmarks/profiling/ncu_source_top.py decode_ncu_source.csv --lines   # CUDA view

--lines reads the CUDA-line view (a LINEINFO=1 build, NCU_SOURCE_VIEW="cuda,sass"): the
samples of each source line (file:line, summed over the profiled launches) with its top
stall reasons (stall_barrier = waiting at a barrier for other warps, stall_wait = fixed
latency, e.g. an integer division's chain, stall_imc = a kernel-parameter constant-cache
miss, stall_long_sb / stall_lg = a global / local load's latency).
"""
import collections
import argparse
import csv
import io


def _tables(text):
    """Yields (title lines before the table, header, rows) per CSV table in the file."""
    lines = text.splitlines()
    i, title = 0, []
    while i < len(lines):
        line = lines[i]
        if line.startswith('"') and '"Source"' in line and "Sampling" in line:
            header = next(csv.reader(io.StringIO(line)))
            rows = []
            i += 1
            while (i < len(lines) and lines[i].startswith('"')
                   and not lines[i].startswith('"Kernel Name"')):
                rows.append(next(csv.reader(io.StringIO(lines[i]))))
                i += 1
            yield title, header, rows
            title = []
        else:
            if line.strip():
                title = (title + [line])[-3:]
            i += 1


def _num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def _by_line(text, top):
    """The CUDA-line view: samples and stall reasons per file:line."""
    path, header, reasons = None, None, []
    agg = collections.defaultdict(collections.Counter)
    source = {}
    for line in text.splitlines():
        if line.startswith('"File Path"'):
            path, header = next(csv.reader(io.StringIO(line)))[1], None
        elif line.startswith('"Line No"'):
            header = next(csv.reader(io.StringIO(line)))
            reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
        elif header and line.startswith('"'):
            r = next(csv.reader(io.StringIO(line)))
            if len(r) != len(header) or not r[0].isdigit():
                continue  # SASS rows (empty line number) carry no per-line totals
            key = (path.rsplit("/", 1)[-1], int(r[0]))
            source[key] = r[1]
            agg[key]["samples"] += _num(r[header.index("Warp Stall Sampling (All Samples)")])
            for h in reasons:
                agg[key][h[6:]] += _num(r[header.index(h)])
    total = sum(c["samples"] for c in agg.values()) or 1.0
    print(f"{total:.0f} samples over {len(agg)} source lines")
    for key, c in sorted(agg.items(), key=lambda kv: -kv[1]["samples"])[:top]:
        why = sorted(((v, h) for h, v in c.items() if h != "samples" and v > 0), reverse=True)[:3]
        print(f"{c['samples'] / total:6.1%} {key[0]:>22}:{key[1]:<5} {source[key].strip()[:70]:<70} "
              + " ".join(f"{h}={v:.0f}" for v, h in why))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--lines", action="store_true", help="per CUDA line (cuda,sass view)")
    args = ap.parse_args()
    with open(args.path, errors="replace") as fh:
        text = fh.read()
    if args.lines:
        _by_line(text, args.top)
        return
    n = 0
    for title, header, rows in _tables(text):
        n += 1
        print("=" * 100)
        for t in title:
            print(t[:160])
        cols = [c for c in header if "Sampling" in c]
        print("columns:", ", ".join(header)[:400])
        if not cols:
            continue
        key = next((c for c in cols if "All" in c), cols[0])
        k = header.index(key)
        src = header.index("Source") if "Source" in header else 1
        total = sum(_num(r[k]) for r in rows if len(r) > k) or 1.0
        print(f"{len(rows)} instructions, {total:.0f} samples ({key})")
        ranked = sorted((r for r in rows if len(r) > k), key=lambda r: -_num(r[k]))
        for r in ranked[:args.top]:
            extra = " ".join(f"{c.split('(')[-1][:12]}={r[header.index(c)]}" for c in cols
                             if c != key)
            print(f"{_num(r[k]) / total:6.1%} {r[0]:>8} {r[src].strip()[:90]:<90} {extra}")
    if n == 0:
        print("no source table found; first lines:")
        print("\n".join(text.splitlines()[:20]))


if __name__ == "__main__":
    main()
