"""Penalties applied by the executor (bundles compiled with --gpu-penalties): the engine and scheduler hand the
executor each sequence's penalty state (the prompt's tokens, the generated tokens' counts) before its first
step with penalties and again after a preemption (a prompt's first token: from its prefill's logits on the host,
or, in a mixed step, sampled in the step with its penalties, the state written before). The executor here
is a stand-in that applies the penalties as templates/sampler.cu.j2's sample_tokens specifies (numpy, float32)
from the state it was given and counts what it samples; the oracle is the host sampler (runtime/sampler.py) on
the plain cpu executor. Greedy, so both pick the argmax of the same penalised logits: the tokens must match,
alone, batched, pipelined, with steps launched ahead (the prompt's first token then sampled, with its penalties,
in the prefill step), and through preemptions. (The kernels themselves: tests/test_gpu_kernels.py.)"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from imp_runtime.engine import Engine
from imp_runtime.kv_blocks import BlockManager
from imp_runtime.sampler import SamplingParams, choose

REP = SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.5, ignore_eos=True)
FREQ = SamplingParams(max_tokens=24, temperature=0.0, presence_penalty=0.7, frequency_penalty=0.9, ignore_eos=True)
BOTH = SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.2, presence_penalty=0.3,
                      frequency_penalty=0.5, ignore_eos=True)
PLAIN = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


class DevicePenalties:
    """A cpu executor that applies penalties itself, from the state init_penalties gives it."""
    penalties_on_device = True

    def __init__(self, ex):
        self.ex = ex
        self.state: dict[int, tuple[set, Counter]] = {}
        self.inits: list[int] = []

    def __getattr__(self, name):
        return getattr(self.ex, name)

    def init_penalties(self, sid, seen, counts):
        self.state[sid] = (set(seen), Counter(counts))
        self.inits.append(sid)

    def free(self, sid):
        self.state.pop(sid, None)
        self.ex.free(sid)

    def decode_submit(self, rows, chunks=None):
        def penalised(p):
            return p is not None and (p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty)
        pen = [i for i, r in enumerate(rows) if penalised(r.params)]
        # a prompt-ending chunk sampled in the step with penalties (mixed steps): its logits, penalised here
        cpen = [j for j, c in enumerate(chunks or []) if c.sample and penalised(c.params)]
        if cpen:
            chunks = [replace(c, want_logits=True, sample=False) if j in cpen else c for j, c in enumerate(chunks)]
        res = self.ex.decode_submit([replace(r, want_logits=True) if i in pen else r for i, r in enumerate(rows)],
                                    chunks)
        for j in cpen:
            res.chunk_tokens[j] = self._penalised(chunks[j].sid, chunks[j].params, res.chunk_logits[j])
            res.chunk_logits[j] = None
            self.ex._last_sampled[chunks[j].sid] = res.chunk_tokens[j]
        for i in pen:
            r = rows[i]
            res.tokens[i] = self._penalised(r.sid, r.params, res.logits[i])
            self.ex._last_sampled[r.sid] = res.tokens[i]
            if not r.want_logits:
                del res.logits[i]
        return res

    def _penalised(self, sid, p, logits):
        """templates/sampler.cu.j2's penalise_row, then greedy; the token counted as sample_tokens counts it."""
        seen, counts = self.state[sid]            # a KeyError: a row with penalties before init_penalties
        lg = logits.astype(np.float32).copy()
        rep, pres, freq = np.float32(p.repetition_penalty), np.float32(p.presence_penalty), np.float32(p.frequency_penalty)
        for tok in range(lg.shape[0]):
            c = counts.get(tok, 0)
            if c == 0 and tok not in seen:
                continue
            v = lg[tok]
            if rep != 1:
                v = v / rep if v > 0 else v * rep
            if c > 0:
                v = v - (pres + freq * np.float32(c))
            lg[tok] = v
        tok = choose(lg, p, None)
        counts[tok] += 1
        return tok

    def decode_collect(self, handle):
        return self.ex.decode_collect(handle)

    def decode(self, rows):
        return self.decode_collect(self.decode_submit(rows))


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # few distinct tokens, so the prompt's own tokens are what the model would repeat
    return [rng.integers(4, 40, length + 5 * i).tolist() for i in range(n)]


def serve(eng: Engine, cases) -> list[list[int]]:
    reqs = [eng.submit(p, params) for p, params in cases]
    out = {id(r): [] for r in reqs}
    while not all(r.done for r in reqs):
        for o in eng.scheduler.step():
            assert o.error is None, o.error
            out[id(o.request)].append(o.event.token_id)
    assert eng.blocks.in_use() == 0
    return [out[id(r)] for r in reqs]


@pytest.fixture
def make(bundles):
    def build(device_penalties: bool, pipeline: bool = False, kv_tokens: int | None = None,
              ahead: bool = False) -> Engine:
        eng = Engine(bundles("llama_tied", "bf16"), device="cpu")
        if device_penalties:
            eng.executor = eng.scheduler.executor = DevicePenalties(eng.executor)
        eng.scheduler.config.pipeline = pipeline
        if ahead:       # steps launched before the last is collected; prompts' first tokens sampled in the step
            eng.scheduler.config.mixed = eng.scheduler.config.ahead = True
        if kv_tokens:
            eng.blocks = eng.scheduler.blocks = BlockManager(kv_tokens // eng.executor.page_size + 1,
                                                             eng.executor.page_size)
        return eng
    return build


@pytest.mark.parametrize("pipeline,ahead", [(False, False), (True, False), (True, True)])
def test_device_penalties_give_the_host_samplers_tokens(make, pipeline, ahead):
    cases = list(zip(prompts(4, 20), [REP, FREQ, BOTH, PLAIN]))
    ref = serve(make(False), cases)
    eng = make(True, pipeline, ahead=ahead)
    got = serve(eng, cases)
    assert got == ref
    assert not ahead or (eng.scheduler.times.ahead_steps > 0 and eng.scheduler.times.first_on_device == 4)
    assert sorted(eng.executor.inits) == sorted(set(eng.executor.inits)) and len(eng.executor.inits) == 3
    # the penalties change the output: the same prompts without them give other tokens (presence / frequency and
    # all three; a repetition penalty alone keeps this tiny model's top token, every candidate being in the prompt)
    plain = serve(make(False), [(p, PLAIN) for p, _ in cases[1:3]])
    assert plain[0] != ref[1] and plain[1] != ref[2]


@pytest.mark.parametrize("pipeline,ahead", [(False, False), (True, False), (True, True)])
def test_device_penalties_survive_preemption(make, pipeline, ahead):
    """A KV pool too small for all: the newest requests are preempted and recomputed; each comes back in a new
    sequence whose penalty state is written again from the host's counts (a second init for that request), which
    must hold every token drawn so far, also where a pipelined step's tokens are only recorded, not described."""
    cases = list(zip(prompts(5, 30, seed=3), [BOTH, REP, FREQ, BOTH, REP]))
    ref = serve(make(False, kv_tokens=160), cases)
    eng = make(True, pipeline, kv_tokens=160, ahead=ahead)
    got = serve(eng, cases)
    assert eng.scheduler.preemptions > 0
    assert got == ref
    assert not ahead or eng.scheduler.times.ahead_steps > 0
    assert len(eng.executor.inits) > len(cases)
