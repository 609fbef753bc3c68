"""Summarize ncu source-page CSVs (bench/prof_src.sh): per kernel, where the warps' stall
samples fall (by reason and by instruction), so two kernels can be compared line by line.

    python bench/stall_table.py OUT/bwd_nc_src.csv [--match Bwd] [--top 25]
"""
import argparse
import csv
import re
from collections import Counter


def kernels(path):
    """Yield (kernel name, rows as dicts) for every kernel section of the CSV."""
    name, header, rows = None, None, []
    with open(path, newline="") as f:
        for rec in csv.reader(f):
            if not rec:
                continue
            if rec[0] == "Kernel Name":
                if name is not None:
                    yield name, rows
                name, header, rows = rec[1], None, []
            elif rec[0] == "Address":
                header = rec
            elif header is not None:
                rows.append(dict(zip(header, rec)))
    if name is not None:
        yield name, rows


def num(x):
    try:
        return float(x.replace(",", ""))
    except (ValueError, AttributeError):
        return 0.0


def opcode(src):
    toks = re.sub(r"^@!?U?P\w+\s+", "", src.strip()).split()
    return toks[0] if toks else "?"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("csv")
    p.add_argument("--match", default="")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    for name, rows in kernels(a.csv):
        if a.match not in name:
            continue
        total = sum(num(r["Warp Stall Sampling (All Samples)"]) for r in rows)
        if total == 0:
            continue
        reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
        by_reason = Counter({c[6:]: sum(num(r[c]) for r in rows) for c in reasons})
        by_op = Counter()
        for r in rows:
            by_op[opcode(r["Source"])] += num(r["Warp Stall Sampling (All Samples)"])
        print(f"== {name[:110]}\n   samples {total:.0f}, instructions {len(rows)}")
        print("   reasons: " + ", ".join(
            f"{k} {v / total:.1%}" for k, v in by_reason.most_common(10) if v))
        print("   opcodes: " + ", ".join(
            f"{k} {v / total:.1%}" for k, v in by_op.most_common(14)))
        top = sorted(rows, key=lambda r: -num(r["Warp Stall Sampling (All Samples)"]))[:a.top]
        for r in top:
            s = num(r["Warp Stall Sampling (All Samples)"])
            why = sorted(((num(r[c]), c[6:]) for c in reasons), reverse=True)[:3]
            why = " ".join(f"{k}:{v / max(s, 1):.0%}" for v, k in why if v)
            print(f"   {r['Address']:>6} {s / total:6.1%} {r['Source'].strip()[:60]:60} {why}")


if __name__ == "__main__":
    main()
