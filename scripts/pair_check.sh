#!/usr/bin/env bash
# The first GPU check of `--gemv-pair` (issue 8: two one-row GEMVs in one launch, templates/gemv_ring_pair.cu.j2), in
# two halves.
#   scripts/pair_check.sh build DIR   on the compiling machine: the GPU test bundles syn-qwen3-8b-2l(-pair) and
#                                     syn-llama-8b-2l(-pair) under DIR/tb; 8B-shape synthetic bundles (--vram 40) without
#                                     (T) and with (P) the option, and their timer builds (Tt, Pt), with one pair only
#                                     (PG: --gemv-pair-only o-gate-up, PD: down-qkv), under DIR/8b;
#                                     scripts/boundary_cost.cu as DIR/bc.cubin (~52 MB in all; scripts/gpu_kit.sh packs it)
#   scripts/pair_check.sh run DIR OUT on the GPU machine (DIR carried; the project importable and its wheels
#                                     installed): the pair kernels' GPU tests (bit for bit against the launches they
#                                     replace, batch invariance), scripts/ab_bench.py T P PG PD at 1 and 4 rows
#                                     (PAIR_AB: other bundles, names under DIR/8b or paths), the per-kernel
#                                     table of both, and the phase timers of layer 18's pairs and the launches they
#                                     replace, and scripts/boundary_cost.py (the barrier against a PDL boundary); logs in
#                                     OUT, a short summary printed last
set -uo pipefail
USAGE="usage: scripts/pair_check.sh build DIR | run DIR OUT"
MODE=${1:?$USAGE}
DIR=${2:?$USAGE}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
case $MODE in
  build)
    PY=${PYTHON:-$ROOT/.venv/bin/python}
    IMP_GPU_BUNDLES="$DIR/tb" "$PY" "$ROOT/scripts/build_gpu_bundles.py" syn-qwen3-8b-2l syn-qwen3-8b-2l-pair \
      syn-llama-8b-2l syn-llama-8b-2l-pair || exit 1
    "$PY" "$ROOT/scripts/boundary_cost.py" --build "$DIR/bc.cubin" || exit 1
    for b in T P Tt Pt PG PD; do
      out="$DIR/8b/$b"
      case $b in
        PG) flags="--gemv-pair-only o-gate-up";;
        PD) flags="--gemv-pair-only down-qkv";;
        P*) flags=--gemv-pair;;
        *) flags=--no-gemv-pair;;
      esac
      timers=$([ "${b:1:1}" = t ] && echo 1 || echo 0)
      [ -f "$out/manifest.json" ] || IMP_KERNEL_TIMERS=$timers "$PY" -m impc.cli compile --synthetic \
        "$ROOT/examples/qwen3-8b.json" -o "$out" --target sm_90a --vram 40 $flags -q || exit 1
    done
    du -sh "$DIR"
    ;;
  run)
    OUT=${3:?$USAGE}
    mkdir -p "$OUT"
    export PYTHONUNBUFFERED=1
    # PAIR_TESTS: the pytest -k expression (default: every pair and 8B-shape GEMV test, ~7 min); "none" skips them;
    # PAIR_TEST_LIMIT / PAIR_AB_LIMIT: seconds for the tests (500) and the A/B (500); PAIR_AB_ONLY: stop after the A/B
    K=${PAIR_TESTS:-pair or (8b and not rolled)}
    if [ "$K" != none ]; then
      IMP_GPU_BUNDLES="$DIR/tb" timeout ${PAIR_TEST_LIMIT:-500} $PY -m pytest -q -p no:cacheprovider -m gpu --tb=short \
        "$ROOT/tests/test_gpu_kernels.py" "$ROOT/tests/test_gpu_model.py" -k "$K" > "$OUT/tests.log" 2>&1
      echo "tests: $(tail -1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -12
      # (a kernel that is wrong or never returns is not worth timing: stop here)
      tail -1 "$OUT/tests.log" | grep -q " passed" && ! grep -qE "^(FAILED|ERROR)" "$OUT/tests.log" || exit 1
    fi
    AB=()
    for b in ${PAIR_AB:-T P PG PD}; do
      [ -d "$b" ] && AB+=("$b") || AB+=("$DIR/8b/$b")
    done
    timeout ${PAIR_AB_LIMIT:-500} $PY "$ROOT/scripts/ab_bench.py" "${AB[@]}" --rounds 3 --batches ${PAIR_AB_BATCHES:-1,4} --pp "" \
      > "$OUT/ab.txt" 2>&1
    AB_RC=$?
    echo "== ${AB[*]}"; grep -E "^[A-Z] =|decode batch|TB/s|error" "$OUT/ab.txt"
    [ -n "${PAIR_AB_ONLY:-}" ] && exit $AB_RC
    for b in T P; do
      timeout 90 $PY "$ROOT/scripts/profile_step.py" "$DIR/8b/$b" --tokens 1 --context 512 --reps 10 --by-shape \
        --back-to-back --graph > "$OUT/prof-$b.txt" 2>&1
      echo "== per kernel, $b"; grep -E "gemv_ring|attn_decode|copy" "$OUT/prof-$b.txt" | cut -c1-150
    done
    # layer 18: T's o (73), gate_up (74), down (75) and the next qkv (76) among its gemv_ring launches; P's o + gate_up
    # (37) and down + qkv (38) pairs (phases 2 and 3 of a pair: its first GEMV's last stage done, past the barrier)
    for occ in 73 74 75 76; do
      echo "== T, gemv_ring #$occ"
      timeout 45 $PY "$ROOT/scripts/kernel_phases.py" "$DIR/8b/Tt" --kernel gemv_ring --occurrence $occ --reps 10 \
        2>&1 | tee "$OUT/phases-T-$occ.txt" | head -12
    done
    for occ in 37 38; do
      echo "== P, gemv_ring #$occ"
      timeout 45 $PY "$ROOT/scripts/kernel_phases.py" "$DIR/8b/Pt" --kernel gemv_ring --occurrence $occ --reps 10 \
        2>&1 | tee "$OUT/phases-P-$occ.txt" | head -12
    done
    # what the barrier costs against a PDL boundary, with __threadfence (persistent_steps) and as the pairs arrive
    # (persistent_steps_rel: an acquire-release fence and a relaxed add)
    timeout 60 $PY "$ROOT/scripts/boundary_cost.py" "$DIR/bc.cubin" --blocks-per-sm 2 --work-ns 0,1000 --pre-ns 500 \
      2>&1 | tee "$OUT/boundary.txt" | tail -5
    ;;
  *) echo "$USAGE" >&2; exit 2;;
esac
