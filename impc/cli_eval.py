"""`impc eval BUNDLE --ref REF_BUNDLE`: how far a bundle's predictions are from a reference bundle's.

Both bundles read the same text, teacher-forced in chunks, on their exact stored values with the cpu
executor's kernel references (impc/forward.py); at every position with
a next token: KL(reference || bundle) of the next-token distributions, whether their top-1 tokens
agree, and each one's log-likelihood of the actual next token (perplexity). The default text is
Python's own reference documentation (present in every Python install, and unrelated to the
calibration data in impc/data/); `--text FILE` reads another. The last line is machine-readable:
  kl=<nats> top1=<fraction> ppl=<x> ref_ppl=<y>
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from impc.forward import embed, layer_forward, layer_weights, log_probs


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="compare a bundle's next-token predictions with a reference bundle's",
                       description=__doc__, formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    p.add_argument("bundle", type=Path, help="the bundle to judge (e.g. NVFP4)")
    p.add_argument("--ref", type=Path, required=True, help="the reference bundle of the same model (e.g. --quant bf16)")
    p.add_argument("--text", type=Path, default=None, help="UTF-8 text file to read (default: Python's reference docs)")
    p.add_argument("--tokens", type=int, default=2000, help="tokens of the text to read (default 2000)")
    p.add_argument("--chunk", type=int, default=512, help="tokens per teacher-forced chunk (default 512)")
    p.set_defaults(handler=cmd_eval)


def default_text() -> str:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in ("assignment", "class", "exceptions", "execmodel", "function", "if", "for"))


@dataclass
class EvalResult:
    positions: int
    kl: float              # mean KL(reference || bundle), nats
    top1: float            # fraction of positions whose argmax agrees
    ppl: float             # the bundle's perplexity of the text
    ref_ppl: float         # the reference's

    def line(self) -> str:
        return f"kl={self.kl:.4f} top1={self.top1:.4f} ppl={self.ppl:.3f} ref_ppl={self.ref_ppl:.3f}"


class BundleModel:
    """A bundle's exact stored values run by impc/forward.py (the cpu executor's kernel references,
    batched over chunks; tests/test_calibrate.py checks it against the cpu executor)."""

    def __init__(self, bundle):
        self.spec, self.w = bundle.spec, bundle.float_weights()

    def log_probs(self, chunk: np.ndarray) -> np.ndarray:
        """Token ids [C, T] -> log-probabilities [C, T, V] of the next token at every position."""
        x = embed(self.spec, self.w["embed"], chunk)
        for i in range(self.spec.n_layers):
            x = layer_forward(self.spec, i, layer_weights(self.w, i), x)
        return log_probs(self.spec, self.w, x).reshape(chunk.shape + (-1,))


def compare(model: BundleModel, ref: BundleModel, ids: list[int], chunk: int) -> EvalResult:
    kls, agree, nll, ref_nll = [], [], [], []
    for i in range(0, len(ids), chunk):
        part = np.asarray(ids[i:i + chunk], dtype=np.int64)
        if len(part) < 2:
            continue
        lp, rp = model.log_probs(part[None])[0, :-1], ref.log_probs(part[None])[0, :-1]
        nxt, rows = part[1:], np.arange(len(part) - 1)
        kls.append(np.sum(np.exp(rp) * (rp - lp), axis=-1))
        agree.append(np.argmax(lp, axis=-1) == np.argmax(rp, axis=-1))
        nll.append(-lp[rows, nxt])
        ref_nll.append(-rp[rows, nxt])
    cat = np.concatenate
    return EvalResult(int(sum(len(k) for k in kls)), float(np.mean(cat(kls))), float(np.mean(cat(agree))),
                      float(np.exp(np.mean(cat(nll)))), float(np.exp(np.mean(cat(ref_nll)))))


def cmd_eval(a) -> int:
    from imp_runtime.bundle import BundleError, load_bundle
    from imp_runtime.tokenizer import Tokenizer

    if a.tokens < 2 or a.chunk < 2:
        raise BundleError("--tokens and --chunk must be at least 2")
    cand, ref = load_bundle(a.bundle), load_bundle(a.ref)
    if cand.spec.vocab_size != ref.spec.vocab_size or cand.tokenizer_json() != ref.tokenizer_json():
        raise BundleError(f"{a.bundle} and {a.ref} do not share a tokenizer: compare bundles of the same model")
    if a.text is not None:
        try:
            text = a.text.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise BundleError(f"--text {a.text}: cannot read it as UTF-8 text ({e.__class__.__name__})") from None
    else:
        text = default_text()
    tok = Tokenizer(ref.tokenizer_json(), ref.manifest["tokenizer"])
    ids = ([tok.bos_id] if tok.add_bos and tok.bos_id is not None else []) + tok.encode(text)
    ids = ids[:a.tokens]
    if len(ids) < 2:
        raise BundleError(f"the text holds {len(ids)} tokens: nothing to predict")
    chunk = min(a.chunk, cand.manifest["plan"]["max_context"], ref.manifest["plan"]["max_context"])
    r = compare(BundleModel(cand), BundleModel(ref), ids, chunk)
    print(f"{r.positions} positions of {a.text or 'Python reference docs'}, chunks of {chunk} tokens: "
          f"mean KL {r.kl:.4f} nats, top-1 agreement {100 * r.top1:.1f}%, perplexity {r.ppl:.3f} "
          f"(reference {r.ref_ppl:.3f})", file=sys.stderr)
    print(r.line())
    return 0
