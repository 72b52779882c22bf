#!/usr/bin/env bash
# The whole GPU check of a tree, in one go, as BENCHMARKS.md's sessions run it: the GPU test suite, `impc bench` of
# a bundle (decode, prefill, mixed steps), and served load through `impc serve` + scripts/bench_serve.py (1, 8 and 64
# streams of 512-token prompts and 256 output tokens, lockstep and jittered, and a 2,000-token shared prefix).
# Logs go to OUT; a short summary is printed last.
#
# Usage: scripts/gpu_check.sh OUT BUNDLE [--no-tests] [--no-serve] [--peer CONFIG]
#   BUNDLE: e.g. a synthetic 8B-shape bundle (impc compile --synthetic examples/qwen3-8b.json -o BUNDLE --target sm_90a)
#   the GPU tests read their bundles from $IMP_GPU_BUNDLES (scripts/build_gpu_bundles.py builds them)
#   --peer CONFIG: also scripts/prefill_peer.py CONFIG (the bf16 PyTorch model of the bundle's shape, issue 9's peer)
#   right after the bench, so the two prefill figures come from one call
# The whole GPU suite alone takes ~5 minutes (2026-12-03): with the bench and served load it exceeds one 10-minute
# device command, so run the tests in a call of their own and this script with --no-tests.
set -uo pipefail
USAGE="usage: scripts/gpu_check.sh OUT BUNDLE [--no-tests] [--no-serve] [--peer CONFIG]"
OUT=${1:?$USAGE}
BUNDLE=${2:?$USAGE}
shift 2
TESTS=1; SERVE=1; PEER=
while [ $# -gt 0 ]; do
  case $1 in
    --no-tests) TESTS=0;;
    --no-serve) SERVE=0;;
    --peer) PEER=${2:?$USAGE}; shift;;
    *) echo "unknown option $1" >&2; echo "$USAGE" >&2; exit 2;;
  esac
  shift
done
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ $TESTS = 1 ]; then
  timeout 450 $PY -m pytest -q -p no:cacheprovider -m gpu --tb=short --durations=15 tests/test_gpu_model.py tests/test_gpu_kernels.py \
    tests/test_gpu_engine.py tests/test_pipelined_scheduler.py > "$OUT/tests.log" 2>&1
  echo "tests: $(tail -1 "$OUT/tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -16
fi
timeout 200 $PY -m impc.cli bench "$BUNDLE" --batches 1,8,16,32,64 --pp 128,512,2048,4096 --mixed 64:192,0:512x4 \
  --runs 3 > "$OUT/bench.txt" 2> "$OUT/bench.err" || tail -3 "$OUT/bench.err"
grep -E "batch|pp|mixed|first|copy" "$OUT/bench.txt"
if [ -n "$PEER" ]; then
  timeout 150 $PY scripts/prefill_peer.py "$PEER" --pp 128,512,4096 --runs 5 > "$OUT/peer.txt" 2>&1
  grep -E "peer" "$OUT/peer.txt"
fi
[ $SERVE = 1 ] || exit 0
# the served part needs the server's and the load client's packages: say so at once instead of 1,000 refused requests
if ! $PY -c "import uvicorn, starlette, httpx" 2> "$OUT/serve-imports.txt"; then
  echo "served load skipped: $(tail -1 "$OUT/serve-imports.txt") (install the project's serving dependencies)"; exit 1
fi
PORT=${PORT:-8080}
IMP_STEP_STATS=400 $PY -m impc.cli serve "$BUNDLE" --port $PORT --max-running 64 --log-level warning > "$OUT/serve.log" 2>&1 &
SP=$!
$PY - "$PORT" <<'PY'
import sys, time, urllib.request
for _ in range(480):
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1).status == 200:
            break
    except Exception:
        pass
    time.sleep(0.25)
PY
if ! kill -0 $SP 2>/dev/null; then echo "the server exited at start:"; tail -5 "$OUT/serve.log"; exit 1; fi
run() { local tag=$1; shift; timeout 120 $PY scripts/bench_serve.py http://127.0.0.1:$PORT --ignore-eos --json "$OUT/serve-$tag.json" "$@" \
  > "$OUT/serve-$tag.txt" 2>&1; echo "served $tag: $(head -2 "$OUT/serve-$tag.txt" | tr '\n' ' ' | cut -c1-330)"; }
run 1-stream --clients 1 --requests 3 --prompt-len 512 --output-len 256
run 8-streams --clients 8 --requests 24 --prompt-len 512 --output-len 256 --seed 8
run 64-lockstep --clients 64 --requests 128 --prompt-len 512 --output-len 256 --seed 64
run 64-jittered --clients 64 --requests 256 --prompt-len 512 --output-len 256 --prompt-jitter 0.25 --output-jitter 0.25 --seed 64
run prefix --clients 1 --requests 6 --shared-prefix 2000 --prompt-len 64 --output-len 16 --per-request --seed 5
grep -E "request [0-5]:" "$OUT/serve-prefix.txt"
kill $SP; wait $SP 2>/dev/null
grep "step times" "$OUT/serve.log" | tail -1 | cut -c1-260
