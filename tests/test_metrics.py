"""The server's step-batched histogram against prometheus_client's own Histogram (the oracle): the same
values give the same exposition lines, bucket edges included."""
from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from imp_runtime.server.metrics import _LATENCY_BUCKETS, StepHistogram


def lines(registry: CollectorRegistry, name: str) -> list[str]:
    text = generate_latest(registry).decode()
    return [ln for ln in text.splitlines() if ln.startswith(name) and "_created" not in ln]


def test_step_histogram_matches_prometheus_histogram():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.exponential(0.05, 500), np.asarray(_LATENCY_BUCKETS),    # bounds: "le" buckets
                             [0.0, 31.0, 1e-9]])
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    h = StepHistogram("x_seconds", "doc", _LATENCY_BUCKETS, ours)
    ref = Histogram("x_seconds", "doc", buckets=_LATENCY_BUCKETS, registry=theirs)
    for step in np.array_split(values, 37):        # a step's values at a time
        h.observe(step)
    h.observe([])
    for v in values:
        ref.observe(float(v))
    got, want = lines(ours, "x_seconds"), lines(theirs, "x_seconds")
    total = [float(ln.split()[-1]) for ln in got + want if ln.startswith("x_seconds_sum")]
    assert [ln for ln in got if "_sum" not in ln] == [ln for ln in want if "_sum" not in ln]
    assert len(total) == 2 and abs(total[0] - total[1]) < 1e-9
