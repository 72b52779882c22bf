"""Quality of an NVFP4 bundle against the bf16 bundle of the same checkpoint, on the cpu executor:
mean KL(bf16 || nvfp4) of the next-token distributions and top-1 agreement over ~2,000 tokens of
English text (Python's own reference documentation, present in every Python install).

  python scripts/nvfp4_quality.py build/smollm2-bf16 build/smollm2 [--tokens 2000] [--chunk 512]
"""
from __future__ import annotations

import argparse

import numpy as np

from imp_runtime.bundle import load_bundle
from imp_runtime.executor_cpu import CpuExecutor
from imp_runtime.sampler import log_softmax
from imp_runtime.tokenizer import Tokenizer


def english_text() -> str:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in ("assignment", "class", "exceptions", "execmodel", "function", "if", "for"))


def all_logits(ex: CpuExecutor, ids: list[int]) -> np.ndarray:
    sid = ex.new_sequence()
    try:
        return ex.prefill(sid, ids, all_logits=True)
    finally:
        ex.free(sid)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reference", help="bf16 bundle")
    ap.add_argument("candidate", help="NVFP4 bundle of the same checkpoint")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--chunk", type=int, default=512)
    a = ap.parse_args()
    ref_b, cand_b = load_bundle(a.reference), load_bundle(a.candidate)
    tok = Tokenizer(ref_b.tokenizer_json(), ref_b.manifest["tokenizer"])
    ids = tok.encode(english_text())[:a.tokens]
    ref_ex, cand_ex = CpuExecutor(ref_b), CpuExecutor(cand_b)
    kls, agree = [], []
    for i in range(0, len(ids), a.chunk):
        chunk = ids[i:i + a.chunk]
        lr, lc = all_logits(ref_ex, chunk), all_logits(cand_ex, chunk)
        for r, c in zip(lr, lc):
            pr, pc = log_softmax(r), log_softmax(c)
            kls.append(float(np.sum(np.exp(pr) * (pr - pc))))
            agree.append(int(np.argmax(r) == np.argmax(c)))
    print(f"tokens {len(kls)}  mean KL(ref || candidate) {np.mean(kls):.4f} nats  "
          f"top-1 agreement {100 * np.mean(agree):.1f}%")


if __name__ == "__main__":
    main()
