"""What an NVFP4 output head costs in quality against a bf16 one: the table behind `impc compile`'s
head default (`--quant-head` / `--bf16-head`; for a tied model the head is the embedding table,
`--quant-embed`).

For each model, bundles compiled as `impc compile` makes them (cpu-only, calibrated) are read by
`impc eval`'s comparison (impc/cli_eval.py: teacher-forced, exact stored values) against the model's
`--quant bf16` bundle over real text (Python's reference docs, as `impc eval` reads by default):

  - the whole bundle: mean KL(bf16 || bundle) in nats, top-1 agreement, perplexity;
  - the head alone: the bf16 bundle with only its head replaced by the candidate's stored head, which
    isolates what the head's format costs from what the body's quantization costs.

Models: SmolLM2-135M as shipped (tied: its head is the embedding table, Q8_0 in the GGUF, the body
Q4_1); the same weights written as an untied Hugging Face folder (lm_head a copy of the table), so
the untied path (GPTQ on the head's calibration inputs, the head a byte-budget candidate) runs on real
weights; and a tiny random Qwen3 (untied, SmolLM2's tokenizer, the head's scale set so its logits
spread like SmolLM2's): random weights make its figures a smoke check of the path, not evidence.
Last, the bytes the head adds to a decode step, for each model and for Qwen3-8B's shape.

  python scripts/head_quality.py [--work build/head-quality] [--tokens 4096] [--models smollm2,...]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from impc.cli_eval import BundleModel, compare, default_text
from impc.compile import CompileOptions, compile_model
from impc.plan import tensor_bytes
from imp_runtime.bundle import load_bundle
from imp_runtime.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("smollm2", "smollm2-untied", "qwen3-tiny")


@dataclass(frozen=True)
class Variant:
    label: str
    quant: str = "nvfp4"
    nvfp4_head: bool = False     # tied: --quant-embed; untied: --quant-head
    budget: str = "1.3"
    same_bytes_as: int | None = None     # budget: the step bytes of VARIANTS[i] (a bf16 head), spent by the knapsack

    def options(self, model: str, out: Path, tied: bool, budget: str | None = None) -> CompileOptions:
        return CompileOptions(model=model, out=out, quant=self.quant, targets="none", max_context=2048,
                              budget=budget or self.budget, quant_embed=self.nvfp4_head and tied,
                              quant_head=self.nvfp4_head and not tied,
                              head_format="auto" if tied else "nvfp4" if self.nvfp4_head else "bf16")


REFERENCE = Variant("bf16 (reference)", quant="bf16")
VARIANTS = (Variant("head bf16, budget 1.3", nvfp4_head=False), Variant("head NVFP4, budget 1.3", nvfp4_head=True),
            Variant("head bf16, budget 1", nvfp4_head=False, budget="1"),
            Variant("head NVFP4, budget 1", nvfp4_head=True, budget="1"),
            Variant("head NVFP4, step bytes of row 1", nvfp4_head=True, same_bytes_as=0),
            Variant("head NVFP4, step bytes of row 3", nvfp4_head=True, same_bytes_as=2))


@dataclass
class Row:
    model: str
    variant: str
    head_format: str             # as stored, after the byte budget's choice
    kl: float
    top1: float
    ppl: float
    ref_ppl: float
    head_kl: float | None        # the bf16 bundle with only this bundle's head (None: the head is bf16)
    head_top1: float | None
    step_bytes: int              # weight bytes of a decode step (impc bench's definition)
    head_bytes: int


class CachedModel:
    """A BundleModel whose log-probabilities are computed once per chunk (the reference is compared
    with every variant)."""

    def __init__(self, model: BundleModel):
        self.model, self.cache = model, {}

    def log_probs(self, chunk: np.ndarray) -> np.ndarray:
        key = chunk.tobytes()
        if key not in self.cache:
            self.cache[key] = self.model.log_probs(chunk)
        return self.cache[key]


class HeadSwapped(BundleModel):
    """The reference model with another head (for a tied model the head only: the input embedding
    stays the reference's table)."""

    def __init__(self, ref: BundleModel, head: np.ndarray):
        self.spec, self.w = replace(ref.spec, tie_embeddings=False), {**ref.w, "lm_head": head}


def head_of(model: BundleModel) -> np.ndarray:
    return model.w["embed"] if model.spec.tie_embeddings else model.w["lm_head"]


def head_name(bundle) -> str:
    return "embed" if bundle.spec.tie_embeddings else "lm_head"


def step_bytes(bundle) -> tuple[int, int]:
    """(weight bytes a decode step reads, of which the head's), as impc bench counts them."""
    from impc.cli_bench import decode_weight_bytes
    info = bundle.tensors[head_name(bundle)]
    return decode_weight_bytes(bundle), tensor_bytes(tuple(info["shape"]), info["format"])


# ------------------------------------------------------------------ checkpoints


def write_folder(out: Path, config: dict, tensors: dict[str, np.ndarray], ck) -> Path:
    """A Hugging Face folder (float32 safetensors) with SmolLM2's tokenizer and chat template."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in tensors.items()},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    (out / "tokenizer.json").write_text(ck.tokenizer_json)
    (out / "tokenizer_config.json").write_text(json.dumps(
        {**ck.special_tokens, "chat_template": ck.chat_template, "add_bos_token": ck.add_bos}))
    (out / "generation_config.json").write_text(json.dumps(ck.generation_config))
    return out


def smollm2_untied(out: Path) -> Path:
    """SmolLM2's own tensors, the head a separate copy of the table."""
    from impc.checkpoint import load_checkpoint

    if (out / "config.json").is_file():
        return out
    ck = load_checkpoint("smollm2")
    tensors = {name: ck.read(name) for name in ck.tensor_names}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    return write_folder(out, {**ck.config, "tie_word_embeddings": False}, tensors, ck)


def qwen3_tiny(out: Path, logit_std: float = 2.5, seed: int = 0) -> Path:
    """A random Qwen3 (4 layers, hidden 256, untied) over SmolLM2's vocabulary, built by transformers;
    norms random around 1 (as the tests' checkpoints), the head scaled so logits have std ~logit_std."""
    import torch
    import transformers as tf
    from impc.checkpoint import load_checkpoint

    if (out / "config.json").is_file():
        return out
    ck = load_checkpoint("smollm2")
    cfg = tf.Qwen3Config(vocab_size=ck.config["vocab_size"], hidden_size=256, intermediate_size=768,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         bos_token_id=ck.config["bos_token_id"], eos_token_id=ck.config["eos_token_id"])
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.2 + 1.0)
        model.lm_head.weight.normal_(0.0, logit_std / cfg.hidden_size ** 0.5)
    tensors = {k: v.float().numpy() for k, v in model.state_dict().items()}
    return write_folder(out, {**cfg.to_dict(), "architectures": ["Qwen3ForCausalLM"]}, tensors, ck)


def checkpoint_of(model: str, work: Path) -> tuple[str, bool]:
    """(what impc compile reads, whether the head is tied)."""
    if model == "smollm2":
        return "smollm2", True
    if model == "smollm2-untied":
        return str(smollm2_untied(work / "ckpt-smollm2-untied")), False
    if model == "qwen3-tiny":
        return str(qwen3_tiny(work / "ckpt-qwen3-tiny")), False
    raise SystemExit(f"unknown model {model}: choose from {', '.join(MODELS)}")


def equal_step_budget(bf16_head) -> str:
    """An absolute --budget under which a bundle whose head is NVFP4 reads as many bytes a step as
    bf16_head does: its stored weights (for an untied model the embedding table, which a step does
    not read, stays bf16 in both and counts in both)."""
    from impc.plan import GiB
    stored = sum(tensor_bytes(tuple(i["shape"]), i["format"]) for i in bf16_head.tensors.values())
    return f"{math.ceil(stored / GiB * 1e12) / 1e12:.12f}GiB"     # rounded up: at most bytes over


def compiled(source: str, tied: bool, v: Variant, out: Path, log, budget: str | None = None) -> Path:
    if not (out / "manifest.json").is_file():
        t0 = time.perf_counter()
        compile_model(v.options(source, out, tied, budget))
        log(f"  compiled {out.name}: {time.perf_counter() - t0:.0f} s")
    return out


# ------------------------------------------------------------------ measurement


def measure(model: str, work: Path, tokens: int, chunk: int, text: str, log) -> list[Row]:
    source, tied = checkpoint_of(model, work)
    ref_path = compiled(source, tied, REFERENCE, work / f"{model}-bf16", log)
    ref_bundle = load_bundle(ref_path)
    tok = Tokenizer(ref_bundle.tokenizer_json(), ref_bundle.manifest["tokenizer"])
    ids = (([tok.bos_id] if tok.add_bos and tok.bos_id is not None else []) + tok.encode(text))[:tokens]
    ref = BundleModel(ref_bundle)
    cached_ref = CachedModel(ref)
    rows = []
    ref_bytes = step_bytes(ref_bundle)
    bundles = []
    for i, v in enumerate(VARIANTS):
        budget = equal_step_budget(bundles[v.same_bytes_as]) if v.same_bytes_as is not None else None
        bundle = load_bundle(compiled(source, tied, v, work / f"{model}-{i}", log, budget))
        bundles.append(bundle)
        cand = BundleModel(bundle)
        r = compare(cand, cached_ref, ids, chunk)
        fmt = bundle.tensors[head_name(bundle)]["format"]
        head = compare(HeadSwapped(ref, head_of(cand)), cached_ref, ids, chunk) if fmt != "bf16" else None
        rows.append(Row(model, v.label, fmt, r.kl, r.top1, r.ppl, r.ref_ppl, head and head.kl, head and head.top1,
                        *step_bytes(bundle)))
        log(f"  {model} / {v.label}: kl {r.kl:.4f} top1 {r.top1:.4f}" +
            (f", head alone kl {head.kl:.4f} top1 {head.top1:.4f}" if head else ""))
    log(f"  {model}: {r.positions} positions; bf16 step {ref_bytes[0] / 1e6:.1f} MB of which head {ref_bytes[1] / 1e6:.1f}")
    return rows


def qwen3_8b_head_bytes() -> str:
    """The head's share of Qwen3-8B's decode step: the body all NVFP4 (budget 1), head bf16 or NVFP4."""
    from impc.families import family_for
    cfg = json.loads((ROOT / "examples" / "qwen3-8b.json").read_text())
    spec = family_for(cfg).spec(cfg)
    shapes = spec.tensor_shapes()
    body = sum(tensor_bytes(s, "nvfp4") for n, s in shapes.items() if n.startswith("layers.") and len(s) == 2)
    body += sum(tensor_bytes(s, "f32") for n, s in shapes.items() if len(s) == 1)
    bf, fp4 = tensor_bytes(shapes["lm_head"], "bf16"), tensor_bytes(shapes["lm_head"], "nvfp4")
    return (f"Qwen3-8B decode step (body NVFP4, {body / 1e9:.2f} GB): head bf16 {bf / 1e9:.2f} GB "
            f"({100 * bf / (body + bf):.0f}% of {(body + bf) / 1e9:.2f} GB), head NVFP4 {fp4 / 1e9:.2f} GB "
            f"({100 * fp4 / (body + fp4):.0f}% of {(body + fp4) / 1e9:.2f} GB): the NVFP4 head reads "
            f"{100 * (1 - (body + fp4) / (body + bf)):.0f}% fewer bytes a step")


def table(rows: list[Row]) -> str:
    out = ["| model | bundle | head stored | KL (nats) | top-1 | ppl (bf16) | head alone: KL | top-1 | step MB (head) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        alone = f"{r.head_kl:.4f} | {100 * r.head_top1:.1f}%" if r.head_kl is not None else "0 | 100%"
        out.append(f"| {r.model} | {r.variant} | {r.head_format} | {r.kl:.4f} | {100 * r.top1:.1f}% | "
                   f"{r.ppl:.2f} ({r.ref_ppl:.2f}) | {alone} | {r.step_bytes / 1e6:.1f} ({r.head_bytes / 1e6:.1f}) |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "head-quality",
                    help="checkpoints and bundles (reused when present)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of text read (default 4096)")
    ap.add_argument("--chunk", type=int, default=512, help="tokens per teacher-forced chunk (default 512)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    a = ap.parse_args()
    log = lambda s: print(s, file=sys.stderr, flush=True)      # noqa: E731
    rows = []
    for model in a.models.split(","):
        rows += measure(model.strip(), a.work, a.tokens, a.chunk, default_text(), log)
    if a.json:
        a.json.write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    print(table(rows))
    print()
    print(qwen3_8b_head_bytes())
    return 0


if __name__ == "__main__":
    sys.exit(main())
