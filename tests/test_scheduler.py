"""The scheduler on the cpu executor (a tiny llama): batched decode equals one sequence at a time,
preempted requests finish with the tokens of an unpreempted run, chunked prefill equals a whole one and
interleaves with decoding, cancellation frees pages at once, a request that can never fit is refused.
Oracles: the executor run one sequence at a time (its prefill of one token is the old decode path) and
each request served alone on an engine whose pool is large enough never to preempt."""
from __future__ import annotations

import numpy as np
import pytest

from imp_runtime.bundle import load_bundle
from imp_runtime.engine import Engine, RequestError
from imp_runtime.executor import StepRow
from imp_runtime.executor_cpu import CpuExecutor
from imp_runtime.kv_blocks import SoloSequence
from imp_runtime.sampler import SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
SEEDED_12 = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=12, ignore_eos=True)
SAMPLED_PENALISED = SamplingParams(max_tokens=40, temperature=0.7, repetition_penalty=1.3, seed=3, ignore_eos=True)
PENALISED = SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)   # host-sampled


@pytest.fixture(scope="module")
def bundle(bundles):
    return bundles("llama_tied", "bf16")


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 384, length + 3 * i).tolist() for i in range(n)]


def solo_tokens(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    return [ev.token_id for ev in engine.generate(prompt, params)]


def test_batched_decode_equals_one_sequence_at_a_time(bundle):
    ex = CpuExecutor(load_bundle(bundle))
    ps = prompts(5, 20, seed=3)
    seqs = [SoloSequence(ex) for _ in ps]
    blocks = seqs[0].blocks
    for s in seqs[1:]:                           # one block manager for all, so pages are disjoint
        s.blocks = blocks
    nxt = [int(np.argmax(s.prefill(p))) for s, p in zip(seqs, ps)]
    for _ in range(6):
        for s in seqs:
            s._cover(s.length + 1)
        # the old path: each sequence alone, one token through prefill (writes the same KV slot)
        alone = np.stack([ex.prefill(s.sid, [t], s.length) for s, t in zip(seqs, nxt)])
        batch = ex.decode([StepRow(s.sid, t, s.length, None, want_logits=True) for s, t in zip(seqs, nxt)])
        together = np.stack([batch.logits[i] for i in range(len(seqs))])
        np.testing.assert_allclose(together, alone, rtol=0, atol=1e-4 * np.abs(alone).max())
        assert batch.tokens == [int(np.argmax(r)) for r in alone]
        for s in seqs:
            s.length += 1
        nxt = batch.tokens


@pytest.mark.parametrize("third", [SEEDED_12, SAMPLED_PENALISED], ids=["device-sampled", "host-sampled"])
def test_preempted_requests_finish_with_the_tokens_of_an_unpreempted_run(bundle, third):
    roomy = Engine(bundle, device="cpu")
    cases = list(zip(prompts(4, 30, seed=5), [GREEDY, SEEDED, third, PENALISED]))
    alone = [solo_tokens(roomy, p, params) for p, params in cases]
    # 4 requests of ~75 tokens (5 pages each) in a pool of 11 usable pages: three are admitted, and the
    # newest of them (the third) is preempted mid-generation when the others' pages run out
    tight = Engine(bundle, device="cpu", kv_pages=12)
    reqs = [tight.submit(p, params) for p, params in cases]
    together = [[ev.token_id for ev in evs] for evs in _run_all(tight, reqs)]
    assert reqs[2].preemptions >= 1
    assert together == alone
    assert tight.blocks.in_use() == 0 and not tight.executor._seqs


def _run_all(engine: Engine, reqs) -> list[list]:
    events = {id(r): [] for r in reqs}
    while not all(r.done for r in reqs):
        for out in engine.scheduler.step():
            assert out.error is None, out.error
            events[id(out.request)].append(out.event)
    return [events[id(r)] for r in reqs]


def test_chunked_prefill_equals_whole_and_interleaves_with_decoding(bundle):
    whole = Engine(bundle, device="cpu")
    long_prompt, short_prompt = prompts(1, 150, seed=8)[0], prompts(1, 10, seed=9)[0]
    ref_long, ref_short = solo_tokens(whole, long_prompt, GREEDY), solo_tokens(whole, short_prompt, GREEDY)
    eng = Engine(bundle, device="cpu")
    eng.scheduler.config.prefill_chunk = eng.scheduler.config.step_tokens = 32
    short = eng.submit(short_prompt, GREEDY)
    got: dict[int, list[int]] = {id(short): []}
    for _ in range(2):                         # the short one is prefilled and decoding
        got[id(short)] += [out.event.token_id for out in eng.scheduler.step()]
    long = eng.submit(long_prompt, GREEDY)
    got[id(long)] = []
    short_tokens_while_long_prefills = 0
    while not (short.done and long.done):
        prefilling = not long.gen.out
        outs = eng.scheduler.step()
        for out in outs:
            got[id(out.request)].append(out.event.token_id)
        if prefilling:
            short_tokens_while_long_prefills += sum(out.request is short for out in outs)
    assert short_tokens_while_long_prefills >= 4     # 150 tokens in chunks of 31: the short one kept going
    assert got[id(long)] == ref_long
    assert got[id(short)] == ref_short
    assert eng.blocks.in_use() == 0


def test_step_trace_counts_every_decode_row_and_prompt_token(bundle, tmp_path):
    """IMP_STEP_TRACE's lines (scripts/step_trace.py reads them) against what the requests themselves did: every
    token but each prompt's first was a decode row, every prompt token was prefilled once (no shared prefixes)."""
    from imp_runtime.scheduler import StepTrace
    eng = Engine(bundle, device="cpu")
    eng.scheduler.config.prefill_chunk = eng.scheduler.config.step_tokens = 32
    eng.scheduler.trace = StepTrace(str(tmp_path / "trace.txt"))
    ps = prompts(3, 40, seed=4)
    params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    outs = eng.generate_many(ps, params)
    eng.scheduler.trace.file.close()
    lines = [list(map(float, line.split())) for line in (tmp_path / "trace.txt").read_text().splitlines()]
    assert lines and all(len(x) == 6 and x[1] >= x[0] for x in lines)
    assert all(b[0] >= a[1] for a, b in zip(lines, lines[1:]))           # steps in order, not overlapping
    assert sum(x[2] for x in lines) == sum(len(o) - 1 for o in outs) == 3 * 6
    assert sum(x[3] for x in lines) == sum(len(p) for p in ps)
    assert max(x[3] for x in lines) <= 32


def test_a_step_trace_that_cannot_be_written_is_skipped_with_a_warning(tmp_path, caplog):
    from imp_runtime.scheduler import _open_trace
    with caplog.at_level("WARNING", logger="imp.scheduler"):
        assert _open_trace(str(tmp_path / "no-such-dir" / "trace.txt")) is None
    assert "cannot be written" in caplog.text
    assert _open_trace(None) is None and _open_trace(str(tmp_path / "t.txt")) is not None


def test_cancel_frees_pages_at_once(bundle):
    eng = Engine(bundle, device="cpu")
    a, b = eng.submit(prompts(1, 40)[0], GREEDY), eng.submit(prompts(1, 50, seed=1)[0], GREEDY)
    for _ in range(3):
        eng.scheduler.step()
    held = eng.blocks.in_use()
    a_pages = len(a.table.pages)
    assert a_pages >= 3 and held == a_pages + len(b.table.pages)
    eng.scheduler.cancel(a)
    assert eng.blocks.in_use() == held - a_pages and a.done and len(eng.executor._seqs) == 1
    eng.scheduler.cancel(b)
    assert eng.blocks.in_use() == 0 and not eng.executor._seqs and not eng.scheduler.has_work()


def test_a_request_that_can_never_fit_is_refused_clearly(bundle):
    eng = Engine(bundle, device="cpu", kv_pages=6)           # 5 usable pages of 16 tokens: 80 positions
    with pytest.raises(RequestError, match=r"needs 7 KV pages .* holds 5: ask for at most 50 new tokens"):
        eng.submit(list(range(4, 34)), SamplingParams(max_tokens=70))
    assert len(solo_tokens(eng, list(range(4, 34)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))) == 50


def test_step_budget_from_the_server_and_its_cli(bundle):
    """`impc serve --max-step-tokens N` sets the scheduler's step budget (never below a row for every running
    request plus one prompt token); 0 is refused with a one-line error before the bundle is opened."""
    import subprocess
    import sys

    from imp_runtime.server.metrics import Metrics
    from imp_runtime.server.queue import FairQueue
    eng = Engine(bundle, device="cpu")
    q = FairQueue(eng, Metrics(), max_running=8, step_tokens=100)
    try:
        assert eng.scheduler.config.step_tokens == 100 and eng.scheduler.config.max_running == 8
    finally:
        q.close()
    eng = Engine(bundle, device="cpu")
    q = FairQueue(eng, Metrics(), max_running=8, step_tokens=3)
    try:
        assert eng.scheduler.config.step_tokens == 9
    finally:
        q.close()
    proc = subprocess.run([sys.executable, "-m", "impc.cli", "serve", "no-such-bundle", "--max-step-tokens", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--max-step-tokens 0" in proc.stderr and "Traceback" not in proc.stderr
