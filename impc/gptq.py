"""GPTQ inside the NVFP4 grid: round W's columns in order, each time spreading the rounding error over
the columns not yet rounded so that the layer's output on the calibration inputs moves least.

The objective is the calibration-weighted error tr((W - Q) H (W - Q)^T) with H = sum_t x_t x_t^T over
the layer's calibration inputs (Frantar et al., "GPTQ", 2022). The grid is NVFP4's: the tensor scale
and the 16-element block scales are fixed first, from the weights as quantize.py computes them, so the
E4M3 scales of a block are those of plain rounding and only the E2M1 codes change. Everything is
float64 and single-order (no reductions whose order depends on threads), so the same W and H give the
same bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from impc.quantize import NVFP4Tensor, nvfp4_scales, pack_codes, pad_k
from imp_runtime.nvfp4 import BLOCK, E2M1_VALUES, E4M3_VALUES

DAMP = 0.01          # of the mean diagonal of H, added to it: keeps H invertible, as the GPTQ paper does
LAZY_BLOCK = 64      # columns whose updates to the rest are applied as one matrix product (same result up to rounding)


@dataclass
class HessianFactor:
    feedback: np.ndarray    # F [K, K], lower triangular: F[c, i] = R_ic / R_cc, where H + damping = R R^T
    r_diag: np.ndarray      # R_cc
    dead: np.ndarray        # bool [K]: input channels never active in the calibration data
    damping: float          # added to H's diagonal


def hessian_factor(h: np.ndarray, damp: float = DAMP, order: np.ndarray | None = None) -> HessianFactor:
    """Dampen H (and give dead channels, whose weights cannot matter and are zeroed, a unit diagonal),
    then factor it as R R^T (R upper) by a Cholesky in reversed order. GPTQ's usual factor U
    (H^-1 = U^T U) is R^-1; the loop below uses R itself, so no inverse is needed. With J the order
    reversal and J H J = M M^T (M lower), R = J M J, so R^T = J M^T J.
    With order: the factor of H's rows and columns in that order, gathered in reversed order at once
    (the values LAPACK saw before as a reversed view of the permuted copy: the same bytes, one gather
    and no copy of the permuted H); h is only read. Without: h (float64) is modified in place (at 8B a
    K x K matrix is 1.2 GB, so no more copies than the factorisation needs)."""
    if order is None:
        g = h[::-1, ::-1]
    else:
        rev = order[::-1]
        g = h.take(rev, 0).take(rev, 1)
    diag = np.diag(g)[::-1].copy()                  # in order, contiguous: the damping's mean sums as before
    dead = diag == 0
    dead_g = dead[::-1]
    g[dead_g, dead_g] = 1.0
    diag[dead] = 1.0
    damping = damp * float(np.mean(diag))
    g[np.diag_indices_from(g)] += damping
    rt = np.linalg.cholesky(g).T[::-1, ::-1]                     # R^T, lower triangular (a view)
    r_diag = np.ascontiguousarray(np.diag(rt))
    feedback = np.divide(rt, r_diag[:, None], order="C")        # the contiguous copy and the division in one pass
    return HessianFactor(feedback, r_diag, dead, damping)


def gptq_nvfp4(w: np.ndarray, hessian: np.ndarray, damp: float = DAMP, act_order: bool = True,
               scale_search: bool = True) -> NVFP4Tensor:
    return gptq_nvfp4_with_error(w, hessian, damp, act_order, scale_search).tensor


@dataclass
class GPTQResult:
    tensor: NVFP4Tensor
    weighted_error: float      # tr((W - Q) H (W - Q)^T) with the undampened H, in float64


def gptq_nvfp4_with_error(w: np.ndarray, hessian: np.ndarray, damp: float = DAMP, act_order: bool = True,
                          scale_search: bool = True) -> GPTQResult:
    """W [N, K] and H [K, K] (sum of x x^T of the inputs) -> NVFP4 whose codes minimise the
    H-weighted error column by column. The grid is fixed first: amax / 6 block scales, or with
    scale_search the neighbouring E4M3 code where it rounds the block with less input-weighted error.
    act_order: the columns of the most active inputs first (GPTQ's "act-order"; with the grid fixed,
    the order only decides which columns absorb the others' error). SmolLM2, mean relative output
    error of layers 0-2 on the calibration data: rounding 0.063, GPTQ 0.037, + act-order 0.0325,
    + scale search 0.031."""
    n, k = w.shape
    w = pad_k(np.asarray(w, dtype=np.float64))       # read only: the loop works on a permuted copy
    kp = w.shape[1]
    if kp == k:
        h = np.asarray(hessian, dtype=np.float64)     # read only: the factor works on a permuted copy
    else:
        h = np.zeros((kp, kp))
        h[:k, :k] = hessian                         # padded columns are dead inputs
    tscale, scales = nvfp4_scales(w)
    st = float(tscale[0])
    if scale_search:
        scales = weighted_scale_search(w, scales, st, np.diag(h))
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(kp)
    f = hessian_factor(h, damp, order)
    fb = f.feedback
    # The columns in order, transposed, so that a column of W is a contiguous row: [Kp, N] for W, its grid
    # steps (by table: E4M3 value x tensor scale, and 4 / step, 0 where a block is all zeros: code 0),
    # codes and errors D (float64 [Kp, N] arrays are few: at 8B, gate_up's is 0.8 GB).
    wt = w.T[order]
    wt[f.dead] = 0.0
    step_of = E4M3_VALUES.astype(np.float64) * st
    inv4_of = np.where(step_of > 0, 4.0 / np.where(step_of > 0, step_of, 1.0), 0.0)
    grid = np.ascontiguousarray(scales.T)[order // BLOCK]      # [Kp, N] E4M3 codes
    step = step_of[grid]
    # GPTQ as error feedback (Babai's nearest plane; Chen et al. 2024): column c is rounded after adding
    # sum_{i<c} (W_i - Q_i) R_ic / R_cc = sum_{i<c} D_i F_ci, the optimal-brain-surgeon update of the
    # paper written with R (H = R R^T) instead of the inverse's factor.
    dt = np.empty_like(wt)
    codes = np.empty((kp, n), dtype=np.uint8)
    seen_error = np.zeros(kp)               # ||rounding error of column c as the loop saw it||^2
    # one column's temporaries, allocated once (the loop runs ~100k times per SmolLM2 compile on rows of a
    # few thousand values: numpy's per-call costs, not arithmetic, are most of its time)
    deq, y, fl = np.empty(n), np.empty(n), np.empty(n)
    tie, idx = np.empty(n, dtype=bool), np.empty(n, dtype=np.intp)
    for i1 in range(0, kp, LAZY_BLOCK):
        i2 = min(i1 + LAZY_BLOCK, kp)
        wb = wt[i1:i2] + fb[i1:i2, :i1] @ dt[:i1]       # the earlier blocks' feedback as one product
        inv4 = inv4_of[grid[i1:i2]]
        for c in range(i1, i2):
            r = c - i1
            x = fb[c, i1:c] @ dt[i1:c]                   # + this block's earlier columns' (one gemv)
            x += wb[r]
            np.multiply(x, inv4[r], out=y)
            q, values = e2m1_codes_of_quarters(y, fl, tie, idx, with_values=True)
            codes[c] = q
            np.multiply(values, step[c], out=deq)
            np.subtract(wt[c], deq, out=dt[c])
            x -= deq
            seen_error[c] = x @ x
    codes = np.ascontiguousarray(codes[np.argsort(order)].T)
    # GPTQ's own loss is the weighted error for free: with D = W - Q, D R's column c is R_cc times the
    # rounding error of column c as the loop saw it, and ||D R||^2 = tr(D H_damped D^T); removing the
    # dampening leaves tr(D H D^T) (dead inputs hold D = 0 in the loop and add nothing either way).
    loss = float(f.r_diag ** 2 @ seen_error - f.damping * np.sum(dt * dt))
    return GPTQResult(NVFP4Tensor(pack_codes(codes), scales, tscale, (n, k)), loss)


# E2M1 rounding as round_e2m1 does it (nearest, ties to the even code, saturating at 6), by table: in
# units of a quarter (y = 4x, exact) every decision point is an integer, so floor(y) names the interval
# between two integers and a table its code; only a y exactly on a decision point needs a second look
# (ties go down at 1, 5, 10, 20 quarters and up at 3, 7, 14). A handful of numpy calls instead of the
# seven comparisons before: the GPTQ loop calls this once per column, ~100k times per SmolLM2 compile.
_DECISIONS = ((1, False), (3, True), (5, False), (7, True), (10, False), (14, True), (20, False))   # (quarters, tie goes up)
# code on (j, j+1) for j = 0 .. 21, the last standing for every y >= 21 (no decision point there)
_MAGNITUDE = np.array([sum(t <= j for t, _ in _DECISIONS) for j in range(22)], dtype=np.uint8)
# indexed by floor(y) + 21, clipped to 0 .. 42: the interval (j, j+1) of a negative j holds -y in (-j-1, -j)
_SIGNED = np.concatenate([8 | _MAGNITUDE[20::-1], _MAGNITUDE]).astype(np.uint8)
_TIE_FIX = np.zeros(43, dtype=np.int8)          # y exactly on a decision point: the code's correction
for _t, _up in _DECISIONS:
    if _up:
        _TIE_FIX[21 - _t] = 1                   # y = -t: the magnitude goes up
    else:
        _TIE_FIX[21 + _t] = -1                  # y = +t: down
_E2M1_F64 = E2M1_VALUES.astype(np.float64)                                          # exact
_SIGNED_F64 = _E2M1_F64[_SIGNED]                                                    # value by floor(y) + 21
_MAGNITUDE_VALUE = E2M1_VALUES[_MAGNITUDE].astype(np.float64)                       # value on (j, j+1)
_TIE_DOWN_VALUE = np.array([(E2M1_VALUES[_MAGNITUDE[j]] - E2M1_VALUES[_MAGNITUDE[j] - 1]) if (j, False) in _DECISIONS
                            else 0.0 for j in range(22)])                           # value's correction at y = j


def e2m1_codes(x: np.ndarray) -> np.ndarray:
    """The same nibbles as impc.quantize.round_e2m1 (tests/test_calibrate.py checks it on every tie)."""
    return e2m1_codes_of_quarters(np.asarray(x, dtype=np.float64) * 4.0)


def e2m1_codes_of_quarters(y: np.ndarray, floor: np.ndarray | None = None, tie: np.ndarray | None = None,
                            index: np.ndarray | None = None, with_values: bool = False):
    """E2M1 nibbles of y / 4 (y float64); with_values: (nibbles, their E2M1 values in float64, each the
    float32 value exactly). floor (float64), tie (bool) and index (intp) are scratch of y's size the caller
    may lend (the GPTQ loop calls this once per column: numpy's per-call costs are most of its time)."""
    j = np.floor(y, out=floor)
    tie = np.equal(y, j, out=tie)
    j += 21.0
    np.maximum(j, 0.0, out=j)                   # saturation at +-6 (beyond the table's last intervals)
    np.minimum(j, 42.0, out=j)
    if index is None:
        i = j.astype(np.intp)
    else:
        i = index
        np.copyto(i, j, casting="unsafe")
    q = _SIGNED[i]                              # -0.0 lands on floor 0: code 0, as round_e2m1 gives
    if np.count_nonzero(tie):
        q = (q + _TIE_FIX[i] * tie).astype(np.uint8)
        return (q, _E2M1_F64[q]) if with_values else q
    return (q, _SIGNED_F64[i]) if with_values else q


def e2m1_magnitude_values_of_quarters(y: np.ndarray) -> np.ndarray:
    """The nearest E2M1 magnitudes (float64) of non-negative y / 4, ties to the even code."""
    j = np.floor(y)
    tie = y == j
    np.minimum(j, 21.0, out=j)
    i = j.astype(np.intp)
    v = _MAGNITUDE_VALUE[i]
    if np.count_nonzero(tie):
        v -= _TIE_DOWN_VALUE[i] * tie
    return v


SEARCH_CHUNK = 16384     # elements of W per step of the scale search: its temporaries stay in the core's cache


def weighted_scale_search(w: np.ndarray, nominal: np.ndarray, st: float, weight: np.ndarray) -> np.ndarray:
    """Per block, the E4M3 code among nominal-1, nominal, nominal+1 whose rounding to nearest has the
    least input-weighted squared error sum_j H_jj (w_j - q_j)^2 (a few rows at a time: ten passes over
    a whole [N, K] float64 array per candidate ran at memory speed, twice as slow)."""
    n, kp = w.shape
    wgt = weight.reshape(1, kp // BLOCK, BLOCK)
    nominal = np.asarray(nominal, dtype=np.uint8)
    cands = [np.where(nominal == 0, 0, np.clip(nominal.astype(np.int16) + offset, 1, 126)).astype(np.uint8)
             for offset in (0, -1, 1)]
    # in quarters of a step (a quarter step is exact); a zero step (scale code 0) rounds its block to
    # zeros whatever the codes: an infinite quarter there gives 0
    steps = [(E4M3_VALUES[c].astype(np.float64) * st)[:, :, None] for c in cands]
    quarters = [np.where(s > 0, s * 0.25, np.inf) for s in steps]
    best = nominal.copy()
    rows = max(1, SEARCH_CHUNK // kp)
    for r1 in range(0, n, rows):
        r = slice(r1, min(n, r1 + rows))
        mag = np.abs(w[r]).reshape(-1, kp // BLOCK, BLOCK)       # the grid is symmetric: magnitudes suffice
        best_err = None
        for cand, stp, quarter in zip(cands, steps, quarters):
            d = e2m1_magnitude_values_of_quarters(mag / quarter[r])
            d *= stp[r]
            np.subtract(mag, d, out=d)
            d *= d
            d *= wgt
            err = np.sum(d, axis=2)
            if best_err is None:
                best_err = err
            else:
                better = err < best_err
                best[r] = np.where(better, cand[r], best[r])
                best_err = np.where(better, err, best_err)
    return best


def weighted_error(w: np.ndarray, deq: np.ndarray, hessian: np.ndarray) -> float:
    """tr((W - Q) H (W - Q)^T): the summed squared change of the layer's outputs on the calibration set
    (float32 products: a diagnostic, not an input to any rounding decision)."""
    return output_energy(np.asarray(w, dtype=np.float64) - np.asarray(deq, dtype=np.float64), hessian)


def output_energy(w: np.ndarray, hessian: np.ndarray) -> float:
    """tr(W H W^T) = sum_ij H_ij (W^T W)_ij, with W^T W in float32. numpy hands a matrix times its own
    transpose to BLAS's syrk (one triangle: N K^2 products, against 2 N K^2 for W @ H)."""
    d = np.asarray(w, dtype=np.float32)
    gram = d.T @ d
    return float(np.sum(gram * hessian, dtype=np.float64))
