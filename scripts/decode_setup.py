"""The setup the decode-step scripts share (ablate_step.py, kernel_phases.py): `tokens` sequences of `context` random
tokens prefilled on a CUDA executor, one real decode step run (so the step values of the arena are a real step's),
and the decode phase of their bucket returned."""
from __future__ import annotations


def decode_phase_at_context(ex, tokens: int, context: int, seed: int = 0):
    import numpy as np

    from imp_runtime.executor import StepRow
    from imp_runtime.kv_blocks import BlockManager, SoloSequence
    blocks = BlockManager(ex.num_pages, ex.page_size)
    rng = np.random.default_rng(seed)
    seqs = [SoloSequence(ex, blocks) for _ in range(tokens)]
    for s in seqs:
        s.prefill(rng.integers(3, ex.vocab, context).tolist())
        s._cover(s.length + 2)
    ex.decode([StepRow(s.sid, 5, s.length) for s in seqs])
    return ex.program.phase("decode", next(x for x in ex.decode_buckets if x >= tokens))
