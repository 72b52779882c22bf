#!/usr/bin/env bash
# The GPU check run on the GPU machine (H200). Bundles are compiled on the build machine (nvcc wheels) by
# scripts/build_gpu_check_bundles.sh and sent along: build/gpu-bundles (tiny + synthetic test bundles),
# build/syn-* (8B-shape synthetic bundles). SmolLM2's bundle (~111 MiB) is over the 64 MiB we can send at a
# time, so it goes in two runs back to back (the GPU machine's /tmp keeps the first half in between):
#   phase a: takes build/smol-a (manifest, tokenizer, cubin, first 54,000,000 bytes of weights) and stashes it in
#            /tmp/imp-smol; runs the kernel tests, the tiny-model tests and the synthetic-bundle benches.
#   phase b: takes build/smol-b (the rest of the weights), reassembles /tmp/imp-smol/smollm2 and runs
#            the SmolLM2 tests and bench.
# Usage: scripts/gpu_check.sh a|b|all [bench runs]
set -uo pipefail
PHASE=${1:-all}
RUNS=${2:-3}
OUT=${OUT:-/tmp/imp-out}
mkdir -p "$OUT" /tmp/imp-pkgs /tmp/imp-smol
ln -sfn "$PWD/runtime" /tmp/imp-pkgs/imp_runtime
export PYTHONPATH="$PWD:/tmp/imp-pkgs${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader | tee -a "$SUMMARY"
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')" >> "$SUMMARY"

run_tests() {   # name, pytest args...
  local name=$1; shift
  $PY -m pytest -q -p no:cacheprovider -m gpu "$@" > "$OUT/$name.log" 2>&1
  echo "tests $name: $(tail -1 "$OUT/$name.log")" | tee -a "$SUMMARY"
}
bench() {       # name, bundle, extra args
  local name=$1 bundle=$2; shift 2
  $PY -m impc.cli bench "$bundle" --runs "$RUNS" --json "$@" > "$OUT/bench-$name.json" 2> "$OUT/bench-$name.err"
  $PY - "$OUT/bench-$name.json" "$name" >> "$SUMMARY" 2>&1 <<'PYEOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"bench {sys.argv[2]}: FAILED ({e})"); sys.exit()
d = " ".join(f"b{b}={v['tok_s']:.0f}" for b, v in r["decode"].items())
p = " ".join(f"pp{b}={v['tok_s']:.0f}" for b, v in r["prefill"].items())
print(f"bench {sys.argv[2]}: decode tok/s {d} | prefill tok/s {p} | ttft {r.get('ttft_ms', 0):.1f} ms | load {r['load_s']:.2f} s"
      f" | mem {r['peak_gpu_memory_bytes']/2**30:.1f} GiB | b1 weight bw {r.get('decode_b1_weight_bandwidth_Bps', 0)/1e12:.2f} TB/s"
      f" = {100*r.get('decode_b1_bandwidth_fraction', 0):.0f}% of copy {r['copy_bandwidth_Bps']/1e12:.2f} TB/s")
PYEOF
}

if [[ $PHASE == a || $PHASE == all ]]; then
  [[ -d build/smol-a ]] && cp -r build/smol-a/. /tmp/imp-smol/ && echo "stashed smol-a" >> "$SUMMARY"
  run_tests kernels tests/test_gpu_kernels.py
  run_tests tiny tests/test_gpu_model.py -k "tiny or synthetic"
  [[ -d build/syn-qwen3-8b ]] && bench qwen3-8b build/syn-qwen3-8b --batches 1,2,4,8,16,32,64
  [[ -d build/syn-qwen3-8b-qh ]] && bench qwen3-8b-qh build/syn-qwen3-8b-qh --batches 1,8,16 --pp 512
  [[ -d build/syn-llama-8b ]] && bench llama-8b build/syn-llama-8b --batches 1,64 --pp 512
fi
if [[ $PHASE == b || $PHASE == all ]]; then
  if [[ -f build/smol-b/weights.part-b && -f /tmp/imp-smol/weights.part-a ]]; then
    mkdir -p /tmp/imp-smol/smollm2
    cp -r /tmp/imp-smol/manifest.json /tmp/imp-smol/tokenizer.json /tmp/imp-smol/chat_template.jinja /tmp/imp-smol/kernels /tmp/imp-smol/smollm2/
    cat /tmp/imp-smol/weights.part-a build/smol-b/weights.part-b > /tmp/imp-smol/smollm2/weights.safetensors
    export IMP_SMOLLM2_BUNDLE=/tmp/imp-smol/smollm2
  fi
  echo "smollm2 bundle: ${IMP_SMOLLM2_BUNDLE:-build/smollm2}" >> "$SUMMARY"
  run_tests smollm2 tests/test_gpu_model.py -k "not tiny and not synthetic"
  bench smollm2 "${IMP_SMOLLM2_BUNDLE:-build/smollm2}"
fi
echo "==== summary"; cat "$SUMMARY"
