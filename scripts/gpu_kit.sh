#!/usr/bin/env bash
# What a GPU session needs from the compiling machine (bundles, cubins), built into build/kit/ and packed as one xz
# archive: cubins of one template set compress well (all of it, ~136 MB, is ~8.6 MB), so the whole suite, the check
# scripts' bundles and the bench bundles travel together instead of a few at a time.
#   scripts/gpu_kit.sh build ARCHIVE [PART ...]   here (nvcc wheels in .venv): build/kit/ emptied (so no bundle of an
#                                                 older tree is packed; the compile cache makes a rebuild ~3 min), each
#                                                 PART built under it, then packed into ARCHIVE (.tar.xz)
#       suite   every GPU test bundle (scripts/build_gpu_bundles.py) in build/kit/tb (the default, with pair and bench)
#       pair    scripts/pair_check.sh build build/kit/pc (the 8B shape with and without --gemv-pair, timer builds)
#       bench   the synthetic Qwen3-8B (T), SmolLM2 (S) and Llama-3.1-8B (L) shapes' default bundles (--vram 40, 8,
#               40) and Llama-3.1-8B's with --gemv-pair (LP), build/kit/bench/{T,S,L,LP}
#       cutlass scripts/cutlass_check.sh build build/kit/cc (needs CUTLASS's headers)
#       base:COMMIT  the bench shapes' default bundles (T, S, L) compiled by the tree at COMMIT (a temporary git
#               worktree), build/kit/base/{T,S,L}: the other side of an A/B against bench's (scripts/ab_bench.py
#               build/kit/base/T build/kit/bench/T), so a kernel change is measured against its own base in one call
#       patch:NAME:FILE  the bench shapes' default bundles compiled by this tree's HEAD with the patch FILE applied
#               (e.g. experiments/*.patch: a kernel probe kept out of the templates until measured), build/kit/NAME/
#               {T,S,L}: a third side for the same ab_bench call (scripts/ab_bench.py base/T bench/T NAME/T)
#       flags:NAME:FLAGS  the bench shapes' bundles compiled by this tree with `impc compile` flags FLAGS (commas
#               between them, e.g. flags:ahr:--attn-head-ready or flags:np:--no-gemv-ring-unroll,--no-qkv-rope-tail),
#               build/kit/NAME/{T,S,L}: an off-by-default option against the default in one ab_bench call
#   scripts/gpu_kit.sh unpack ARCHIVE             on the GPU machine, in the project's root: ARCHIVE into build/kit/
#   scripts/gpu_kit.sh suite OUT kernels|8b|model on the GPU machine after unpack (and `source scripts/gpu_env.sh`):
#                                                 a third of the GPU test suite on build/kit/tb (the kernel tests but
#                                                 the 8B shapes'; those; the model, engine and scheduler tests), each
#                                                 within a 10-minute command, log in OUT
# On the GPU machine, e.g.:
#   bash scripts/gpu_kit.sh unpack build/kit.tar.xz && source scripts/gpu_env.sh && bash scripts/gpu_kit.sh suite OUT 8b
set -uo pipefail
USAGE="usage: scripts/gpu_kit.sh build ARCHIVE [suite|pair|bench|cutlass|base:COMMIT|patch:NAME:FILE|flags:NAME:FLAGS ...] | unpack ARCHIVE | suite OUT kernels|8b|model"
MODE=${1:?$USAGE}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
KIT=$ROOT/build/kit
BENCH="T:qwen3-8b:40 S:smollm2-135m:8 L:llama-3.1-8b:40"   # the bench shapes: name:examples config:--vram
# compile_shapes DIR DEST SHAPES [FLAGS...]: each name:config:vram[:flag] of SHAPES compiled by the tree at DIR (its
# impc: python -m puts the working directory first) into DEST/name, with FLAGS (impc compile flags) after its own
compile_shapes() {
  local dir=$1 dest=$2 shapes=$3 b name cfg vram flag
  shift 3
  for b in $shapes; do
    IFS=: read -r name cfg vram flag <<< "$b"
    (cd "$dir" && "$PY" -m impc.cli compile --synthetic "examples/$cfg.json" -o "$dest/$name" \
      --target sm_90a --vram "$vram" -q ${flag:+"$flag"} "$@") || return 1
  done
}
case $MODE in
  build)
    ARCHIVE=${2:?$USAGE}
    shift 2
    PY=${PYTHON:-$ROOT/.venv/bin/python}
    PARTS=${*:-suite pair bench}
    rm -rf "$KIT" && mkdir -p "$KIT" || exit 1
    for part in $PARTS; do
      case $part in
        suite) IMP_GPU_BUNDLES="$KIT/tb" "$PY" "$ROOT/scripts/build_gpu_bundles.py" || exit 1;;   # (all of them)
        pair) PYTHON=$PY bash "$ROOT/scripts/pair_check.sh" build "$KIT/pc" || exit 1;;
        bench) compile_shapes "$ROOT" "$KIT/bench" "$BENCH LP:llama-3.1-8b:40:--gemv-pair" || exit 1;;
        cutlass) PYTHON=$PY bash "$ROOT/scripts/cutlass_check.sh" build "$KIT/cc" || exit 1;;
        flags:*)
          IFS=: read -r _ dest flags <<< "$part"
          [[ -n $dest && -n $flags ]] || { echo "flags:NAME:FLAGS needs a name and flags ($part)" >&2; exit 2; }
          case $dest in tb|pc|bench|base|cc|*/*) echo "flags:$dest: a name the kit uses already" >&2; exit 2;; esac
          IFS=, read -r -a extra <<< "$flags"
          compile_shapes "$ROOT" "$KIT/$dest" "$BENCH" "${extra[@]}" || exit 1
          { git -C "$ROOT" rev-parse HEAD; echo "flags: ${extra[*]}"; } > "$KIT/$dest/COMMIT";;
        base:*|patch:*)
          if [[ $part == base:* ]]; then commit=${part#base:} dest=base patch=
          else
            IFS=: read -r _ dest patch <<< "$part"
            commit=HEAD
            [[ -n $dest && -f $patch ]] || { echo "patch:NAME:FILE needs a name and a patch file ($part)" >&2; exit 2; }
            case $dest in tb|pc|bench|base|cc|*/*) echo "patch:$dest: a name the kit uses already" >&2; exit 2;; esac
            patch=$(cd "$(dirname "$patch")" && pwd)/$(basename "$patch")
          fi
          wt=$(mktemp -d) && rmdir "$wt" || exit 1
          git -C "$ROOT" worktree add --detach -q "$wt" "$commit" || { echo "no commit $commit" >&2; exit 1; }
          if [[ -n $patch ]] && ! git -C "$wt" apply "$patch"; then
            echo "$patch does not apply to HEAD" >&2; git -C "$ROOT" worktree remove --force "$wt"; exit 1
          fi
          # the worktree's own packages: impc from its root (python -m puts the working directory first), and
          # imp_runtime (pyproject maps it to runtime/; the editable install would give this tree's) by a link
          ln -s runtime "$wt/imp_runtime" || { git -C "$ROOT" worktree remove --force "$wt"; exit 1; }
          compile_shapes "$wt" "$KIT/$dest" "$BENCH" || { git -C "$ROOT" worktree remove --force "$wt"; exit 1; }
          { git -C "$ROOT" rev-parse "$commit"; [[ -z $patch ]] || echo "+ ${patch#"$ROOT"/}"; } > "$KIT/$dest/COMMIT"
          git -C "$ROOT" worktree remove --force "$wt";;
        *) echo "unknown part $part" >&2; echo "$USAGE" >&2; exit 2;;
      esac
    done
    mkdir -p "$(dirname "$ARCHIVE")"
    XZ_OPT=${XZ_OPT:--6 -T0} tar -C "$ROOT/build" -cJf "$ARCHIVE" kit || exit 1
    echo "$(du -sh "$KIT" | cut -f1) in build/kit -> $(du -h "$ARCHIVE" | cut -f1) in $ARCHIVE"
    ;;
  unpack)
    ARCHIVE=${2:?$USAGE}
    mkdir -p "$ROOT/build"
    tar -C "$ROOT/build" -xJf "$ARCHIVE" || exit 1
    echo "unpacked: $(ls "$KIT" | tr '\n' ' ')($(du -sh "$KIT" | cut -f1))"
    ;;
  suite)
    OUT=${2:?$USAGE}
    WHICH=${3:?$USAGE}
    mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 1
    cd "$ROOT" || exit 1
    export IMP_GPU_BUNDLES="$KIT/tb"
    # a third of the suite a command (2026-12-05, H200: the kernel tests but the 8B shapes' 272 s; the 8B shapes' ~30
    # GEMV tests ~16 s each, mostly their host-side references; the model, engine and scheduler tests a few minutes)
    P="${PYTHON:-python3} -m pytest -q -p no:cacheprovider -m gpu --tb=short --durations=10"
    case $WHICH in
      kernels) timeout 560 $P tests/test_gpu_kernels.py -k "not 8b" > "$OUT/tests-$WHICH.log" 2>&1;;
      8b) timeout 560 $P tests/test_gpu_kernels.py -k 8b > "$OUT/tests-$WHICH.log" 2>&1;;
      model) timeout 560 $P tests/test_gpu_model.py tests/test_gpu_engine.py tests/test_pipelined_scheduler.py \
        > "$OUT/tests-$WHICH.log" 2>&1;;
      *) echo "$USAGE" >&2; exit 2;;
    esac
    rc=$?
    echo "tests ($WHICH): $(tail -1 "$OUT/tests-$WHICH.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/tests-$WHICH.log" | head -16 || true
    exit $rc
    ;;
  *) echo "$USAGE" >&2; exit 2;;
esac
