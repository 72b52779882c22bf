"""What an 8-bit output head costs in quality against a bf16 one: the evidence for (or against) storing
the head (the [vocab, hidden] matrix that produces the logits) in FP8 or INT8 by default.

The model's `--quant bf16` bundle (compiled cpu-only under --work, reused when present) reads real
text teacher-forced in chunks, as `impc eval` does (impc/cli_eval.py: Python's reference docs, the
cpu executor's kernel references on the exact stored values). Its final hidden states (after the
final norm, just before the head) are kept, and the logits they give are computed with the bf16 head
(the reference) and with the same head stored as:

  - FP8 E4M3, one float32 scale per row (amax / 448), values rounded to nearest-even E4M3, saturating;
  - FP8 E4M3, one float32 scale per 32 columns;
  - INT8 symmetric, one float32 scale per row (amax / 127), round half to even;
  - INT8, one float32 scale per 32 columns (as GGUF's Q8_0, whose scale is f16);
  - NVFP4 as impc/quantize.py rounds it (16-element E4M3 block scales, a float32 tensor scale: what
    `impc compile --quant-embed` stores for a tied head).

The body is bf16 in every row, so the figures are what the head's format alone costs. For each
format: mean KL(bf16 || candidate) in nats, top-1 agreement, perplexity of the text, the head's bytes
as stored (codes and scales), its weight error ||W - Q|| / ||W||, and the largest |logit error| seen.
The E4M3 rounding is checked first against hand-computed values, the repo's table-driven rounding,
torch's float8_e4m3fn and (when importable) ml_dtypes.float8_e4m3fn.

Models: SmolLM2-135M as shipped (tied: its head is the embedding table [49152, 576], Q8_0 in the GGUF,
so INT8 with 32-column scales nearly re-finds the source's own grid), and a tiny random Qwen3 (untied,
built as scripts/head_quality.py builds it: random weights, a smoke check of the path, not evidence).
By default the candidates are quantized from the bf16 head; `--from-checkpoint` quantizes the
checkpoint's float32 head instead (what `impc compile` would round).

  python scripts/head_8bit_quality.py [--work build/head8] [--tokens 4096] [--models smollm2,qwen3-tiny]
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from impc.cli_eval import BundleModel, default_text
from impc.compile import CompileOptions, compile_model
from impc.forward import embed, final_hidden, layer_forward, layer_weights, log_softmax_rows
from impc.plan import tensor_bytes
from impc.quantize import measure_error, quantize_int8_rows, quantize_nvfp4
from imp_runtime.bundle import load_bundle
from imp_runtime.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from head_quality import head_of, qwen3_tiny  # noqa: E402

MODELS = ("smollm2", "qwen3-tiny")
E4M3_MAX = 448.0
INT8_MAX = 127.0


# ------------------------------------------------------------------ E4M3


def e4m3(x: np.ndarray) -> np.ndarray:
    """Values -> the nearest E4M3 (1 sign, 4 exponent bits of bias 7, 3 mantissa bits, subnormals, no
    inf: max 448) as float64, ties to even, saturating at +-448. The spacing of the values around |x| is
    2^(e - 3) for |x| in [2^e, 2^(e+1)), e >= -6, and 2^-9 below 2^-6 (the subnormals); |x| divided by a
    power of two is exact, so np.rint (half to even) is the E4M3 rounding."""
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    _, ex = np.frexp(a)                                      # a = m * 2^ex, m in [0.5, 1): e = ex - 1
    quantum = np.ldexp(1.0, np.maximum(ex - 1, -6) - 3)
    r = np.minimum(np.rint(a / quantum) * quantum, E4M3_MAX)
    return np.copysign(r, x)


def check_e4m3() -> list[str]:
    """Hand-computed values, then every E4M3 value, midpoint and its neighbours against independent
    roundings. Returns which oracles agreed."""
    two = lambda e: 2.0 ** e  # noqa: E731
    cases = {0.3: 0.3125, -0.3: -0.3125, 448.0: 448.0, 500.0: 448.0, -1e6: -448.0, 464.0: 448.0,
             two(-9): two(-9), 1.5 * 0.0009765625: two(-9), two(-10): 0.0, 3 * two(-10): 2 * two(-9),
             7 * two(-9): 7 * two(-9), two(-6): two(-6), 1.0625: 1.0, 1.1875: 1.25, 0.0: 0.0,
             240.0: 240.0, 232.0: 224.0, 1e-9: 0.0, 0.013671875 + two(-10): two(-6)}
    for x, want in cases.items():
        got = float(e4m3(np.array(x)))
        assert got == want, f"E4M3({x!r}) = {got!r}, expected {want!r}"
    # the 127 non-negative finite values, their midpoints, and one float32 either side of each
    rng = np.random.default_rng(0)
    from imp_runtime.nvfp4 import E4M3_VALUES
    pos = np.asarray(E4M3_VALUES[:127], dtype=np.float32)
    mids = ((pos[1:].astype(np.float64) + pos[:-1]) / 2).astype(np.float32)
    pts = np.concatenate([pos, mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf),
                          np.exp2(rng.uniform(-12, np.log2(448), 200_000)).astype(np.float32)])
    pts = np.concatenate([pts, -pts])
    mine = e4m3(pts)
    assert set(np.abs(mine).tolist()) <= set(pos.tolist()), "E4M3 rounding left the E4M3 grid"
    agreed = []
    from impc.quantize import round_e4m3           # the repo's table search (non-negative, <= 448)
    assert np.array_equal(np.abs(mine), np.asarray(E4M3_VALUES, np.float64)[round_e4m3(np.abs(pts).astype(np.float64))])
    agreed.append("impc.quantize.round_e4m3")
    try:
        import torch
        t = torch.from_numpy(pts).to(torch.float8_e4m3fn).float().numpy()   # in range: no saturation asked of it
        assert np.array_equal(mine, t), f"{int(np.sum(mine != t))} values differ from torch.float8_e4m3fn"
        agreed.append("torch.float8_e4m3fn")
    except ImportError:
        pass
    try:
        import ml_dtypes
        m = pts.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        assert np.array_equal(mine, m), f"{int(np.sum(mine != m))} values differ from ml_dtypes.float8_e4m3fn"
        agreed.append("ml_dtypes.float8_e4m3fn")
    except ImportError:
        pass
    return agreed


# ------------------------------------------------------------------ head formats


def scaled(w: np.ndarray, block: int | None, qmax: float, rnd: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, int]:
    """W [N, K] with one float32 scale amax / qmax per row (block None) or per `block` columns, each
    value rnd(w / scale) (exact quotient) -> (the de-quantized W as a kernel would form it: code times
    scale in float32, the bytes stored: one byte a value, four a scale)."""
    n, k = w.shape
    b = block or k
    assert k % b == 0, f"{k} columns do not split into blocks of {b}"
    blocks = np.asarray(w, dtype=np.float64).reshape(n, k // b, b)
    scale = (np.max(np.abs(blocks), axis=2, keepdims=True) / qmax).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1)).astype(np.float64)
    codes = rnd(blocks / safe).astype(np.float32)
    deq = (codes * scale).reshape(n, k)                        # float32 product
    return deq, n * k + 4 * n * (k // b)


def int8(x: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(x), -INT8_MAX, INT8_MAX)


def nvfp4(w: np.ndarray) -> tuple[np.ndarray, int]:
    return quantize_nvfp4(w).dequantize().astype(np.float32), tensor_bytes(w.shape, "nvfp4")


FORMATS: dict[str, Callable[[np.ndarray], tuple[np.ndarray, int]]] = {
    "FP8 E4M3, scale/row": lambda w: scaled(w, None, E4M3_MAX, e4m3),
    "FP8 E4M3, scale/32": lambda w: scaled(w, 32, E4M3_MAX, e4m3),
    # what a bundle stores (impc/quantize.py), the same rounding as scaled(w, None, INT8_MAX, int8)
    "INT8, scale/row": lambda w: (quantize_int8_rows(w).dequantize(), tensor_bytes(w.shape, "int8")),
    "INT8, scale/32": lambda w: scaled(w, 32, INT8_MAX, int8),
    "NVFP4 (impc/quantize.py)": nvfp4,
}


# ------------------------------------------------------------------ measurement


@dataclass
class Row:
    fmt: str
    head_bytes: int
    rel_rms: float
    kl: float
    top1: float
    ppl: float
    max_logit_err: float


def hidden_states(model: BundleModel, ids: list[int], chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """The normed hidden states the head reads at every position with a next token in its chunk (as
    impc.cli_eval.compare reads chunks) [N, D], and those next tokens [N]. The first chunk's
    log-probabilities are checked against BundleModel.log_probs (the same forward, head included)."""
    hs, nxt = [], []
    for i in range(0, len(ids), chunk):
        part = np.asarray(ids[i:i + chunk], dtype=np.int64)
        if len(part) < 2:
            continue
        x = embed(model.spec, model.w["embed"], part[None])
        for j in range(model.spec.n_layers):
            x = layer_forward(model.spec, j, layer_weights(model.w, j), x)
        h = final_hidden(model.spec, model.w, x).reshape(-1, x.shape[-1])
        if i == 0:
            assert not model.spec.final_softcap, "a soft-capped head: not measured here"
            want = model.log_probs(part[None])[0]
            assert np.array_equal(log_softmax_rows(h @ head_of(model).T), want), "hidden states differ from impc eval's"
        hs.append(h[:-1])
        nxt.append(part[1:])
    return np.concatenate(hs).astype(np.float32), np.concatenate(nxt)


def measure_heads(h: np.ndarray, nxt: np.ndarray, ref: np.ndarray, heads: dict[str, np.ndarray],
                  rows: int = 512) -> dict[str, tuple[float, float, float, float]]:
    """For each candidate head: (mean KL(ref || cand) nats, top-1 agreement, perplexity, max |logit
    error|) over the hidden states h, `rows` positions at a time; and the reference's own perplexity
    under the key None."""
    acc = {k: [0.0, 0, 0.0, 0.0] for k in [None, *heads]}
    for s in range(0, len(h), rows):
        x, t = h[s:s + rows], nxt[s:s + rows]
        r = np.arange(len(x))
        ref_logits = x @ ref.T
        rp = log_softmax_rows(ref_logits)
        top = np.argmax(rp, axis=-1)
        acc[None][2] += float(-np.sum(rp[r, t]))
        prob = np.exp(rp)
        for name, w in heads.items():
            logits = x @ w.T
            lp = log_softmax_rows(logits)
            a = acc[name]
            a[0] += float(np.sum(prob * (rp - lp)))
            a[1] += int(np.sum(np.argmax(lp, axis=-1) == top))
            a[2] += float(-np.sum(lp[r, t]))
            a[3] = max(a[3], float(np.max(np.abs(logits - ref_logits))))
    n = len(h)
    return {k: (a[0] / n, a[1] / n, float(np.exp(a[2] / n)), a[3]) for k, a in acc.items()}


def source_of(model: str, work: Path) -> str:
    if model == "smollm2":
        return "smollm2"
    if model == "qwen3-tiny":
        return str(qwen3_tiny(work / "ckpt-qwen3-tiny"))
    raise SystemExit(f"unknown model {model}: choose from {', '.join(MODELS)}")


def measure(model: str, work: Path, tokens: int, chunk: int, from_checkpoint: bool, log) -> tuple[str, list[Row]]:
    t0 = time.perf_counter()
    source = source_of(model, work)
    out = work / ("bf16" if model == "smollm2" else f"{model}-bf16")
    if not (out / "manifest.json").is_file():
        compile_model(CompileOptions(model=source, out=out, quant="bf16", targets="none"))
        log(f"  compiled {out}: {time.perf_counter() - t0:.0f} s")
    bundle = load_bundle(out)
    tok = Tokenizer(bundle.tokenizer_json(), bundle.manifest["tokenizer"])
    ids = (([tok.bos_id] if tok.add_bos and tok.bos_id is not None else []) + tok.encode(default_text()))[:tokens]
    ref_model = BundleModel(bundle)
    chunk = min(chunk, bundle.manifest["plan"]["max_context"])
    t1 = time.perf_counter()
    h, nxt = hidden_states(ref_model, ids, chunk)
    log(f"  {model}: {len(h)} positions ({len(ids)} tokens, chunks of {chunk}), forward {time.perf_counter() - t1:.0f} s")
    ref = head_of(ref_model)
    if from_checkpoint:
        from impc.checkpoint import load_checkpoint
        ck = load_checkpoint(source)
        src = ck.read("model.embed_tokens.weight" if ref_model.spec.tie_embeddings else "lm_head.weight")
        src = np.asarray(src, dtype=np.float32)
        assert src.shape == ref.shape
    else:
        src = ref
    heads, info = {}, {}
    for name, fn in FORMATS.items():
        t2 = time.perf_counter()
        heads[name], nbytes = fn(src)
        info[name] = (nbytes, measure_error(ref, heads[name]).rel_rms)
        log(f"  {model}: {name} quantized in {time.perf_counter() - t2:.1f} s")
    t3 = time.perf_counter()
    res = measure_heads(h, nxt, ref, heads)
    log(f"  {model}: logits of {len(heads)} heads {time.perf_counter() - t3:.0f} s; total {time.perf_counter() - t0:.0f} s")
    rows = [Row("bf16 (reference)", tensor_bytes(ref.shape, "bf16"), 0.0, 0.0, 1.0, res[None][2], 0.0)]
    rows += [Row(name, info[name][0], info[name][1], *res[name]) for name in heads]
    head_src = "the checkpoint's float32 head" if from_checkpoint else "the bf16 head"
    title = (f"{model}: head {ref.shape[0]} x {ref.shape[1]}{' (tied: the embedding table)' if ref_model.spec.tie_embeddings else ''}, "
             f"{len(h)} positions of Python's reference docs, body bf16, candidates quantized from {head_src}")
    return title, rows


def table(title: str, rows: list[Row], n_values: int) -> str:
    out = [title, "",
           "| head format | bytes (MB) | bits/weight | ||W-Q||/||W|| | KL(bf16 || fmt) nats | top-1 agree | ppl | max |logit err| |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r.fmt} | {r.head_bytes / 1e6:.2f} | {8 * r.head_bytes / n_values:.3f} | {r.rel_rms:.5f} | "
                   f"{r.kl:.6f} | {100 * r.top1:.2f}% | {r.ppl:.4f} | {r.max_logit_err:.4f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "head8", help="bundles and checkpoints (reused when present)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of text read (default 4096)")
    ap.add_argument("--chunk", type=int, default=512, help="tokens per teacher-forced chunk (default 512)")
    ap.add_argument("--from-checkpoint", action="store_true",
                    help="quantize the checkpoint's float32 head instead of the bf16 bundle's head")
    a = ap.parse_args()
    log = lambda s: print(s, file=sys.stderr, flush=True)      # noqa: E731
    t0 = time.perf_counter()
    agreed = check_e4m3()
    print(f"E4M3 rounding: hand-computed values pass; agrees with {', '.join(agreed)} on every E4M3 value, "
          "midpoint and neighbour, and 200k log-uniform values (and their negatives)")
    for model in a.models.split(","):
        title, rows = measure(model.strip(), a.work, a.tokens, a.chunk, a.from_checkpoint, log)
        n_values = rows[0].head_bytes // 2
        print()
        print(table(title, rows, n_values))
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
