"""The engine's continuous batching on the cuda executor: generations decoded together in one
`decode_batch` give exactly the tokens each gives alone (the oracle: the same request served by itself)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.gpu_common import gpu_bundle, have_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not have_gpu(), reason="needs an NVIDIA GPU")]


def greedy_solo(engine, prompt, n):
    from imp_runtime.sampler import SamplingParams
    return [ev.token_id for ev in engine.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))]


def greedy_together(engine, prompts, n):
    from imp_runtime.sampler import SamplingParams
    gens = [engine.start(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for p in prompts]
    out = [[] for _ in prompts]
    try:
        for _ in range(n):
            for g, o in zip(gens, out):
                if not g.finished:
                    o.append(g.next_event().token_id)
            engine.decode_batch(gens)
    finally:
        for g in gens:
            g.close()
    return out


def test_decode_batch_on_cuda_matches_solo():
    from imp_runtime.engine import Engine
    path = gpu_bundle("qwen3")
    cuda = Engine(path, device="cuda", verify=False)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(4, cuda.bundle.spec.vocab_size, int(n)).tolist() for n in (5, 17, 40)]
    try:
        together = greedy_together(cuda, prompts, 12)
        assert together == [greedy_solo(cuda, p, 12) for p in prompts]
        assert cuda.executor.name == "cuda"
    finally:
        cuda.executor.close()
