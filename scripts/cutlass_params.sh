#!/usr/bin/env bash
# Builds scripts/cutlass_params.cu (a host program: a CUTLASS 3.x GEMM's Params built without a GPU, issue 9) into
# OUTDIR/cutlass_params with the PyPI nvcc of .venv and the nvidia-cutlass wheel's headers (installed into .cache/ by
# scripts/build_cutlass_gemm.sh's rule when missing), then runs it for each "M N K beta" given.
# Usage: scripts/cutlass_params.sh [OUTDIR] ["M N K beta" ...]      (default build/cutlass, "4096 6144 4096 0")
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=$(mkdir -p "${1:-build/cutlass}" && cd "${1:-build/cutlass}" && pwd)
shift || true
CUTLASS_VERSION=${CUTLASS_VERSION:-4.2.0.0}
PKG=${CUTLASS_PKG:-$ROOT/.cache/nvidia-cutlass-$CUTLASS_VERSION}
PY=${PYTHON:-$ROOT/.venv/bin/python}
INC=$PKG/cutlass_library/source
if [ ! -f "$INC/include/cutlass/cutlass.h" ]; then
    echo "installing nvidia-cutlass==$CUTLASS_VERSION (headers) into $PKG"
    "$PY" -m pip install --quiet --no-deps --target "$PKG" "nvidia-cutlass==$CUTLASS_VERSION"
fi
NVCC=${NVCC:-$("$PY" -c "from impc.emit import nvcc_path; print(nvcc_path())")}
CUDA_LIB=$(cd "$(dirname "$NVCC")/../lib" && pwd)
TIMEFORMAT="cutlass_params: nvcc wall %R s, user %U s"
time "$NVCC" -std=c++17 -arch=sm_90a -O1 --expt-relaxed-constexpr -DCUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL -DNDEBUG \
    -I"$INC/include" -I"$INC/tools/util/include" -L"$CUDA_LIB" scripts/cutlass_params.cu -o "$OUT/cutlass_params"
[ $# -gt 0 ] || set -- "4096 6144 4096 0"
for shape in "$@"; do
    # shellcheck disable=SC2086
    "$OUT/cutlass_params" $shape
done
