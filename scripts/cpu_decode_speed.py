"""Decode speed of the cpu executor next to transformers (torch, float32) on the same machine, same
prompt, greedy, batch 1. Median of several runs of each.

  python scripts/cpu_decode_speed.py build/smollm2 [--gguf PATH] [--tokens 64] [--runs 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

from imp_runtime.engine import Engine
from imp_runtime.sampler import SamplingParams

PROMPT = [{"role": "user", "content": "Why is the sky blue?"}]


def imp_rate(engine: Engine, ids: list[int], n: int) -> float:
    stamps = []
    for _ in engine.generate(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)):
        stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])        # decode only: after the first token


def hf_rate(model, ids: list[int], n: int) -> float:
    import torch
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        past, tok = out.past_key_values, out.logits[0, -1].argmax()
        t0 = time.perf_counter()
        for _ in range(n - 1):
            out = model(tok.view(1, 1), past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[0, -1].argmax()
        return (n - 1) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--gguf", default=None, help="checkpoint for transformers (default: the smollm2 GGUF)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    engine = Engine(a.bundle, device="cpu")
    ids = engine.encode_chat(PROMPT)
    imp = [imp_rate(engine, ids, a.tokens) for _ in range(a.runs)]
    import torch
    from transformers import AutoModelForCausalLM

    from impc.models import resolve_model_name
    gguf = resolve_model_name(a.gguf or "smollm2")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    hf = [hf_rate(model, ids, a.tokens) for _ in range(a.runs)]
    print(f"threads {torch.get_num_threads()}  prompt {len(ids)} tokens, {a.tokens} decoded, median of {a.runs}")
    print(f"imp cpu executor   {statistics.median(imp):7.1f} tok/s  (runs {', '.join(f'{x:.1f}' for x in imp)})")
    print(f"transformers fp32  {statistics.median(hf):7.1f} tok/s  (runs {', '.join(f'{x:.1f}' for x in hf)})")


if __name__ == "__main__":
    main()
