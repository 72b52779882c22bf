#!/usr/bin/env python
"""A/B of two (or more) bundles by `impc bench`, the way BENCHMARKS.md's sessions compare a change with its base:
rounds that alternate the bundles, a process each (A, B, A, B, ...), so drift of the GPU (clocks, heat) falls on all;
per measurement, the median of the rounds for each bundle and the change. The bench's own spread between rounds is
printed with it: a change smaller than that is noise.

Usage: python scripts/ab_bench.py A_BUNDLE B_BUNDLE [C_BUNDLE ...] [--rounds 3] [--batches 1,2,4] [--pp 128]
       [--runs 3] [--prompt N] [--path-a DIR] [--path-b DIR]

More than two bundles: every round runs them all in turn (A, B, C, ...), and each is compared with A.

--prompt N: the decode runs after an N-token prompt (the bench's own default, 16, otherwise): decode at a context.

--path-a / --path-b put a directory first on that side's PYTHONPATH: an A/B of two runtimes (a directory holding
another imp_runtime package) on one bundle, which may then be both A_BUNDLE and B_BUNDLE."""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

LINE = re.compile(r"^\s*(decode\s+batch\s+\d+|prefill\s+pp\d+)\b.*?([\d.]+) tok/s")
SERIAL = re.compile(r"host-serial steps ([\d.]+)")
# the bench's closing line: batch 1's weight bandwidth next to the copy bandwidth measured in the same run
BANDWIDTH = re.compile(r"weight bandwidth ([\d.]+) TB/s = \d+% of the measured copy bandwidth ([\d.]+) TB/s")


def parse_bench(text: str) -> dict[str, float]:
    """tok/s by measurement ('decode batch 1', 'decode batch 1 host-serial', 'prefill pp512') from `impc bench`
    output; where batch 1 ran, its weight bandwidth and the run's copy bandwidth (TB/s), so an A/B's figures come
    with the bandwidth measured beside them."""
    out = {}
    for line in text.splitlines():
        bw = BANDWIDTH.search(line)
        if bw:
            out["b1 weights TB/s"], out["copy TB/s"] = float(bw.group(1)), float(bw.group(2))
            continue
        m = LINE.match(line)
        if m:
            name = " ".join(m.group(1).split())
            out[name] = float(m.group(2))
            serial = SERIAL.search(line)
            if serial:
                out[name + " host-serial"] = float(serial.group(1))
    return out


def summarize(rounds: dict[str, list[dict[str, float]]], other: str = "B") -> list[tuple[str, float, float, float,
                                                                                        float, float]]:
    """Per measurement present in every round of both A and `other` (B, C, ...): (name, A median, its median, its / A
    - 1, A spread, its spread), the spreads as (max - min) / median of the rounds."""
    a, b = rounds["A"], rounds[other]
    names = [n for n in a[0] if all(n in r for r in a + b)] if a else []
    rows = []
    for n in names:
        va, vb = [r[n] for r in a], [r[n] for r in b]
        ma, mb = statistics.median(va), statistics.median(vb)
        rows.append((n, ma, mb, mb / ma - 1, (max(va) - min(va)) / ma, (max(vb) - min(vb)) / mb))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("more", nargs="*", help="further bundles (C, D, ...), each compared with A")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--pp", default="128")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=None, help="prompt length before each decode run (impc bench --prompt)")
    ap.add_argument("--path-a", default=None, help="a directory first on A's PYTHONPATH (another imp_runtime)")
    ap.add_argument("--path-b", default=None, help="the same for B")
    x = ap.parse_args()

    def env_for(extra: str | None) -> dict[str, str]:
        env = dict(os.environ)
        if extra:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (extra, env.get("PYTHONPATH", "")) if p)
        return env

    sides = [("A", x.a, x.path_a), ("B", x.b, x.path_b)] + [(chr(ord("C") + i), m, None) for i, m in enumerate(x.more)]
    rounds: dict[str, list[dict[str, float]]] = {tag: [] for tag, _, _ in sides}
    for r in range(x.rounds):
        for tag, bundle, extra in sides:
            cmd = [sys.executable, "-m", "impc.cli", "bench", bundle, "--batches", x.batches, "--pp", x.pp,
                   "--runs", str(x.runs)] + (["--prompt", str(x.prompt)] if x.prompt else [])
            p = subprocess.run(cmd, capture_output=True, text=True, env=env_for(extra))
            if p.returncode != 0:
                print(f"error: bench of {bundle} failed:\n{p.stderr[-2000:]}", file=sys.stderr)
                return 1
            got = parse_bench(p.stdout)
            rounds[tag].append(got)
            print(f"round {r + 1} {tag}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()), flush=True)
    print(f"\nA = {x.a}{f' (PYTHONPATH first: {x.path_a})' if x.path_a else ''}\n"
          f"B = {x.b}{f' (PYTHONPATH first: {x.path_b})' if x.path_b else ''}")
    for tag, bundle, _ in sides[2:]:
        print(f"{tag} = {bundle}")
    print(f"{x.rounds} alternating rounds{f', decode after a {x.prompt}-token prompt' if x.prompt else ''}, medians "
          f"(tok/s; bandwidths TB/s):")
    for tag, _, _ in sides[1:]:
        print(f"  {'measurement':18s} {'A':>10s} {tag:>10s} {tag + ' vs A':>8s} {'A spread':>9s} {tag + ' spread':>9s}")
        for n, ma, mb, d, sa, sb in summarize(rounds, tag):
            digits = 2 if n.endswith("TB/s") else 1
            print(f"  {n:18s} {ma:10.{digits}f} {mb:10.{digits}f} {100 * d:+7.1f}% {100 * sa:8.1f}% {100 * sb:8.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
