"""The prefix cache on the cpu executor (a tiny llama): a request whose prompt starts with cached pages
gets the same logits and tokens as a cold run (the oracle: the cpu executor on the same prompt with
nothing cached), across requests and across the turns of a chat, and after its pages were evicted."""
from __future__ import annotations

import numpy as np
import pytest

from imp_runtime.bundle import load_bundle
from imp_runtime.engine import Engine
from imp_runtime.executor_cpu import CpuExecutor
from imp_runtime.kv_blocks import BlockManager, BlockTable, SoloSequence
from imp_runtime.sampler import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LOGPROBS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def bundle(bundles):
    return bundles("llama_tied", "bf16")


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(4, 384, n).tolist()


def test_logits_on_shared_pages_equal_a_cold_prefill(bundle):
    system, question = tokens(70, 1), tokens(9, 2)
    ex = CpuExecutor(load_bundle(bundle))
    blocks = BlockManager(ex.num_pages, ex.page_size)
    first = SoloSequence(ex, blocks)
    first.prefill(system + tokens(5, 3))
    blocks.commit(first.table, system, 70)           # 4 full pages of the system prompt
    first.close()

    table = BlockTable()
    hit = blocks.acquire_prefix(table, system + question, len(system + question) - 1)
    assert hit == 64
    sid = ex.new_sequence()
    blocks.grow(table, len(system + question))
    ex.set_pages(sid, table.pages)
    warm = ex.prefill(sid, (system + question)[hit:], hit, all_logits=True)

    cold = SoloSequence(CpuExecutor(load_bundle(bundle))).prefill(system + question, all_logits=True)[hit:]
    np.testing.assert_allclose(warm, cold, rtol=0, atol=1e-5 * np.abs(cold).max())


def test_requests_sharing_a_system_prompt_get_cold_tokens_and_logprobs(bundle):
    system = tokens(100, 4)
    questions = [tokens(7, 5), tokens(12, 6)]
    cold = [list(Engine(bundle, device="cpu").generate(system + q, LOGPROBS)) for q in questions]
    warm_engine = Engine(bundle, device="cpu")
    warm = [list(warm_engine.generate(system + q, LOGPROBS)) for q in questions]
    assert warm[0][0].cached_tokens == 0
    assert warm[1][0].cached_tokens == 96                    # the system prompt's 6 whole pages of 16
    for w, c in zip(warm, cold):
        assert [e.token_id for e in w] == [e.token_id for e in c]
        np.testing.assert_allclose([e.logprob for e in w], [e.logprob for e in c], atol=1e-5)
        np.testing.assert_allclose([lp for e in w for _, lp in e.top_logprobs],
                                   [lp for e in c for _, lp in e.top_logprobs], atol=1e-5)
    assert warm_engine.scheduler.prefix_hit_tokens == 96
    assert warm_engine.blocks.in_use() == 0


def test_a_chat_turn_reuses_the_previous_turn_including_its_answer(bundle):
    engine = Engine(bundle, device="cpu")
    turn1 = tokens(40, 7)
    answer = [e.token_id for e in engine.generate(turn1, GREEDY)]
    turn2 = turn1 + answer + tokens(6, 8)
    events = list(engine.generate(turn2, GREEDY))
    # KV was written for the prompt and every answer token but the last: its whole pages are cached
    assert events[0].cached_tokens == (len(turn1) + len(answer) - 1) // 16 * 16 == 48
    assert [e.token_id for e in events] == [e.token_id for e in Engine(bundle, device="cpu").generate(turn2, GREEDY)]


def test_evicted_pages_are_recomputed(bundle):
    engine = Engine(bundle, device="cpu", kv_pages=9)         # 8 usable pages of 16
    prompt = tokens(60, 9)
    first = [e.token_id for e in engine.generate(prompt, GREEDY)]
    engine.generate_many([tokens(100, 10)], GREEDY)           # needs 8 pages: evicts every cached one
    again = list(engine.generate(prompt, GREEDY))
    assert again[0].cached_tokens == 0
    assert [e.token_id for e in again] == first
