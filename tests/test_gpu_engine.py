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


def test_gpu_penalties_give_the_host_samplers_tokens():
    """A bundle compiled with --gpu-penalties applies repetition / presence / frequency penalties in the step
    (sample_tokens' penalties and counts, from the state the scheduler writes): greedy requests with penalties, batched
    with one without, get the tokens of the host sampler on the same GPU logits (the same executor told to leave
    penalties to the host: their logits come back and runtime/sampler.py applies them)."""
    from imp_runtime.engine import Engine
    from imp_runtime.sampler import SamplingParams
    eng = Engine(gpu_bundle("qwen3-pen"), device="cuda", verify=False)
    try:
        assert eng.executor.penalties_on_device
        kinds = [dict(repetition_penalty=1.5), dict(presence_penalty=0.7, frequency_penalty=0.9),
                 dict(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.5), {}]
        rng = np.random.default_rng(3)
        prompts = [rng.integers(4, 40, 20 + 5 * i).tolist() for i in range(len(kinds))]

        def serve() -> list[list[int]]:
            reqs = [eng.submit(p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **k))
                    for p, k in zip(prompts, kinds)]
            out = {id(r): [] for r in reqs}
            while not all(r.done for r in reqs):
                for o in eng.scheduler.step():
                    assert o.error is None, o.error
                    out[id(o.request)].append(o.event.token_id)
            return [out[id(r)] for r in reqs]

        on_device = serve()
        eng.executor.penalties_on_device = False      # new requests sample penalties on the host
        on_host = serve()
        assert on_device == on_host
        assert all(len(t) == 24 for t in on_device)
    finally:
        eng.executor.close()


def test_logit_bias_row_beside_device_sampled_rows(engine):
    """A request with a logit bias samples on the host (its logits come back: Generation.host_sampled) in the same
    steps as requests the GPU samples: +100 on a token makes greedy decoding pick it every time, and the other
    requests get the tokens they get alone."""
    from imp_runtime.sampler import SamplingParams
    rng = np.random.default_rng(11)
    prompts = [rng.integers(4, engine.bundle.spec.vocab_size, n).tolist() for n in (9, 23, 14)]
    forced = 7 + int(rng.integers(0, engine.bundle.spec.vocab_size - 8))
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    params = [plain, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logit_bias={forced: 100.0}), plain]
    reqs = [engine.submit(p, q) for p, q in zip(prompts, params)]
    out = {id(r): [] for r in reqs}
    while not all(r.done for r in reqs):
        for o in engine.scheduler.step():
            assert o.error is None, o.error
            out[id(o.request)].append(o.event.token_id)
    got = [out[id(r)] for r in reqs]
    assert got[1] == [forced] * 10
    assert got[0] == tokens(engine.generate(prompts[0], plain)) and got[2] == tokens(engine.generate(prompts[2], plain))
