#!/usr/bin/env bash
# Builds scripts/cutlass_params.cu (a host program: a CUTLASS 3.x GEMM's Params built without a GPU, issue 9) into
# OUTDIR/cutlass_params with the PyPI nvcc of .venv and the nvidia-cutlass wheel's headers (installed into .cache/ by
# scripts/cutlass_env.sh when missing), then runs it for each "M N K beta" given.
# Usage: scripts/cutlass_params.sh [OUTDIR] ["M N K beta" ...]      (default build/cutlass, "4096 6144 4096 0")
set -euo pipefail
. "$(dirname "$0")/cutlass_env.sh"       # ROOT, PKG, PY, INC, NVCC, CUDA_LIB
cd "$ROOT"
OUT=$(mkdir -p "${1:-build/cutlass}" && cd "${1:-build/cutlass}" && pwd)
shift || true
TIMEFORMAT="cutlass_params: nvcc wall %R s, user %U s"
time "$NVCC" -std=c++17 -arch=sm_90a -O1 --expt-relaxed-constexpr -DCUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL -DNDEBUG \
    -I"$INC/include" -I"$INC/tools/util/include" -L"$CUDA_LIB" scripts/cutlass_params.cu -o "$OUT/cutlass_params"
[ $# -gt 0 ] || set -- "4096 6144 4096 0"
for shape in "$@"; do
    # shellcheck disable=SC2086
    "$OUT/cutlass_params" $shape
done
