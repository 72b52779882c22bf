"""Whole-model cost of an INT8 output head (--head-format int8) on real weights: SmolLM2-135M written
as an untied HF folder (scripts/head_quality.py's "smollm2-untied"), compiled cpu-only (targets none,
max_context 2048, calibrated NVFP4 body, default budget 1.3) with the head bf16 / int8 / nvfp4, plus
the --quant bf16 reference; each compared with the reference by impc eval's teacher-forced KL.

  python scripts/head_int8_whole.py [--work build/head-quality] [--tokens 4096] [--chunk 512]

Bundle folders follow head_quality.py's names where they coincide (smollm2-untied-bf16 = reference,
-0 = head bf16 budget 1.3, -1 = head NVFP4 budget 1.3) so either script reuses the other's; the int8
one is smollm2-untied-int8. A present bundle is reused only if its manifest's options match.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from head_quality import (CachedModel, HeadSwapped, checkpoint_of, equal_step_budget, head_name,  # noqa: E402
                          head_of, step_bytes)
from impc.cli_eval import BundleModel, compare, default_text  # noqa: E402
from impc.compile import CompileOptions, compile_model  # noqa: E402
from impc.plan import tensor_bytes, weights_bytes  # noqa: E402
from imp_runtime.bundle import load_bundle  # noqa: E402
from imp_runtime.tokenizer import Tokenizer  # noqa: E402

MODEL = "smollm2-untied"
# label, folder suffix, quant, head_format, budget (None: default 1.3; "a": (a)'s stored = step bytes, absolute)
VARIANTS = (("bf16 (reference)", "bf16", "bf16", "bf16", None),
            ("(a) NVFP4 body, head bf16", "0", "nvfp4", "bf16", None),
            ("(b) NVFP4 body, head int8", "int8", "nvfp4", "int8", None),
            ("(c) NVFP4 body, head nvfp4", "1", "nvfp4", "nvfp4", None),
            # controls: the default budget is 1.3 x bytes with the head at its fixed format, so (b) gets a
            # smaller body budget than (a); these spend (a)'s bytes (head_quality.py's "-4" is the nvfp4 one)
            ("(b=) head int8, step bytes of (a)", "int8-bytes-a", "nvfp4", "int8", "a"),
            ("(c=) head nvfp4, step bytes of (a)", "4", "nvfp4", "nvfp4", "a"))
SWAP = "(b/a) (a)'s body, (b)'s int8 head swapped in"


def options(source: str, out: Path, quant: str, head: str, budget: str = "1.3") -> CompileOptions:
    return CompileOptions(model=source, out=out, quant=quant, targets="none", max_context=2048, budget=budget,
                          head_format=head)


def matches(manifest: dict, o: CompileOptions) -> list[str]:
    """Options of a present bundle that differ from o (head_format absent: an older build, bf16/nvfp4 by quant_head)."""
    got = manifest["build"]["options"]
    want = {"quant": o.quant, "quant_embed": o.quant_embed, "quant_head": o.quant_head,
            "head_format": o.head_format, "scale_search": o.scale_search, "calibrate": o.calibrate,
            "calib": o.calib, "budget": o.budget, "targets": [], "max_context": o.max_context,
            "max_batch": o.max_batch}
    if "head_format" not in got:
        got = {**got, "head_format": "nvfp4" if got.get("quant_head") else "bf16"}
    return [f"{k}: {got.get(k)!r} != {v!r}" for k, v in want.items() if got.get(k) != v]


def compiled(o: CompileOptions, log) -> tuple[Path, float | None]:
    out = Path(o.out)
    if (out / "manifest.json").is_file():
        diff = matches(json.loads((out / "manifest.json").read_text()), o)
        if diff:
            raise SystemExit(f"{out} was built with other options ({'; '.join(diff)}): move it away")
        log(f"  reusing {out}")
        return out, None
    t0 = time.perf_counter()
    compile_model(o)
    dt = time.perf_counter() - t0
    log(f"  compiled {out.name}: {dt:.0f} s")
    return out, dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "head-quality")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    log = lambda s: print(s, file=sys.stderr, flush=True)      # noqa: E731
    T0 = time.perf_counter()
    a.work.mkdir(parents=True, exist_ok=True)
    source, tied = checkpoint_of(MODEL, a.work)
    assert not tied
    log(f"checkpoint {source}: {time.perf_counter() - T0:.0f} s")

    paths, ctimes = {}, {}
    for label, suffix, quant, head, budget in VARIANTS:
        budget = equal_step_budget(load_bundle(paths[VARIANTS[1][0]])) if budget == "a" else "1.3"
        paths[label], ctimes[label] = compiled(options(source, a.work / f"{MODEL}-{suffix}", quant, head, budget),
                                               log)
    t_compile = time.perf_counter() - T0

    ref_bundle = load_bundle(paths[VARIANTS[0][0]])
    tok = Tokenizer(ref_bundle.tokenizer_json(), ref_bundle.manifest["tokenizer"])
    ids = (([tok.bos_id] if tok.add_bos and tok.bos_id is not None else []) + tok.encode(default_text()))[:a.tokens]
    ref = BundleModel(ref_bundle)
    cached_ref = CachedModel(ref)

    rows = []
    models = {}
    for label in [v[0] for v in VARIANTS] + [SWAP]:
        t0 = time.perf_counter()
        if label == SWAP:      # (a)'s exact body with (b)'s stored head: the head's cost on the same body
            b = load_bundle(paths[VARIANTS[2][0]])
            cand = HeadSwapped(models[VARIANTS[1][0]], head_of(models[VARIANTS[2][0]]))
        else:
            b = load_bundle(paths[label])
            cand = ref if label == VARIANTS[0][0] else BundleModel(b)
        if label in (VARIANTS[1][0], VARIANTS[2][0]):
            models[label] = cand
        r = compare(cached_ref if cand is ref else cand, cached_ref, ids, a.chunk)
        fmt = b.tensors[head_name(b)]["format"]
        alone = compare(HeadSwapped(ref, head_of(cand)), cached_ref, ids, a.chunk) if fmt != "bf16" else None
        head_rel_rms = b.manifest["quantization"]["tensors"].get(head_name(b), {}).get("rel_rms")
        if label == SWAP:
            b = load_bundle(paths[VARIANTS[1][0]])       # bytes: (a)'s formats, the head int8
            fm = {n: i["format"] for n, i in b.tensors.items()} | {"lm_head": "int8"}
            head = tensor_bytes(tuple(b.tensors["lm_head"]["shape"]), "int8")
            stored = weights_bytes(b.spec, fm)
            step = stored - tensor_bytes(tuple(b.tensors["embed"]["shape"]), fm["embed"])
        else:
            step, head = step_bytes(b)
            stored = weights_bytes(b.spec, {n: i["format"] for n, i in b.tensors.items()})
        q = b.manifest["quantization"]
        cal = q.get("calibration") or {}
        rows.append({"bundle": label, "path": str(paths.get(label)), "head_format": fmt, "kl": r.kl, "top1": r.top1,
                     "ppl": r.ppl, "ref_ppl": r.ref_ppl, "positions": r.positions,
                     "head_alone_kl": alone and alone.kl, "head_alone_top1": alone and alone.top1,
                     "head_alone_ppl": alone and alone.ppl,
                     "head_bytes": head, "step_bytes": step, "stored_bytes": stored,
                     "head_rel_rms": head_rel_rms,
                     "widened": (cal.get("budget") or {}).get("widened"),
                     "budget": (cal.get("budget") or {}).get("request"), "compile_s": ctimes.get(label)})
        log(f"  {label}: kl {r.kl:.5f} top1 {r.top1:.4f} ppl {r.ppl:.3f} (ref {r.ref_ppl:.3f})"
            + (f"; head alone kl {alone.kl:.5f} top1 {alone.top1:.4f}" if alone else "")
            + f"  [{time.perf_counter() - t0:.0f} s]")
    t_total = time.perf_counter() - T0

    print(f"{MODEL}, {rows[0]['positions']} positions of Python's reference docs, chunks of {a.chunk}\n")
    print("| bundle | head stored | KL (nats) | top-1 | ppl | head alone: KL | top-1 | head MB | step MB | head/step | stored MB | head/stored |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        al = (f"{r['head_alone_kl']:.5f} | {100 * r['head_alone_top1']:.2f}%" if r["head_alone_kl"] is not None
              else "0 | 100%")
        print(f"| {r['bundle']} | {r['head_format']} | {r['kl']:.5f} | {100 * r['top1']:.2f}% | {r['ppl']:.3f} | {al} | "
              f"{r['head_bytes'] / 1e6:.2f} | {r['step_bytes'] / 1e6:.2f} | {100 * r['head_bytes'] / r['step_bytes']:.1f}% | "
              f"{r['stored_bytes'] / 1e6:.2f} | {100 * r['head_bytes'] / r['stored_bytes']:.1f}% |")
    print()
    for r in rows:
        print(f"{r['bundle']}: head rel_rms {r['head_rel_rms']}, budget {r['budget']}, "
              f"{len(r['widened'] or [])} body tensors widened to bf16, "
              f"compile {r['compile_s'] and round(r['compile_s'])} s")
    print(f"\nruntime: checkpoint+compiles {t_compile:.0f} s, total {t_total:.0f} s")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
