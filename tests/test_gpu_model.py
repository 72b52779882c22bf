"""Whole models on the GPU against the cpu executor on the same bundle: logits of tiny qwen3, gemma3 and
llama bundles and of SmolLM2 (relative error <= 2e-2), SmolLM2's greedy 32-token continuations identical
on 5 prompts, graph replay identical to eager launches, and 8 prompts decoded as one batch giving each
prompt's batch-1 tokens."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

try:
    from tests.gpu_common import ROOT, gpu_bundle, have_gpu, solo
except ImportError:
    from gpu_common import ROOT, gpu_bundle, have_gpu, solo

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not have_gpu(), reason="needs an NVIDIA GPU")]

PROMPTS = ["What is the capital of France?", "Why is the sky blue?", "Write a haiku about the sea.",
           "List three prime numbers.", "Explain gravity to a child.", "What is 12 times 7?",
           "Name a famous painter.", "How do airplanes fly?"]


def rel(a, b) -> float:
    assert np.all(np.isfinite(a))
    return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


def smollm2_path() -> Path:
    p = Path(os.environ.get("IMP_SMOLLM2_BUNDLE", ROOT / "build" / "smollm2"))
    if not (p / "manifest.json").is_file():
        pytest.skip(f"no SmolLM2 bundle at {p} (impc compile smollm2 -o build/smollm2 --target sm_90a)")
    return p


def executors(path, **kw):
    from imp_runtime.bundle import load_bundle
    from imp_runtime.executor_cpu import CpuExecutor
    from imp_runtime.executor_cuda import CudaExecutor
    b = load_bundle(path)
    return CpuExecutor(b), CudaExecutor(b, **kw)


def logits_run(ex, tokens, n_prompt, chunk: int | None = None):
    """Prefill n_prompt tokens (in chunks of `chunk`) with all logits, then decode the rest one by one."""
    seq = solo(ex)
    chunk = chunk or n_prompt
    rows = [seq.prefill(tokens[i:min(i + chunk, n_prompt)], all_logits=True) for i in range(0, n_prompt, chunk)]
    rows += [seq.decode(t) for t in tokens[n_prompt:]]
    seq.close()
    return np.concatenate(rows)


@pytest.mark.parametrize("name", ["llama-bf16-cutlass", "llama-cutlass"])
def test_cutlass_prefill_logits(name):
    """--prefill-gemm cutlass (all bf16; NVFP4): a 300-token prompt in one call runs the 512-row phase, its GEMMs on
    CUTLASS's kernels, then a prefix-cached chunk and decode; logits against the cpu executor."""
    cpu, gpu = executors(gpu_bundle(name))
    try:
        toks = np.random.default_rng(4).integers(4, cpu.spec.vocab_size, 340).tolist()
        ref, got = logits_run(cpu, toks, 320, chunk=300), logits_run(gpu, toks, 320, chunk=300)
        assert rel(got, ref) <= 2e-2
    finally:
        gpu.close()


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3", "qwen2", "llama-mixed", "qwen3-wide", "qwen3-rope",
                                  "qwen2-rope", "llama-i8", "qwen3-i8", "llama-bf16", "llama-bf16-np"])
def test_tiny_logits(name):
    cpu, gpu = executors(gpu_bundle(name))
    try:
        toks = np.random.default_rng(1).integers(4, cpu.spec.vocab_size, 80).tolist()
        ref, got = logits_run(cpu, toks, 64), logits_run(gpu, toks, 64, chunk=24)   # chunked after a prefix
        assert rel(got, ref) <= 2e-2
    finally:
        gpu.close()


@pytest.mark.parametrize("name,b", [("qwen3", 32), ("qwen3", 64), ("qwen3-wide", 3), ("qwen3-wide", 16),
                                    ("qwen3-wide", 64), ("qwen3-wide-i8", 3), ("qwen3-wide-i8", 64),
                                    ("qwen3-rope", 5), ("qwen3-rope", 64)])
def test_decode_batch_above_gemv_rows_vs_cpu(name, b):
    """Decode batches past the GEMV's rows run the GEMMs (qwen3: the mma.sync GEMM with atomic split-K;
    qwen3-wide on Hopper: every batch on the NVFP4 wgmma GEMM): every row's logits against the cpu executor's,
    the rows' contexts of different lengths."""
    from imp_runtime.executor import StepRow
    cpu, gpu = executors(gpu_bundle(name))
    try:
        rng = np.random.default_rng(b)
        prompts = [rng.integers(4, cpu.spec.vocab_size, int(n)).tolist() for n in rng.integers(3, 40, b)]
        nxt = rng.integers(4, cpu.spec.vocab_size, (3, b)).tolist()
        out = {}
        for name, ex in (("cpu", cpu), ("gpu", gpu)):
            seqs = [solo(ex) for _ in prompts]
            for s, p in zip(seqs, prompts):
                s.prefill(p)
            rows = []
            for step in range(3):
                for s in seqs:
                    s._cover(s.length + 1)
                res = ex.decode([StepRow(s.sid, t, s.length, want_logits=True) for s, t in zip(seqs, nxt[step])])
                rows.append(np.stack([res.logits[i] for i in range(b)]))
                for s in seqs:
                    s.length += 1
            for s in seqs:
                s.close()
            out[name] = np.stack(rows)
        assert rel(out["gpu"], out["cpu"]) <= 2e-2
    finally:
        gpu.close()


@pytest.mark.parametrize("b,ts,prefix", [(1, [37], 0), (5, [200], 20), (64, [300], 20), (0, [100, 57, 300], 10),
                                         (8, [40, 130, 9, 1], 0)])
def test_mixed_step_vs_cpu(b, ts, prefix):
    """A mixed step: b decode rows riding in the prefill launches of other sequences' chunks of ts tokens (one
    chunk: the smallest prefill phase holding every row, 128, 256 or the 512 chunk; several: the 512 chunk's
    phase, its attention over a tile table). Every decode row's logits and each chunk's last-token logits (its row
    gathered after the decode rows for the head) against the cpu executor's decode and prefill; the GPU-sampled
    greedy tokens, the decode rows' and each chunk's first, are the argmax of the GPU's own logits; each chunk's KV
    is right (the next decode step of its sequence agrees too)."""
    mixed_step_vs_cpu("qwen3", b, ts, prefix)


@pytest.mark.parametrize("b,ts,prefix", [(64, [300], 20), (0, [100, 57, 300], 10)])
def test_prefill_qkv_epilogue_vs_cpu(b, ts, prefix):
    """--prefill-qkv-epilogue: the large prefill phase's qkv GEMM applies q / k norm and RoPE and writes q and the
    KV pages itself (templates/gemm_wgmma.cu.j2 wg_qkv_epilogue; heads of 64 here), no qkv_rope launch: the same
    mixed steps as test_mixed_step_vs_cpu (the 512-row phase) against the cpu executor, each chunk's KV read back
    by its next decode step."""
    from imp_runtime.bundle import load_bundle
    prog = load_bundle(gpu_bundle("qwen3-qkvepi")).program(os.environ.get("IMP_GPU_TARGET", "sm_90a"))
    big = prog.phase("prefill", prog.constants["prefill_chunk"]).launches
    assert any(x.kernel == "gemm_wgp_qkv_f16" for x in big) and not any(x.kernel.startswith("qkv_rope") for x in big)
    mixed_step_vs_cpu("qwen3-qkvepi", b, ts, prefix)


def mixed_step_vs_cpu(bundle: str, b: int, ts: list[int], prefix: int) -> None:
    from imp_runtime.executor import PrefillChunk, StepRow
    cpu, gpu = executors(gpu_bundle(bundle))
    try:
        rng = np.random.default_rng(b + sum(ts))
        prompts = [rng.integers(4, cpu.spec.vocab_size, int(n)).tolist() for n in rng.integers(3, 40, b)]
        nxt = rng.integers(4, cpu.spec.vocab_size, b).tolist()
        texts = [rng.integers(4, cpu.spec.vocab_size, prefix + t + 1).tolist() for t in ts]
        out = {}
        for name, ex in (("cpu", cpu), ("gpu", gpu)):
            seqs = [solo(ex) for _ in prompts]
            for s, p in zip(seqs, prompts):
                s.prefill(p)
                s._cover(s.length + 1)
            others = [solo(ex) for _ in ts]
            for o, t, text in zip(others, ts, texts):
                if prefix:
                    o.prefill(text[:prefix])
                o._cover(prefix + t + 1)
            rows = [StepRow(s.sid, tok, s.length, want_logits=True) for s, tok in zip(seqs, nxt)]
            sample = b + len(ts) <= gpu.logit_rows      # (64 decode rows leave the head no row to sample in)
            chunks = [PrefillChunk(o.sid, text[prefix:prefix + t], prefix, want_logits=True, sample=sample)
                      for o, t, text in zip(others, ts, texts)]
            res = ex.decode_collect(ex.decode_submit(rows, chunks))
            after = []
            for o, t, text in zip(others, ts, texts):
                o.length = prefix + t
                after.append(o.decode(text[-1]))       # reads the chunk's KV
            out[name] = (np.stack([res.logits[i] for i in range(b)]) if b else np.zeros(1), np.stack(res.chunk_logits),
                         np.stack(after), res.tokens, res.chunk_tokens)
            for s in seqs + others:
                s.close()
        for k in (0, 1, 2) if b else (1, 2):
            assert rel(out["gpu"][k], out["cpu"][k]) <= 2e-2
        assert out["gpu"][3] == (np.argmax(out["gpu"][0], axis=1).tolist() if b else [])
        if b + len(ts) <= gpu.logit_rows:
            assert out["gpu"][4] == np.argmax(out["gpu"][1], axis=1).tolist()
    finally:
        gpu.close()


def test_mixed_step_samples_first_tokens_with_each_chunks_parameters():
    """A mixed step's prompt-ending chunks sampled in the step, each with its own parameters, beside a decode row:
    twin chunks (the same tokens at the same positions in two sequences, so the same logits) -- one returning its
    logits, the other sampled greedily, then (the same step again) with a repetition penalty (its prompt and the
    twin's top token seen) and a presence penalty (the runner-up counted as drawn once): first the twin's argmax, then
    the argmax of the twin's logits penalised by the host sampler (runtime/sampler.py), which is neither; seeded draws
    at temperature 2 depend on the seed only (two chunks with one seed agree, eight seeds give several tokens)."""
    from imp_runtime.executor import PrefillChunk, StepRow
    from imp_runtime.sampler import Sampler, SamplingParams
    _, gpu = executors(gpu_bundle("qwen3-pen"))      # (the bundle compiled with --gpu-penalties)
    try:
        if not gpu.samples_chunks:
            pytest.skip("the bundle's prefill does not sample")
        rng = np.random.default_rng(5)
        row = solo(gpu)
        row.prefill(rng.integers(4, gpu.spec.vocab_size, 20).tolist())
        row._cover(row.length + 2)
        text = rng.integers(4, 40, 30).tolist()           # few distinct tokens: the penalty has work to do
        pen = SamplingParams(temperature=0.0, repetition_penalty=50.0, presence_penalty=2.0)
        seeded = [SamplingParams(temperature=2.0, seed=s) for s in (7, 7, 1, 2, 3, 4, 5, 6, 8, 9)]
        seqs = [solo(gpu) for _ in range(2 + len(seeded))]
        for s in seqs:
            s._cover(len(text) + 1)

        def step(params):
            chunks = [PrefillChunk(seqs[0].sid, text, 0, want_logits=True),
                      PrefillChunk(seqs[1].sid, text, 0, sample=True, params=params)]
            chunks += [PrefillChunk(s.sid, text, 0, sample=True, params=p) for s, p in zip(seqs[2:], seeded)]
            return gpu.decode_collect(gpu.decode_submit([StepRow(row.sid, 9, row.length)], chunks))

        first = step(None)
        top, second = (int(i) for i in np.argsort(-first.chunk_logits[0])[:2])
        assert first.chunk_tokens[1] == top
        gpu.init_penalties(seqs[1].sid, text + [top], {second: 1})
        res = step(pen)
        assert res.chunk_tokens[0] is None and res.chunk_logits[1] is None and len(res.tokens) == 1
        assert np.array_equal(res.chunk_logits[0], first.chunk_logits[0]), "the same step, other logits"
        host = Sampler(pen, text + [top])
        host.out_counts = {second: 1}
        assert res.chunk_tokens[1] == int(np.argmax(host.penalise(res.chunk_logits[0]))) not in (top, second)
        draws = res.chunk_tokens[2:]
        assert draws == first.chunk_tokens[2:]
        assert draws[0] == draws[1] and len(set(draws)) >= 3, draws
        for s in seqs + [row]:
            s.close()
    finally:
        gpu.close()


@pytest.fixture(scope="module")
def smol():
    from imp_runtime.engine import Engine
    path = smollm2_path()
    cpu, gpu = executors(path)
    eng = Engine(path, device="cpu", verify=False)
    yield cpu, gpu, eng
    gpu.close()


def greedy(ex, prompts_ids, n, batch=False):
    """Greedy continuations of n tokens (argmax of the logits on the host); batch=True decodes all prompts
    as one batch."""
    from imp_runtime.executor import StepRow
    seqs = [solo(ex) for _ in prompts_ids]
    outs = [[int(np.argmax(s.prefill(ids)))] for s, ids in zip(seqs, prompts_ids)]
    groups = [list(range(len(seqs)))] if batch else [[i] for i in range(len(seqs))]
    for g in groups:
        for _ in range(n - 1):
            for i in g:
                seqs[i]._cover(seqs[i].length + 1)
            res = ex.decode([StepRow(seqs[i].sid, outs[i][-1], seqs[i].length, want_logits=True) for i in g])
            for j, i in enumerate(g):
                outs[i].append(int(np.argmax(res.logits[j])))
                seqs[i].length += 1
    for s in seqs:
        s.close()
    return outs


def test_smollm2_logits(smol):
    cpu, gpu, eng = smol
    ids = eng.encode_chat([{"role": "user", "content": PROMPTS[1]}])
    toks = ids + np.random.default_rng(2).integers(0, cpu.spec.vocab_size, 8).tolist()
    assert rel(logits_run(gpu, toks, len(ids)), logits_run(cpu, toks, len(ids))) <= 2e-2


def test_smollm2_greedy_matches_cpu(smol):
    cpu, gpu, eng = smol
    ids = [eng.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:5]]
    got, ref = greedy(gpu, ids, 32), greedy(cpu, ids, 32)
    for p, g, r in zip(PROMPTS, got, ref):
        assert g == r, f"{p!r}: gpu {eng.tokenizer.decode(g)!r} != cpu {eng.tokenizer.decode(r)!r}"


def test_graph_replay_equals_eager(smol):
    _cpu, gpu, eng = smol
    ids = [eng.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:3]]
    graphed = greedy(gpu, ids, 24, batch=True)
    gpu.use_graphs = False
    try:
        eager = greedy(gpu, ids, 24, batch=True)
    finally:
        gpu.use_graphs = True
    assert graphed == eager


def test_batch_of_8_equals_batch_1(smol):
    _cpu, gpu, eng = smol
    ids = [eng.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    assert greedy(gpu, ids, 24, batch=True) == greedy(gpu, ids, 24, batch=False)


def test_gpu_sampled_greedy_equals_logits(smol):
    """The GPU sampler inside the decode graph: greedy token ids equal the argmax of the logits."""
    from imp_runtime.executor import StepRow
    from imp_runtime.sampler import SamplingParams
    _cpu, gpu, eng = smol
    ids = [eng.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:4]]
    ref = greedy(gpu, ids, 12, batch=True)
    seqs = [solo(gpu) for _ in ids]
    outs = [[int(np.argmax(s.prefill(i)))] for s, i in zip(seqs, ids)]
    for _ in range(11):
        for s in seqs:
            s._cover(s.length + 1)
        res = gpu.decode([StepRow(s.sid, o[-1], s.length, SamplingParams(temperature=0)) for s, o in zip(seqs, outs)])
        assert res.logits == {}, "logits cross to the host only for rows that ask"
        for s, o, t in zip(seqs, outs, res.tokens):
            o.append(t)
            s.length += 1
    for s in seqs:
        s.close()
    assert outs == ref


def test_engine_runs_on_cuda():
    from imp_runtime.engine import Engine
    from imp_runtime.sampler import SamplingParams
    eng = Engine(smollm2_path(), device="cuda", verify=False)
    assert eng.executor.name == "cuda"
    text = "".join(ev.text for ev in eng.generate(eng.encode_chat([{"role": "user", "content": PROMPTS[0]}]),
                                                  SamplingParams(max_tokens=16, temperature=0)))
    assert "Paris" in text, text
    eng.executor.close()


def test_synthetic_runs():
    from imp_runtime.bundle import load_bundle
    from imp_runtime.executor import StepRow
    from imp_runtime.executor_cuda import CudaExecutor
    ex = CudaExecutor(load_bundle(gpu_bundle("syn-qwen3-0.6b")))
    try:
        seqs = [solo(ex) for _ in range(3)]
        toks = [int(np.argmax(s.prefill(list(range(5, 5 + 100 * (i + 1)))))) for i, s in enumerate(seqs)]
        for _ in range(5):
            for s in seqs:
                s._cover(s.length + 1)
            res = ex.decode([StepRow(s.sid, t, s.length, want_logits=True) for s, t in zip(seqs, toks)])
            toks = res.tokens
            for s in seqs:
                s.length += 1
        assert all(0 <= t < ex.spec.vocab_size for t in toks)
        assert all(np.all(np.isfinite(v)) for v in res.logits.values()) and len(res.logits) == 3
        for s in seqs:
            s.close()
    finally:
        ex.close()


@pytest.mark.parametrize("name,context", [("syn-qwen3-0.6b", 10), ("syn-qwen3-0.6b", 300), ("syn-qwen3-0.6b", 3000),
                                          ("qwen3-wide", 10), ("qwen3-wide", 300), ("qwen3-wide-i8", 300),
                                          ("syn-qwen3-8b-2l", 300), ("syn-qwen3-8b-2l-rolled", 300),
                                          ("syn-qwen3-8b-2l-pair", 300), ("syn-llama-8b-2l", 300),
                                          ("syn-llama-8b-2l-pair", 300), ("syn-qwen3-8b-2l-ready", 10),
                                          ("syn-qwen3-8b-2l-ready", 300), ("syn-qwen3-8b-2l-ready", 3000),
                                          ("qwen3-rope", 10), ("qwen3-rope", 300)])
def test_decode_is_batch_invariant(name, context):
    """One sequence's logits are bitwise the same whether it is decoded alone or among other sequences of other
    lengths (the decode GEMV rows, attention splits cut by each sequence's own length, and the merge order do not
    depend on the batch): syn-qwen3-0.6b in batches up to its GEMV's rows (batches above run a GEMM whose fp16
    activations round differently, held to the cpu executor instead, test above); qwen3-wide, whose batches all
    run the NVFP4 decode GEMM (the same K splits at every batch), in batches of 1..64 (qwen3-wide-i8: with an INT8
    head, on its GEMM at every batch under --gemv-max-rows 0); the 8B shape's layers, whose
    GEMVs at 1, 2, 4 and 8 rows are the streamed ones (qkv on gemv_ring3_*, at one row gemv_ring3_rope_*, qkv_rope's work in its tail,
    the others its launch after; the test bundle runs 8 rows on them too; one row's
    gate_up on the unrolled loop, -rolled: on the rolled one, --no-gemv-ring-unroll; -pair: one row's down and the next
    qkv in one launch, --gemv-pair, the other batches their two launches; -ready: one row's attention blocks start on
    their kv head's count from qkv's rope tails instead of the grid dependency, --attn-head-ready, at contexts of one
    split and of many; syn-llama-8b-2l: the Llama-3.1-8B shape's, down
    7 stages a warp, no q/k norm); qwen3-rope, whose decode attention appends
    the new key and value itself (--rope-in-attention)."""
    from imp_runtime.bundle import load_bundle
    from imp_runtime.executor import StepRow
    from imp_runtime.executor_cuda import CudaExecutor
    ex = CudaExecutor(load_bundle(gpu_bundle(name)))
    gemv = ex.program.options["gemv_max_rows"]
    batches = (1, 2, 5, 8, 16, 17, 32, 64) if name.startswith("qwen3-wide") else tuple(b for b in (1, 2, 4, 8, 16) if b <= gemv)
    assert len(batches) > 2
    try:
        rng = np.random.default_rng(context)
        target = solo(ex)
        target.prefill(rng.integers(3, ex.vocab, context).tolist())
        others = [solo(ex) for _ in range(batches[-1] - 1)]
        for o in others:
            o.prefill(rng.integers(3, ex.vocab, int(rng.integers(1, min(2 * context, 400)))).tolist())
        for s in [target, *others]:
            s._cover(s.length + 1)
        rows = {}
        for b in batches:
            batch = [target, *others[:b - 1]]
            res = ex.decode([StepRow(s.sid, 7, s.length, want_logits=(s is target)) for s in batch])
            rows[b] = res.logits[0]
        for b in batches[1:]:
            assert np.array_equal(rows[b], rows[1]), f"batch {b} changed the logits at context {context}"
        for s in [target, *others]:
            s.close()
    finally:
        ex.close()


@pytest.mark.parametrize("name", ["syn-qwen3-8b-2l-pair", "syn-llama-8b-2l-pair"])
def test_gemv_pair_unfused_where_the_grid_does_not_fit(name, monkeypatch):
    """--gemv-pair on a GPU that cannot hold a pair launch's whole grid at once (its grid barrier would never return;
    simulated: the occupancy API answering one block an SM): the executor runs the two launches each pair fuses
    (runtime/program.py unfuse), no pair launch left in its program, and one sequence's logits over four one-row steps
    at context 300 are bit for bit the paired run's (the fused and unfused launches are the same arithmetic)."""
    from imp_runtime import executor_cuda
    from imp_runtime.bundle import load_bundle
    from imp_runtime.executor import StepRow
    from imp_runtime.executor_cuda import CudaExecutor

    def logits(ex) -> list:
        rng = np.random.default_rng(300)
        s = solo(ex)
        tok, out = int(np.argmax(s.prefill(rng.integers(3, ex.vocab, 300).tolist()))), []
        for _ in range(4):
            s._cover(s.length + 1)
            res = ex.decode([StepRow(s.sid, tok, s.length, want_logits=True)])
            out.append(res.logits[0])
            tok, s.length = res.tokens[0], s.length + 1
        s.close()
        return out

    kinds = {"gemv_ring_pair_nvfp4_nb1", "gemv_ring_pair_gated_nvfp4_nb1"}
    ex = CudaExecutor(load_bundle(gpu_bundle(name)))
    try:
        assert kinds <= {x.kernel for x in ex.program.phase("decode", 1).launches}
        paired = logits(ex)
    finally:
        ex.close()
    ok = executor_cuda.cu.CUresult.CUDA_SUCCESS
    monkeypatch.setattr(executor_cuda.cu, "cuOccupancyMaxActiveBlocksPerMultiprocessor", lambda f, b, s: (ok, 1))
    ex = CudaExecutor(load_bundle(gpu_bundle(name)))
    try:
        assert not kinds & {x.kernel for ph in ex.program.phases for x in ph.launches}
        unfused = logits(ex)
    finally:
        ex.close()
    for step, (u, v) in enumerate(zip(paired, unfused)):
        assert np.array_equal(u, v), f"step {step}: the unfused launches' logits differ from the pairs'"
