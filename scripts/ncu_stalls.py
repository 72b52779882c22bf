#!/usr/bin/env python3
"""Where a kernel's warps wait, instruction by instruction, from an `ncu` report's SASS page.

    ncu --clock-control none --set full -k regex:KERNEL --launch-skip 3 --launch-count 1 -o REP \
        python3 scripts/profile_step.py BUNDLE --tokens 1 --reps 1
    ncu --import REP.ncu-rep --page source --csv --print-source sass > SASS.csv
    python3 scripts/ncu_stalls.py SASS.csv [--top 12]

Prints the kernel's warp-stall samples by reason (as a share of all samples) and the instructions holding the most
samples with their top reasons: e.g. a shared-memory store waiting on the global load that feeds it (`long_sb`) is
time a warp spends on that load's latency. Standard library only (runs where ncu ran, or here on the CSV).
"""
from __future__ import annotations

import argparse
import csv
import sys


def load(path: str) -> tuple[str, list[str], list[list[str]]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 3 or rows[0][0] != "Kernel Name":
        sys.exit(f"{path}: not the CSV of `ncu --page source --csv --print-source sass`")
    return rows[0][1], rows[1], rows[2:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=12, help="instructions to list (default 12)")
    a = ap.parse_args()
    kernel, hdr, data = load(a.csv)
    i_src, i_all = hdr.index("Source"), hdr.index("Warp Stall Sampling (All Samples)")
    reasons = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]

    def num(r: list[str], i: int) -> int:
        return int(r[i]) if i < len(r) and r[i].isdigit() else 0

    total = sum(num(r, i_all) for r in data)
    if total == 0:
        sys.exit(f"{a.csv}: no stall samples (profile with --set full)")
    by = {hdr[i][len("stall_"):]: sum(num(r, i) for r in data) for i in reasons}
    print(f"{kernel}: {len(data)} instructions, {total} samples")
    print("  " + "  ".join(f"{k} {100 * v / total:.1f}%" for k, v in sorted(by.items(), key=lambda x: -x[1])[:8]))
    for j in sorted(range(len(data)), key=lambda j: -num(data[j], i_all))[:a.top]:
        r = data[j]
        why = sorted(((num(r, i), hdr[i][len("stall_"):]) for i in reasons if num(r, i)), reverse=True)[:3]
        print(f"  #{j:<5d} {num(r, i_all):5d} {100 * num(r, i_all) / total:5.1f}%  {r[i_src].strip()[:60]:60s} "
              + ", ".join(f"{k} {v}" for v, k in why))
    return 0


if __name__ == "__main__":
    sys.exit(main())
