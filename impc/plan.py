"""Stage 4: plan GPU memory for each target: weights, the paged KV cache, scratch, graph buckets.

Everything the cuda executor allocates is decided here, at compile time, so serving allocates
nothing. A model that cannot hold one full-context sequence on a target is refused with the
forecast and what to change, before anything is written.
"""
from __future__ import annotations

import math

from impc.errors import CompileError
from imp_runtime.nvfp4 import BLOCK, padded_k
from imp_runtime.spec import ModelSpec

GiB = 1 << 30
KV_BYTES = 2                 # the KV cache is fp16
RESERVE_BYTES = 3 * GiB // 2   # outside the arena: CUDA context, the cubin, graphs, the runtime's host copies
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def tensor_bytes(shape: tuple[int, ...], fmt: str) -> int:
    if fmt == "nvfp4":
        n, k = shape
        kp = padded_k(k)
        return n * kp // 2 + n * kp // BLOCK + 4
    if fmt == "int8":                  # int8 codes and a float32 scale a row (runtime/int8.py)
        n, k = shape
        return n * k + 4 * n
    return math.prod(shape) * (2 if fmt == "bf16" else 4)


def weights_bytes(spec: ModelSpec, formats: dict[str, str]) -> int:
    return sum(tensor_bytes(shape, formats[name]) for name, shape in spec.tensor_shapes().items())


def kv_bytes_per_token(spec: ModelSpec) -> int:
    return 2 * spec.n_layers * spec.kv_dim * KV_BYTES


# The smallest prefill chunk a target's default falls back to when its own does not fit (plan_memory)
MIN_DEFAULT_CHUNK = 512


def fmt_gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def plan_memory(spec: ModelSpec, formats: dict[str, str], targets: list[dict], vram_gib: float | None,
                max_context: int | None, max_batch: int, prefill_weights: str = "auto",
                gpu_penalties: bool = True, prefill_chunk: int | None = None, gemv_pair: bool = False) -> dict:
    """The device arena of each target: weights, scratch and step buffers (impc/arena_layout.py lays them out),
    and every remaining byte of the target's memory, less a reserve, as KV pages. prefill_chunk: the most prompt
    tokens one prefill call takes (None: the target's; at most the context either way). gpu_penalties, gemv_pair:
    the program options that add buffers."""
    from impc.arena_layout import fixed_arena_bytes, penalty_tables, prefill_weights_mode, rows_for
    if max_batch < 1:
        raise CompileError("--max-batch must be at least 1")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise CompileError(f"--prefill-chunk must be at least 1 (got {prefill_chunk})")
    ctx = max_context or min(spec.max_position, 32768)
    if ctx < 1:
        raise CompileError("--max-context must be at least 1")
    if ctx > spec.max_position:
        raise CompileError(f"--max-context {ctx} exceeds the model's {spec.max_position} positions")
    w_bytes = weights_bytes(spec, formats)
    kv_tok = kv_bytes_per_token(spec)
    plan = {"max_context": ctx, "max_batch": max_batch, "weights_bytes": w_bytes,
            "kv_bytes_per_token": kv_tok, "max_sequences": max(2 * max_batch, 16) + 1,   # slot 0: padding
            "graph_buckets": [b for b in GRAPH_BUCKETS if b <= max_batch] or [1],
            "targets": {}}
    if plan["graph_buckets"][-1] < max_batch:
        plan["graph_buckets"].append(max_batch)
    if prefill_chunk is not None:       # (also for a bundle without GPU targets: the cpu executor's chunk)
        plan["prefill_chunk"] = min(prefill_chunk, ctx)
    for t in targets:
        vram = int((vram_gib if vram_gib is not None else t["vram_gib"]) * GiB)
        page = t["page_size"]
        max_pages = math.ceil(ctx / page)
        page_bytes = page * kv_tok
        wg_mode = prefill_weights_mode(spec, formats, t, vram, prefill_weights)

        def kv_pages_with(chunk: int) -> tuple[int, int]:
            """(fixed arena bytes, KV pages) of a plan whose prefill calls take up to `chunk` prompt tokens."""
            rows, logit_rows = rows_for(chunk, max_batch)
            fixed = fixed_arena_bytes(spec, formats, rows, logit_rows, plan["max_sequences"], max_pages, wg_mode,
                                      gpu_penalties, gemv_pair)
            budget = vram - RESERVE_BYTES - fixed - 2 * spec.n_layers * 256     # 256: each KV buffer's alignment
            return fixed, max(budget, 0) // page_bytes

        need_pages = max_pages + 1                                           # + the padding page
        chunk = min(prefill_chunk or t["prefill_chunk"], ctx)
        fixed, pages = kv_pages_with(chunk)
        # The target's chunk is a default, not a requirement: where its prefill scratch leaves no room for one
        # max-context sequence, halve it (down to MIN_DEFAULT_CHUNK) before refusing; a chunk the user asked for is kept.
        while prefill_chunk is None and pages < need_pages and chunk > MIN_DEFAULT_CHUNK:
            chunk = max(chunk // 2, MIN_DEFAULT_CHUNK)
            fixed, pages = kv_pages_with(chunk)
        if pages < need_pages:
            need = fixed + RESERVE_BYTES + need_pages * page_bytes
            pen = sum(n for _, _, n in penalty_tables(spec, plan["max_sequences"]).values()) if gpu_penalties else 0
            raise CompileError(
                f"model does not fit {t['name']}: needs {fmt_gib(need)} (weights {fmt_gib(w_bytes)}, "
                f"KV for one {ctx}-token sequence {fmt_gib(need_pages * page_bytes)}, scratch "
                f"{fmt_gib(fixed - w_bytes)} with {chunk}-token prefill chunks, reserve {fmt_gib(RESERVE_BYTES)}), "
                f"target has {fmt_gib(vram)}: try a smaller --max-context or --prefill-chunk, --quant nvfp4, a larger "
                f"--vram, or a smaller model"
                + (f" (or --no-gpu-penalties: its per-sequence token counts take {fmt_gib(pen)})" if pen else ""))
        plan["targets"][t["name"]] = {
            "vram_bytes": vram, "page_size": page, "kv_pages": pages, "kv_bytes": pages * page_bytes,
            "kv_tokens": (pages - 1) * page, "prefill_chunk": chunk, "scratch_bytes": fixed - w_bytes,
            "reserve_bytes": RESERVE_BYTES, "prefill_weights": wg_mode,
        }
    return plan


def describe(plan: dict) -> list[str]:
    lines = [f"weights {fmt_gib(plan['weights_bytes'])}, KV {plan['kv_bytes_per_token'] / 1024:.1f} KiB/token, "
             f"context {plan['max_context']}, batch {plan['max_batch']}"]
    for name, t in plan["targets"].items():
        lines.append(f"{name}: {fmt_gib(t['vram_bytes'])} VRAM -> {t['kv_pages']} KV pages of {t['page_size']} "
                     f"tokens ({t['kv_tokens']} tokens, {fmt_gib(t['kv_bytes'])}), scratch {fmt_gib(t['scratch_bytes'])}")
    return lines
