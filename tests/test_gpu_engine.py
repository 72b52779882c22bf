"""The engine's scheduler on the cuda executor: requests decoded together (continuous batching, one
executor batch a step, sampled on the GPU) give exactly the tokens each gives alone (the oracle: the same
request served by itself), with greedy and with seeded sampling; and a prefix-cache hit gives the tokens
of a cold run."""
from __future__ import annotations

import numpy as np
import pytest

try:
    from tests.gpu_common import gpu_bundle, have_gpu
except ImportError:
    from gpu_common import gpu_bundle, have_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not have_gpu(), reason="needs an NVIDIA GPU")]


@pytest.fixture(scope="module")
def engine():
    from imp_runtime.engine import Engine
    eng = Engine(gpu_bundle("qwen3"), device="cuda", verify=False)
    assert eng.executor.name == "cuda"
    yield eng
    eng.executor.close()


def tokens(events) -> list[int]:
    return [ev.token_id for ev in events]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_batched_generation_matches_solo(engine, temperature):
    from imp_runtime.sampler import SamplingParams
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=5, ignore_eos=True)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(4, engine.bundle.spec.vocab_size, int(n)).tolist() for n in (5, 17, 40, 3)]
    together = [tokens(evs) for evs in engine.generate_many(prompts, params)]
    alone = [tokens(engine.generate(p, params)) for p in prompts]
    assert together == alone
    assert all(len(t) == 12 for t in together)


def test_prefix_cache_hit_matches_cold(engine):
    from imp_runtime.sampler import SamplingParams
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(8)
    prefix = rng.integers(4, engine.bundle.spec.vocab_size, 70).tolist()
    prompt = prefix + rng.integers(4, engine.bundle.spec.vocab_size, 9).tolist()
    cold = tokens(engine.generate(prompt, params))          # fills the cache with the prefix's full pages
    warm = tokens(engine.generate(prompt, params))
    assert warm == cold
