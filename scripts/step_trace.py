#!/usr/bin/env python
"""Read a scheduler step trace (IMP_STEP_TRACE=FILE on `impc serve`): where a served load's time goes.

Each line: step start, step end (monotonic seconds), decode rows and prefill tokens launched, requests running
and waiting. Prints the span, the time inside steps and the idle time between them (the worker waiting for
requests: nothing on the device), steps by kind (decode only, prefill only, mixed) with their count, rows, tokens
and median duration, and the longest idle gaps.

Usage: python scripts/step_trace.py TRACE [--from SECONDS] [--to SECONDS]   (times relative to the first step)
"""
from __future__ import annotations

import argparse
import statistics
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--from", dest="t_from", type=float, default=0.0)
    ap.add_argument("--to", dest="t_to", type=float, default=float("inf"))
    a = ap.parse_args()
    steps = []
    with open(a.trace) as f:
        for line in f:
            p = line.split()
            if len(p) == 6:
                steps.append((float(p[0]), float(p[1]), int(p[2]), int(p[3]), int(p[4]), int(p[5])))
    if not steps:
        print("no steps in the trace", file=sys.stderr)
        return 1
    base = steps[0][0]
    steps = [s for s in steps if a.t_from <= s[0] - base <= a.t_to]
    span = steps[-1][1] - steps[0][0]
    busy = sum(t1 - t0 for t0, t1, *_ in steps)
    gaps = [(steps[i + 1][0] - steps[i][1], steps[i][1] - base) for i in range(len(steps) - 1)]
    print(f"{len(steps)} steps over {span:.3f} s: inside steps {busy:.3f} s ({100 * busy / span:.1f}%), "
          f"between {span - busy:.3f} s; gaps over 1 ms: {sum(1 for g, _ in gaps if g > 1e-3)} "
          f"summing {sum(g for g, _ in gaps if g > 1e-3):.3f} s")
    kinds = {"decode only": [], "prefill only": [], "mixed": [], "empty": []}
    for s in steps:
        rows, tokens = s[2], s[3]
        kinds["mixed" if rows and tokens else "decode only" if rows else "prefill only" if tokens else "empty"].append(s)
    print(f"{'kind':<13} {'steps':>6} {'time s':>8} {'rows/step':>9} {'tokens/step':>11} {'median ms':>9}")
    for k, ss in kinds.items():
        if ss:
            d = [t1 - t0 for t0, t1, *_ in ss]
            print(f"{k:<13} {len(ss):>6} {sum(d):>8.3f} {statistics.mean(x[2] for x in ss):>9.1f} "
                  f"{statistics.mean(x[3] for x in ss):>11.1f} {1e3 * statistics.median(d):>9.2f}")
    rows = sum(s[2] for s in steps)
    print(f"decode rows {rows} ({rows / span:.0f} a second), prefill tokens {sum(s[3] for s in steps)}")
    print("longest gaps (ms at s):", ", ".join(f"{1e3 * g:.1f} at {t:.2f}" for g, t in sorted(gaps, reverse=True)[:8]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
