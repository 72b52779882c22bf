#!/usr/bin/env bash
# The first GPU check of `--prefill-gemm cutlass` (issue 9 deliverable 1), in two halves.
#   scripts/cutlass_check.sh build DIR   on the compiling machine (nvcc, CUTLASS's headers): the GPU test bundles
#                                        llama-bf16-cutlass and llama-cutlass under DIR/tb, and 8B-shape synthetic bundles
#                                        (--vram 40) NVFP4 and all bf16, each with and without the option, under DIR/8b
#   scripts/cutlass_check.sh run DIR OUT on the GPU machine (DIR carried; the project importable and its wheels
#                                        installed): the CUTLASS GPU tests, then per pair
#                                        scripts/ab_bench.py (prefill 512 / 2048 / 4096 and batch 1), then
#                                        scripts/bench_gemm.py's per-GEMM table of the NVFP4 CUTLASS bundle; logs in OUT,
#                                        a short summary printed last
set -uo pipefail
USAGE="usage: scripts/cutlass_check.sh build DIR | run DIR OUT"
MODE=${1:?$USAGE}
DIR=${2:?$USAGE}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
case $MODE in
  build)
    PY=${PYTHON:-$ROOT/.venv/bin/python}
    IMP_GPU_BUNDLES="$DIR/tb" "$PY" "$ROOT/scripts/build_gpu_bundles.py" llama-bf16-cutlass llama-cutlass || exit 1
    for q in nvfp4 bf16; do
      for g in auto cutlass; do
        out="$DIR/8b/$q-$g"
        [ -f "$out/manifest.json" ] || "$PY" -m impc.cli compile --synthetic "$ROOT/examples/qwen3-8b.json" -o "$out" \
          --target sm_90a --vram 40 --quant $q --prefill-gemm $g -q || exit 1
      done
    done
    du -sh "$DIR"
    ;;
  run)
    OUT=${3:?$USAGE}
    mkdir -p "$OUT"
    export PYTHONUNBUFFERED=1
    IMP_GPU_BUNDLES="$DIR/tb" timeout 240 $PY -m pytest -q -p no:cacheprovider -m gpu --tb=short \
      "$ROOT/tests/test_gpu_kernels.py" "$ROOT/tests/test_gpu_model.py" -k cutlass > "$OUT/tests.log" 2>&1
    echo "tests: $(tail -1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -12
    for q in nvfp4 bf16; do
      timeout 200 $PY "$ROOT/scripts/ab_bench.py" "$DIR/8b/$q-auto" "$DIR/8b/$q-cutlass" --rounds 3 --batches 1 \
        --pp 512,2048,4096 > "$OUT/ab-$q.txt" 2>&1
      echo "== $q: imp's GEMMs (A) against --prefill-gemm cutlass (B)"; grep -E "prefill|decode batch 1 " "$OUT/ab-$q.txt"
    done
    timeout 150 $PY "$ROOT/scripts/bench_gemm.py" "$DIR/8b/nvfp4-cutlass" --m 512,4096 --runs 5 --wgmma-only \
      > "$OUT/gemm.txt" 2>&1
    grep -E "^\||checks" "$OUT/gemm.txt"
    ;;
  *) echo "$USAGE" >&2; exit 2;;
esac
