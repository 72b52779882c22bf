#!/usr/bin/env bash
# Profile batch-1 decode GEMVs on an H200 (one run): ncu on one eager decode step of a bundle
# (default build/syn-qwen3-8b): the GEMVs of the first two layers, with IMP_GEMV_PIPE=0 and =1 (an A/B switch
# the executor may or may not have: the same kernels then); a per-kernel duration list of the whole step; the
# GEMV microbenchmark; and a b1/b8 bench for each IMP_GEMV_PIPE in $AB (default "0 1").
# Writes $OUT/ncu-*.csv, step-kernels.txt, micro.txt, ab.txt; ~60-90 s on an H200 (2026-11-30).
# Usage: scripts/profile_decode.sh [bundle]
set -uo pipefail
B=${1:-build/syn-qwen3-8b}
OUT=${OUT:-/tmp/imp-out}
mkdir -p "$OUT" /tmp/imp-pkgs
ln -sfn "$PWD/runtime" /tmp/imp-pkgs/imp_runtime
export PYTHONPATH="$PWD:/tmp/imp-pkgs${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
M="gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,sm__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
prof() {  # name, env, kernel regex, count
  env $2 timeout 100 "$NCU" --clock-control none --profile-from-start off -k "regex:$3" --launch-count "$4" \
    --metrics "$M" --csv --page raw $PY scripts/profile_decode.py step "$B" > "$OUT/ncu-$1.csv" 2> "$OUT/ncu-$1.err"
  echo "ncu $1 rc=$?"
}
prof old IMP_GEMV_PIPE=0 '^gemv_' 8
prof new IMP_GEMV_PIPE=1 '^gemv_' 8
env IMP_GEMV_PIPE=0 timeout 100 "$NCU" --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv --page raw \
  $PY scripts/profile_decode.py step "$B" > "$OUT/ncu-step.csv" 2> "$OUT/ncu-step.err"; echo "ncu step rc=$?"
$PY - "$OUT/ncu-step.csv" > "$OUT/step-kernels.txt" <<'PYEOF'
import csv, sys, collections
rd = list(csv.reader(open(sys.argv[1]))); hi = next(i for i, r in enumerate(rd) if r and r[0] == "ID")
h = rd[hi]; u = rd[hi + 1]; ix = h.index("gpu__time_duration.sum"); kn = h.index("Kernel Name")
sc = 1e-3 if u[ix] in ("nsecond", "ns") else (1e3 if u[ix] == "msecond" else 1.0)
tot = collections.defaultdict(lambda: [0, 0.0])
for r in rd[hi + 2:]:
    if len(r) > ix:
        k = r[kn].split("(")[0]; tot[k][0] += 1; tot[k][1] += float(r[ix].replace(",", "")) * sc
s = sum(v[1] for v in tot.values())
print(f"one eager decode step (ncu, serialized): {sum(v[0] for v in tot.values())} kernels, {s:.0f} us of kernel time")
for k, (n, t) in sorted(tot.items(), key=lambda x: -x[1][1]):
    print(f"  {k:32s} x{n:4d} {t:8.1f} us {100 * t / s:5.1f}%  ({t / n:.2f} us each)")
PYEOF
$PY scripts/profile_decode.py table "$OUT/ncu-old.csv" "$OUT/ncu-new.csv" | tee "$OUT/ncu-table.txt"
cat "$OUT/step-kernels.txt" | head -25
timeout 100 $PY scripts/profile_decode.py micro "$B" > "$OUT/micro.txt" 2>&1; echo "micro rc=$?"
for p in ${AB:-0 1}; do
  IMP_GEMV_PIPE=$p timeout 90 $PY -m impc.cli bench "$B" --runs 2 --batches 1,8 --pp 128 2>/dev/null | grep -i "decode\|bandwidth" | sed "s/^/pipe=$p /"
done | tee "$OUT/ab.txt"
echo "=== micro"; tail -9 "$OUT/micro.txt"
