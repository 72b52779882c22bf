#!/usr/bin/env bash
# Builds scripts/cutlass_gemm.cu (CUTLASS 3.x Hopper GEMMs, issue 9) into OUTDIR/libcutlass_gemm.so with the PyPI
# nvcc of .venv (impc.emit.nvcc_path) and the CUTLASS headers of the nvidia-cutlass wheel, which it pip-installs
# (headers only, --no-deps) into .cache/ when missing. Each kernel is its own compilation unit, compiled one after
# the other so that nvcc's wall and CPU time per kernel can be read off (bash `time`: real, user+sys of nvcc and its
# children); then the C ABI's unit, then one shared library with the CUDA runtime linked statically (it loads where
# only the driver is installed; the driver must support the nvcc's CUDA version).
#
# Usage: scripts/build_cutlass_gemm.sh [OUTDIR]      (default build/cutlass)
#   env: CUTLASS_VERSION (4.2.0.0), CUTLASS_PKG (where the wheel goes), PYTHON (.venv/bin/python), NVCC, KERNELS
#        (space-separated kernel indices to compile, for their times alone: no library then), JOBS (parallel nvcc processes, default 1: with
#        more, the times per kernel are no longer each kernel's alone)
set -euo pipefail
. "$(dirname "$0")/cutlass_env.sh"       # ROOT, PKG, PY, INC, NVCC, CUDA_LIB (the wheel's libcudart_static.a)
cd "$ROOT"
OUT=$(mkdir -p "${1:-build/cutlass}" && cd "${1:-build/cutlass}" && pwd)
SRC=$ROOT/scripts/cutlass_gemm.cu
JOBS=${JOBS:-1}
echo "nvcc: $NVCC ($("$NVCC" --version | tail -1))"
echo "CUTLASS: $(sed -n 's/^#define CUTLASS_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\).*/\2/p' "$INC/include/cutlass/version.h" | paste -sd.) from $INC"

# -DNDEBUG: without it CUTLASS's device asserts are calls inside the mainloop and ptxas serialises every wgmma
# (warning C7510).
FLAGS=(-arch=sm_90a -std=c++17 -O3 --expt-relaxed-constexpr -DNDEBUG -Xcompiler -fPIC
       -I"$INC/include" -I"$INC/tools/util/include")
NK=$(sed -n 's/^#define CG_NKERNELS \([0-9]*\)/\1/p' "$SRC")
ALL=$(seq 0 $((NK - 1)) | paste -sd' ')
KERNELS=${KERNELS:-$ALL}
mkdir -p "$OUT/obj"
rm -f "$OUT"/obj/*.o "$OUT"/obj/*.log

compile() {      # compile PART NAME: one unit, its log in obj/NAME.log, its times on stdout
    local part=$1 name=$2
    local TIMEFORMAT="$name: nvcc wall %R s, user %U s, sys %S s"
    { time "$NVCC" "${FLAGS[@]}" -DCG_PART="$part" -c "$SRC" -o "$OUT/obj/$name.o" \
        >"$OUT/obj/$name.log" 2>&1 ; } 2>&1 || { echo "$name: FAILED"; tail -30 "$OUT/obj/$name.log"; return 1; }
    if grep -q C7510 "$OUT/obj/$name.log"; then echo "$name: WARNING: ptxas serialised wgmma (C7510)"; fi
}

status=0
if [ "$JOBS" -le 1 ]; then
    for k in $KERNELS; do compile "$k" "k$k" || status=1; done
else
    pids=()
    for k in $KERNELS; do
        compile "$k" "k$k" & pids+=($!)
        while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 1; done
    done
    for p in "${pids[@]}"; do wait "$p" || status=1; done
fi
[ $status -eq 0 ] || { echo "build failed"; exit 1; }
[ "$KERNELS" = "$ALL" ] || { echo "KERNELS=$KERNELS: not all kernels, no library"; exit 0; }
compile -1 abi || { echo "build failed"; exit 1; }

TIMEFORMAT="link: wall %R s, user %U s, sys %S s"
time "$NVCC" -arch=sm_90a -shared -cudart static -Xcompiler -fPIC -Xlinker --no-undefined -L"$CUDA_LIB" -o "$OUT/libcutlass_gemm.so" "$OUT"/obj/*.o
strip --strip-unneeded "$OUT/libcutlass_gemm.so" 2>/dev/null || true
ls -l "$OUT/libcutlass_gemm.so"
ldd "$OUT/libcutlass_gemm.so" || true
