"""Sampler and generation loop: distributions checked against hand-computed probabilities, stop
strings against searching the unstopped text."""
from __future__ import annotations

import numpy as np
import pytest

from imp_runtime.engine import Engine, RequestError
from imp_runtime.kv_blocks import SoloSequence
from imp_runtime.sampler import Sampler, SamplingParams, candidates

LOGITS = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))


def draw(params: SamplingParams, n: int = 4000, logits=LOGITS, allowed=None) -> np.ndarray:
    s = Sampler(params, [])
    counts = np.zeros(len(logits))
    for _ in range(n):
        s.out_counts.clear()
        tok, _ = s.sample(logits, allowed)
        counts[tok] += 1
    return counts / n


def test_greedy_is_argmax():
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = rng.standard_normal(50).astype(np.float32)
        assert Sampler(SamplingParams(temperature=0.0), []).sample(x)[0] == int(np.argmax(x))


def test_temperature_one_follows_softmax():
    np.testing.assert_allclose(draw(SamplingParams(temperature=1.0, seed=1)), [0.5, 0.3, 0.15, 0.05], atol=0.03)


def test_temperature_two_flattens():
    p = np.array([0.5, 0.3, 0.15, 0.05]) ** 0.5
    np.testing.assert_allclose(draw(SamplingParams(temperature=2.0, seed=2)), p / p.sum(), atol=0.03)


def test_top_k():
    np.testing.assert_allclose(draw(SamplingParams(top_k=2, seed=3)), [0.5 / 0.8, 0.3 / 0.8, 0, 0], atol=0.03)


def test_top_p_keeps_smallest_prefix_reaching_p():
    # 0.5 < 0.7 <= 0.8: tokens 0 and 1
    np.testing.assert_allclose(draw(SamplingParams(top_p=0.7, seed=4)), [0.5 / 0.8, 0.3 / 0.8, 0, 0], atol=0.03)


def test_min_p():
    # keep p >= 0.5 * 0.5 = 0.25: tokens 0 and 1
    np.testing.assert_allclose(draw(SamplingParams(min_p=0.5, seed=5)), [0.5 / 0.8, 0.3 / 0.8, 0, 0], atol=0.03)


def kept_by_full_sort(logits: np.ndarray, p: SamplingParams) -> dict[int, float]:
    """The oracle for `candidates`: every token sorted (stable), then top-k, top-p, min-p as the sampler's
    docstring orders them, probabilities normalised over what is kept."""
    z = logits.astype(np.float64) / p.temperature
    order = np.argsort(-z, kind="stable")
    if p.top_k > 0:
        order = order[:p.top_k]
    probs = np.exp(z[order] - z[order[0]])
    probs /= probs.sum()
    keep = len(order)
    if p.top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
    if p.min_p > 0.0:
        keep = min(keep, max(1, int(np.sum(probs >= p.min_p * probs[0]))))
    return dict(zip(order[:keep].tolist(), (probs[:keep] / probs[:keep].sum()).tolist()))


@pytest.mark.parametrize("scale", [8.0, 0.05])     # peaked: the kept set is among the leading candidates; flat: not
@pytest.mark.parametrize("params", [
    dict(temperature=0.8), dict(top_k=40), dict(top_k=3000), dict(top_p=0.9), dict(top_p=0.999, top_k=2000),
    dict(min_p=0.05), dict(min_p=1e-6), dict(top_p=0.5, min_p=0.2), dict(temperature=1.3, top_k=50, top_p=0.95),
])
def test_candidates_match_a_full_sort(scale, params):
    """The partial sort over a 151,936-token row keeps the tokens and probabilities a sort of the whole row
    keeps, also when the kept set reaches past the candidates (a flat row: the full-sort fallback); the whole
    row is scaled and exponentiated in float32, hence the 1e-5."""
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal(151936) * scale).astype(np.float32)
    p = SamplingParams(**params)
    tokens, probs = candidates(logits, p)
    got = dict(zip(tokens.tolist(), probs.tolist()))
    want = kept_by_full_sort(logits, p)
    assert got.keys() == want.keys()
    np.testing.assert_allclose([got[t] for t in want], list(want.values()), rtol=1e-5, atol=1e-12)


def test_mask_excludes_tokens():
    allowed = np.array([False, True, True, False])
    f = draw(SamplingParams(seed=6), allowed=allowed)
    assert f[0] == 0 and f[3] == 0
    np.testing.assert_allclose(f[1:3], [0.3 / 0.45, 0.15 / 0.45], atol=0.03)


def test_seed_reproducible():
    x = np.random.default_rng(7).standard_normal(100).astype(np.float32)
    seqs = []
    for _ in range(2):
        s = Sampler(SamplingParams(seed=42), [])
        seqs.append([s.sample(x)[0] for _ in range(20)])
    assert seqs[0] == seqs[1]


def test_penalties_by_hand():
    logits = np.array([2.0, -1.0, 0.5, 3.0], dtype=np.float32)
    s = Sampler(SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25), [0, 1])
    s.out_counts = {3: 2, 1: 1}
    got = s.penalise(logits)
    # repetition over prompt {0,1} and output {1,3}: 2/2, -1*2, 3/2 ; then presence+frequency on outputs
    expected = [1.0, -2.0 - 0.5 - 0.25, 0.5, 1.5 - 0.5 - 0.5]
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_logit_bias_by_hand_after_the_penalties():
    logits = np.array([2.0, -1.0, 0.5, 3.0], dtype=np.float32)
    s = Sampler(SamplingParams(temperature=0.0, presence_penalty=0.5, logit_bias={3: -100.0, 2: 2.5}), [])
    s.out_counts = {3: 1}
    np.testing.assert_allclose(s.penalise(logits), [2.0, -1.0, 3.0, 3.0 - 0.5 - 100.0], rtol=1e-6)
    assert s.sample(logits)[0] == 2                      # 3 was the argmax before the bias
    greedy = Sampler(SamplingParams(temperature=0.0, logit_bias={1: 10.0}), [])
    assert greedy.sample(logits)[0] == 1


# ------------------------------------------------------------------ the generation loop


@pytest.fixture(scope="module")
def engine(bundles):
    return Engine(bundles("llama_tied", "bf16"), device="cpu")


def test_stop_string_cuts_where_the_text_first_contains_it(engine):
    ids = engine.tokenizer.encode("w10 w20 w30 w40")
    full = "".join(e.text for e in engine.generate(ids, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)))
    assert len(full) > 20
    stop = full[len(full) // 2: len(full) // 2 + 4]
    events = list(engine.generate(ids, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop])))
    assert "".join(e.text for e in events) == full[:full.find(stop)]
    assert events[-1].finish_reason == "stop"


def test_length_limit_and_context(engine):
    ids = engine.tokenizer.encode("w10 w20")
    events = list(engine.generate(ids, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)))
    assert len(events) == 5 and events[-1].finish_reason == "length"
    with pytest.raises(RequestError, match="context"):
        list(engine.generate([5] * engine.max_context, SamplingParams(max_tokens=1)))
    with pytest.raises(RequestError, match="max_tokens"):
        list(engine.generate(ids, SamplingParams(max_tokens=0)))


def test_closing_the_stream_frees_the_sequence(engine):
    ids = engine.tokenizer.encode("w10 w20")
    gen = engine.generate(ids, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    next(gen)
    next(gen)
    assert len(engine.executor._seqs) == 1
    gen.close()
    assert len(engine.executor._seqs) == 0


def test_logprobs_are_log_softmax(engine):
    ids = engine.tokenizer.encode("w10 w20 w30")
    ev = next(iter(engine.generate(ids, SamplingParams(max_tokens=1, temperature=0.0, logprobs=3))))
    seq = SoloSequence(engine.executor, engine.blocks)
    logits = seq.prefill(ids).astype(np.float64)
    seq.close()
    ref = logits - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()
    assert ev.logprob == pytest.approx(ref[ev.token_id], abs=1e-5)
    assert [t for t, _ in ev.top_logprobs] == list(np.argsort(-ref)[:3])
