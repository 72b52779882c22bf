"""The host's view of the activation formats (runtime/activation_formats.py), against their definitions in words
(templates/prelude.cuh.j2): what the GPU kernel tests write and read through."""
from __future__ import annotations

import itertools

import numpy as np

from imp_runtime.activation_formats import XF_F16, XF_F16W, read_activation, wq_pos, write_activation


def test_wq_pos_is_the_fragment_order():
    """XF_F16W: within each 256, element 64t + 8u + 4h + 2e + v sits at 32u + 16v + 8h + 2t + e (lane t's code
    word u, expanded pair (v, v + 2) of half h, is column 2t + e (+ 8h) of k-step 2u + v)."""
    pos = wq_pos(512)
    for blk, t, u, h, e, v in itertools.product(range(2), range(4), range(8), range(2), range(2), range(2)):
        k = 256 * blk + 64 * t + 8 * u + 4 * h + 2 * e + v
        assert pos[k] == 256 * blk + 32 * u + 16 * v + 8 * h + 2 * t + e
    assert sorted(pos.tolist()) == list(range(512))


def test_f16w_round_trip():
    """Written in XF_F16W and read back: XF_F16's values (fp16 of x * 2^-6), only the order differs."""
    a = np.random.default_rng(0).standard_normal((3, 768)).astype(np.float32) * 40
    w, f = write_activation(a, XF_F16W), write_activation(a, XF_F16)
    assert not np.array_equal(w, f)
    assert np.array_equal(read_activation(w.ravel(), 3, 768, XF_F16W), read_activation(f.ravel(), 3, 768, XF_F16))
    assert np.allclose(read_activation(w.ravel(), 3, 768, XF_F16W), a, rtol=2 ** -10)
