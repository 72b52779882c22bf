"""Stage 3 with calibration: GPTQ on calibration activations, then the byte budget's bf16 choice.

Order: (1) every NVFP4 linear is quantized sequentially by GPTQ (calibrate.py); (2) each one's effect
on the model's output is measured on its own against the bf16 reference (budget.py); (3) the most
harmful per byte go back to bf16 while the weights fit the budget. The result feeds the plain loop of
compile.quantize_stage, which stores each tensor in its chosen format.
"""
from __future__ import annotations

import ctypes
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from impc.budget import (BackgroundMeasurements, GroupCollector, SensitivityMeter, candidates, choose_formats,
                          parse_budget, sensitivity_chunks)
from impc.calibrate import CHUNK_TOKENS, calibrate, calibration_set
from impc.errors import CompileError
from impc.gptq import DAMP
from impc.plan import GiB, weights_bytes
from impc.progress import Progress
from impc.quantize import NVFP4Tensor, bf16_values, quantize_nvfp4
from imp_runtime.spec import ModelSpec


@dataclass
class CalibratedQuant:
    weights: dict[str, np.ndarray]          # the checkpoint's float32 tensors, in bundle order
    formats: dict[str, str]                 # after the budget's choice
    tensors: dict[str, NVFP4Tensor]         # every tensor still NVFP4: GPTQ's result, the embedding's rounding
    output_error: dict[str, dict]           # per tensor, merged into its manifest entry
    record: dict                            # the manifest's quantization.calibration


def quantize_calibrated(spec: ModelSpec, tensors: Iterable[tuple[str, np.ndarray]], formats: dict[str, str],
                        opts, checkpoint, p: Progress, head_copy: bool = False) -> CalibratedQuant:
    """One BLAS thread throughout: a matrix product's rounding depends on how the library splits it
    between threads, and every rounding decision here depends on those products, so the bundle's bytes
    would depend on the machine's core count. (On a busy machine one thread is also the faster.)"""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"), heap_reuse():
        return _quantize_calibrated(spec, tensors, formats, opts, checkpoint, p, head_copy)


# glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_DEFAULT_TRIM_THRESHOLD = 128 * 1024


def one_malloc_arena() -> None:
    """Every thread of the process allocates from glibc's main arena (call before starting threads). A thread
    otherwise gets an arena of its own, whose heaps hold at most 64 MiB, so each larger array of the
    sensitivity thread (the [512, 49152] logits of every measured layer) came from fresh mmapped pages,
    zeroed by the kernel, whatever heap_reuse() asks; from the main arena it reuses the heap like the GPTQ
    thread. Allocation only: the values and bytes are the same. Elsewhere than glibc, nothing changes.
    For the rest of the process: glibc fixes its arena limit when a thread first needs an arena, so it cannot be
    undone afterwards (a process that compiles, then serves, allocates from one arena; `impc compile` is its own
    process)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_ARENA_MAX, 1)
    except (OSError, AttributeError):
        pass


@contextmanager
def heap_reuse(mmap_threshold: int = 256 << 20, trim_threshold: int = 1 << 30):
    """glibc's malloc serves each array above its mmap threshold (at most 32 MiB) with fresh pages from
    the kernel and returns them on free, so every large temporary of the calibration forward and the
    budget's passes ([5632, 3072] float32 products, [512, 49152] logits) was page-faulted and zeroed
    again: ~550k page faults and ~10 s of system time in a SmolLM2 compile. With a higher mmap
    threshold and a trim threshold to match, freed blocks are reused from the heap (~200k faults, 5 s
    less system and ~10 s less user time); afterwards the trim threshold is restored and the heap
    trimmed (the mmap threshold stays raised: glibc has no call that restores its dynamic default).
    Allocation only: the values and bytes are the same. Elsewhere than glibc, nothing changes."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        yield
        return
    mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
    mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    try:
        yield
    finally:
        mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
        trim(0)


def _quantize_calibrated(spec: ModelSpec, tensors: Iterable[tuple[str, np.ndarray]], formats: dict[str, str],
                         opts, checkpoint, p: Progress, head_copy: bool = False) -> CalibratedQuant:
    budget = parse_budget(opts.budget)
    shapes = spec.tensor_shapes()
    weights: dict[str, np.ndarray] = {}
    for name, w in tensors:
        if tuple(w.shape) != shapes.get(name):
            raise CompileError(f"tensor {name} has shape {tuple(w.shape)}, the config implies {shapes.get(name)}")
        weights[name] = np.ascontiguousarray(w, dtype=np.float32)
    base_bytes = weights_bytes(spec, formats)
    if budget.bytes_for(base_bytes) < base_bytes:
        raise CompileError(f"--budget {budget}: less than the all-NVFP4 weights ({base_bytes / GiB:.3f} GiB)")
    tok_info = {**checkpoint.special_tokens, "eos_token_ids": checkpoint.eos_token_ids, "add_bos": checkpoint.add_bos}
    calib = calibration_set(checkpoint.tokenizer_json, tok_info, checkpoint.chat_template, opts.calib)
    p.info(f"calibration: {calib.n_tokens} tokens ({calib.chunks.shape[0]} chunks of {calib.chunks.shape[1]}) "
           f"from {calib.source}")

    # What the served model computes with, except the linears still to be quantized.
    stored, rounded = {}, {}
    for name, w in weights.items():
        fmt = formats[name]
        if fmt == "bf16":
            stored[name] = bf16_values(w)
        elif fmt == "nvfp4" and name == "embed":      # a lookup table, not a linear: rounded to nearest
            rounded[name] = quantize_nvfp4(w, opts.scale_search)
            stored[name] = rounded[name].dequantize()
        elif fmt == "int8":
            # an INT8 head is rounded with the bf16 tensors (impc/compile.py), neither GPTQ'd nor a budget candidate;
            # calibration never reads it, the budget's reference model reads it as bf16, as it does the others
            stored[name] = bf16_values(w)
        else:
            stored[name] = w
    # The budget's sensitivity of a tensor needs only that tensor's GPTQ result, so a layer's tensors are
    # measured on a second thread (as one batch) while GPTQ (sequential by nature) goes on with the next
    # layers; once GPTQ is done, two threads measure. Each value is computed the same way on either thread.
    cands = candidates(formats)
    sensitivity: dict[str, float] = {}

    def reference_meter() -> SensitivityMeter:
        """The bf16 model (as `--quant bf16` stores it) on a few hundred calibration tokens."""
        reference = {name: (bf16_values(w) if name in cands else stored[name]) for name, w in weights.items()}
        if formats["embed"] == "nvfp4":
            reference["embed"] = bf16_values(weights["embed"])
        return SensitivityMeter(spec, reference, sensitivity_chunks(calib.chunks))

    with ExitStack() as stack:
        bg = collector = None
        if budget.bytes_for(base_bytes) > base_bytes and cands:
            bg = stack.enter_context(BackgroundMeasurements(reference_meter))
            collector = GroupCollector(bg, cands)      # a layer's tensors are measured together
        t0 = time.perf_counter()
        cal = calibrate(spec, stored, formats, calib, p,
                        (lambda name, values: collector.add(name, values) if name in cands else None) if bg else None)
        p.info(f"GPTQ: {time.perf_counter() - t0:.1f} s, {np.mean(cal.layer_seconds):.2f} s per layer; relative "
               f"output error on the calibration data: mean {_mean(cal.output_error):.4f}")
        if bg:
            t0 = time.perf_counter()
            sensitivity = bg.results(cands, p)
            p.info(f"sensitivity of {len(cands)} tensors (measured alongside GPTQ): {time.perf_counter() - t0:.1f} s "
                   "more after it")
    choice = choose_formats(spec, formats, budget, sensitivity, head_copy)
    p.info(f"budget {budget}: {len(choice.widened)} of {len(cands)} tensors kept in bf16, weights "
           f"{choice.weights_bytes / GiB:.3f} GiB of {choice.budget_bytes / GiB:.3f} "
           f"(all-NVFP4 {choice.base_bytes / GiB:.3f})")

    errors = {name: {"out_err": round(cal.output_error[name], 6)} for name in cal.tensors}
    for name, kl in sensitivity.items():
        errors[name]["kl_alone"] = round(kl, 6)
    record = {"method": "gptq", "damp": DAMP, "source": calib.source, "sha256": calib.sha256,
              "tokens": calib.n_tokens, "chunk_tokens": min(CHUNK_TOKENS, calib.chunks.shape[1]),
              "budget": {"request": str(budget), "base_bytes": choice.base_bytes, "budget_bytes": choice.budget_bytes,
                         "weights_bytes": choice.weights_bytes, "widened": choice.widened}}
    kept = {**rounded, **{name: q for name, q in cal.tensors.items() if choice.formats[name] == "nvfp4"}}
    return CalibratedQuant(weights, choice.formats, kept, errors, record)


def _mean(d: dict[str, float]) -> float:
    return float(np.mean(list(d.values()))) if d else 0.0
