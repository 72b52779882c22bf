#!/usr/bin/env python
"""Build the bundles the GPU tests use (sm_90a cubins), under build/gpu-bundles/ (or $IMP_GPU_BUNDLES):
tiny random llama / qwen3 / gemma3 / qwen2 checkpoints (tests/conftest.py) quantized to NVFP4 (llama-qe: the
embedding and head in NVFP4 too), and synthetic bundles whose kernels cover head_dim 128 and 256, each
planned for a few GiB of device memory so several load side by side. SmolLM2 is built by
`impc compile smollm2`.
Usage: scripts/build_gpu_bundles.py [NAME ...]"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import os  # noqa: E402

OUT = Path(os.environ.get("IMP_GPU_BUNDLES", ROOT / "build" / "gpu-bundles"))
TINY = {"llama": "llama", "qwen3": "qwen3", "gemma3": "gemma3", "qwen2": "qwen2", "llama-qe": "llama",
        "llama-i8": "llama", "qwen3-i8": "qwen3",
        "llama-mixed": "llama", "qwen3-wide": "qwen3_wide", "qwen3-wide-i8": "qwen3_wide_untied", "qwen3-pen": "qwen3",
        "qwen3-rope": "qwen3", "qwen2-rope": "qwen2",     # -rope: --rope-in-attention
        "qwen3-qkvepi": "qwen3_wide",   # --prefill-qkv-epilogue (heads of 64: the qkv GEMM's fused epilogue)
        "llama-bf16": "llama",          # all bf16 (--quant bf16): qkv / gate_up norm in their GEMV's prologue (default)
        "llama-bf16-np": "llama",       # ... with --no-norm-prologue-bf16: the norm a launch before them
        "llama-bf16-cutlass": "llama",  # ... with --prefill-gemm cutlass (CUTLASS's GEMM in the 512-row prefill phase)
        "llama-cutlass": "llama"}       # NVFP4 with --prefill-gemm cutlass (qkv, o, down on CUTLASS's scaled kernel)
# llama-i8: the output head INT8 with a scale a row (--head-format int8); qwen3-i8: the tied qwen3's head as an INT8 copy
# of its table (--head-format int8 on a tied model)
# llama-mixed: calibrated, the byte budget keeps some tensors in bf16; qwen3-wide: every decode batch (1..64) on
# Hopper's NVFP4 decode GEMM (--gemv-max-rows 0; its layers' K are multiples of 256)
GEMV_MAX_ROWS = {"qwen3-wide": 0, "qwen3-wide-i8": 0, "syn-qwen3-8b-2l": 8, "syn-qwen3-8b-2l-rolled": 8,
                 "syn-qwen3-8b-2l-pair": 8, "syn-llama-8b-2l": 8, "syn-llama-8b-2l-rolled": 8,
                 "syn-llama-8b-2l-pair": 8, "syn-qwen3-8b-2l-ready": 8}
# syn-qwen3-8b-2l: the 8B shape's streamed GEMVs at every row count they serve, 1-8 (8 rows: the default where hidden
# < 4096, e.g. Qwen3-1.7B's; the 8B's own default is 4, its 8 rows on the GEMM, tested on qwen3-wide)
# qwen3-wide-i8: qwen3-wide untied, its head INT8: with --gemv-max-rows 0 the head on the INT8 GEMM at every batch too
# qwen3-pen: the tiny qwen3 with --gpu-penalties (the sampler's penalties on the device, the compile default);
# the others without, so their host-penalty paths stay tested (and the synthetic ones fit VRAM_GIB)
# llama: Hopper prefill expands each NVFP4 weight before its GEMM (--prefill-weights dequant); the others keep
# the fp16 copies expanded at load (the default for models this small)
VRAM_GIB = 4
SYNTHETIC = {"syn-qwen3-0.6b": "examples/qwen3-0.6b.json", "syn-gemma3-hd256": "examples/gemma3-hd256.json",
             # the Qwen3-8B shape's layers (2 of them): its decode GEMVs' kernels (gemv_ring3_* for qkv)
             "syn-qwen3-8b-2l": "tests/data/qwen3-8b-2layers.json",
             # ... with --no-gemv-ring-unroll (one-row gate_up on the rolled gemv_ringx_gated_*)
             "syn-qwen3-8b-2l-rolled": "tests/data/qwen3-8b-2layers.json",
             # ... with --gemv-pair (one row's down and the next qkv in one launch)
             "syn-qwen3-8b-2l-pair": "tests/data/qwen3-8b-2layers.json",
             # ... with --attn-head-ready (one row's attention waits for its kv head's count, not the qkv launch)
             "syn-qwen3-8b-2l-ready": "tests/data/qwen3-8b-2layers.json",
             # the Llama-3.1-8B shape's layers: down's K 14,336 (7 stages a warp, gemv_ringxr_* and the pair's first
             # GEMV), no q/k norm in the rope tail, Llama-3 RoPE scaling; as the Qwen3-8B shape's three
             "syn-llama-8b-2l": "tests/data/llama-8b-2layers.json",
             "syn-llama-8b-2l-rolled": "tests/data/llama-8b-2layers.json",
             "syn-llama-8b-2l-pair": "tests/data/llama-8b-2layers.json"}
TARGET = os.environ.get("IMP_GPU_TARGET", "sm_90a")


def build(names: list[str]) -> None:
    from impc.compile import CompileOptions, compile_model
    from impc.launches import ProgramOptions
    from impc.synthetic import compile_synthetic

    for name in names:
        out = OUT / name
        if name in TINY:
            from conftest import make_checkpoint
            with tempfile.TemporaryDirectory() as tmp:
                ck = make_checkpoint(TINY[name], Path(tmp) / name)
                compile_model(CompileOptions(model=str(ck), out=out, quant="bf16" if "-bf16" in name else "nvfp4",
                                             targets=TARGET, max_batch=64,
                                             vram_gib=VRAM_GIB, calibrate=name.endswith("-mixed"),
                                             quant_embed=name.endswith("-qe"),
                                             quant_head=name.endswith("-qe"),
                                             head_format="int8" if name.endswith("-i8")
                                             else "nvfp4" if name.endswith("-qe") else "bf16",
                                             prefill_weights="dequant" if name == "llama" else "auto",
                                             program=ProgramOptions(
                                                 gemv_max_rows=GEMV_MAX_ROWS.get(name),
                                                 gpu_penalties=name.endswith("-pen"),
                                                 rope_in_attention=name.endswith("-rope"),
                                                 prefill_qkv_epilogue=name.endswith("-qkvepi"),
                                                 norm_prologue_bf16=not name.endswith("-np"),
                                                 prefill_gemm="cutlass" if name.endswith("-cutlass") else "auto")))
        elif name in SYNTHETIC:
            compile_synthetic(ROOT / SYNTHETIC[name], CompileOptions(model="", out=out, targets=TARGET, max_context=8192,
                                                                     max_batch=64, vram_gib=VRAM_GIB,
                                                                     program=ProgramOptions(
                                                                         gemv_max_rows=GEMV_MAX_ROWS.get(name),
                                                                         gemv_ring_unroll=not name.endswith("-rolled"),
                                                                         gemv_pair=name.endswith("-pair"),
                                                                         attn_head_ready=name.endswith("-ready"),
                                                                         gpu_penalties=False)), seed=1)
        else:
            raise ValueError(f"unknown GPU test bundle {name}")
        print(f"built {out}", file=sys.stderr)


if __name__ == "__main__":
    build(sys.argv[1:] or [*TINY, *SYNTHETIC])
