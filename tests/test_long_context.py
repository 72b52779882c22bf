"""Contexts past 4k on the cpu executor: a tiny llama with an 8192-position context, a 4,200-token
prompt prefilled in chunks into the paged pool, then decode steps that cross into new pages, against
transformers on the same weights (the oracle). The engine's greedy continuation through the scheduler
matches transformers' too."""
from __future__ import annotations

import numpy as np
import pytest

from imp_runtime.bundle import load_bundle
from imp_runtime.engine import Engine
from imp_runtime.executor_cpu import CpuExecutor
from imp_runtime.kv_blocks import SoloSequence
from imp_runtime.sampler import SamplingParams
from tests.conftest import hf_greedy, write_tokenizer

PROMPT, STEPS = 4200, 12          # 4200 = 262 pages + 8: the decode steps cross into page 264


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    import torch
    import transformers as tf

    from impc.compile import CompileOptions, compile_model

    root = tmp_path_factory.mktemp("long")
    torch.manual_seed(3)
    cfg = tf.LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    model = tf.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(root / "ckpt", safe_serialization=True)
    write_tokenizer(root / "ckpt", cfg.vocab_size)
    compile_model(CompileOptions(model=str(root / "ckpt"), out=root / "bundle", quant="bf16", targets="none",
                                 max_context=8192))
    ref = tf.AutoModelForCausalLM.from_pretrained(root / "ckpt", dtype=torch.float32, attn_implementation="eager")
    return root / "bundle", ref.eval()


def test_prefill_and_decode_past_4k_match_transformers(long_model):
    bundle, model = long_model
    prompt = np.random.default_rng(0).integers(4, 384, PROMPT).tolist()
    ref, steps = hf_greedy(model, prompt, STEPS)
    ref = ref[PROMPT - 64:]                       # the prompt's last 64 positions and every decode step

    ex = CpuExecutor(load_bundle(bundle))
    assert ex.max_context == 8192 and ex.prefill_chunk < PROMPT        # prefilled in several chunks
    seq = SoloSequence(ex)
    got = [seq.prefill(prompt, all_logits=True)[-64:]] + [seq.decode(t) for t in steps]
    got = np.concatenate(got)
    assert float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))) <= 1e-3
    assert len(seq.table.pages) == -(-(PROMPT + STEPS) // ex.page_size) == 264

    engine = Engine(bundle, device="cpu")
    tokens = [ev.token_id for ev in engine.generate(prompt, SamplingParams(max_tokens=STEPS, temperature=0.0,
                                                                           ignore_eos=True))]
    assert tokens == steps
