"""Prometheus metrics, in a registry of the app's own (several apps in one process, as in tests, must
not collide in the global registry)."""
from __future__ import annotations

import threading

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import HistogramMetricFamily

# Buckets in seconds: a cpu executor takes ~0.1-1 s a token, a GPU ~5-20 ms; cover both.
_LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    1.5, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("imp_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.ttft = StepHistogram("imp_time_to_first_token_seconds", "request arrival to first generated token",
                                  _LATENCY_BUCKETS, r)
        self.itl = StepHistogram("imp_inter_token_latency_seconds", "time between consecutive generated tokens",
                                 _LATENCY_BUCKETS, r)
        self.prompt_tokens = Counter("imp_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("imp_generation_tokens", "tokens generated", registry=r)
        self.queue_depth = Gauge("imp_queue_depth", "requests waiting for a generation slot", registry=r)
        self.running = Gauge("imp_running_requests", "generations in progress", registry=r)
        self.kv_pages = Gauge("imp_kv_pages_in_use", "KV cache pages held by running generations", registry=r)
        self.cancelled = Counter("imp_cancelled_requests", "generations cancelled because the client left",
                                 registry=r)
        self.prefix_query = Gauge("imp_prefix_cache_query_tokens", "prompt tokens looked up in the prefix cache "
                                  "since start", registry=r)
        self.prefix_hit = Gauge("imp_prefix_cache_hit_tokens", "prompt tokens whose KV the prefix cache held, "
                                "since start", registry=r)
        self.preemptions = Gauge("imp_preemptions", "requests preempted (recomputed later) since start", registry=r)

    def watch_scheduler(self, scheduler) -> None:
        """Read the scheduler's own counters at scrape time (they count in the generation thread)."""
        self.prefix_query.set_function(lambda: scheduler.prefix_query_tokens)
        self.prefix_hit.set_function(lambda: scheduler.prefix_hit_tokens)
        self.preemptions.set_function(lambda: scheduler.preemptions)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StepHistogram:
    """A Prometheus histogram observed a step's values at a time (every stream's inter-token latency, each
    step): one numpy bucketing for all of them instead of a Histogram.observe a token (a Python scan of the
    buckets under a lock, on the thread the GPU waits for). Exposed as a histogram at scrape time."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], registry: CollectorRegistry):
        self.name, self.doc = name, doc
        self.bounds = np.asarray(buckets, np.float64)
        self.counts = np.zeros(len(buckets) + 1, np.int64)     # the last: above every bound (+Inf)
        self.total = 0.0
        self.lock = threading.Lock()
        registry.register(self)

    def observe(self, values) -> None:
        v = np.asarray(values, np.float64).reshape(-1)
        if not v.size:
            return
        # Prometheus buckets are "less than or equal": value == bound falls in that bound's bucket
        bins = np.bincount(np.searchsorted(self.bounds, v, side="left"), minlength=len(self.counts))
        with self.lock:
            self.counts += bins
            self.total += float(v.sum())

    def collect(self):
        with self.lock:
            cum, total = np.cumsum(self.counts), self.total
        buckets = [(repr(float(b)), int(c)) for b, c in zip(self.bounds, cum[:-1])] + [("+Inf", int(cum[-1]))]
        yield HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=total)
