# Sourced by scripts/build_cutlass_gemm.sh (issue 9's CUTLASS benchmark library): the nvidia-cutlass
# wheel's headers (pip-installed, headers only, --no-deps, into .cache/ when missing) and the PyPI nvcc of .venv.
# Sets ROOT, CUTLASS_VERSION, PKG, PY, INC (the headers' root), NVCC and CUDA_LIB (the wheel's lib/, where
# libcudart_static.a is: not on nvcc's own path). env: CUTLASS_VERSION (4.2.0.0), CUTLASS_PKG, PYTHON, NVCC.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CUTLASS_VERSION=${CUTLASS_VERSION:-4.2.0.0}
PKG=${CUTLASS_PKG:-$ROOT/.cache/nvidia-cutlass-$CUTLASS_VERSION}
PY=${PYTHON:-$ROOT/.venv/bin/python}
INC=$PKG/cutlass_library/source
if [ ! -f "$INC/include/cutlass/cutlass.h" ]; then
    echo "installing nvidia-cutlass==$CUTLASS_VERSION (headers) into $PKG"
    "$PY" -m pip install --quiet --no-deps --target "$PKG" "nvidia-cutlass==$CUTLASS_VERSION"
fi
NVCC=${NVCC:-$(cd "$ROOT" && "$PY" -c "from impc.emit import nvcc_path; print(nvcc_path())")}
CUDA_LIB=$(cd "$(dirname "$NVCC")/../lib" && pwd)
