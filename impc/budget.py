"""A byte budget for the weights: the NVFP4 tensors whose quantization hurts most are kept in bf16.

Each NVFP4 candidate's effect is measured directly: the reference model (every linear in bf16, as the
`--quant bf16` bundle stores it) runs a few hundred calibration tokens with only that tensor replaced
by its quantized values, and the mean KL(reference || that model) of the next-token distributions is
the tensor's sensitivity. Layers before the tensor's run once (their outputs are cached), so a tensor
in layer l costs the layers from l on plus the head. Tensors then go to bf16 in order of sensitivity
per extra byte (greedy knapsack) while the total stays within the budget, which is never exceeded.

The budget is a factor of the weight bytes of the bundle with every candidate in NVFP4 (`--budget
1.3`), or an absolute size (`--budget 0.25GiB`).
"""
from __future__ import annotations

import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from impc.errors import CompileError
from impc.forward import embed, final_hidden, layer_forward, layer_weights, log_probs
from impc.plan import GiB, tensor_bytes, weights_bytes
from impc.progress import Progress
from imp_runtime.spec import ModelSpec

SENSITIVITY_TOKENS = 128     # calibration tokens each sensitivity is measured on
SENSITIVITY_CHUNK = 64       # in chunks of this many (spread over the calibration set: prose and chat)
KL_ROWS_IN_CACHE = 1 << 16   # logits the KL works on at a time (one row of a 49k vocabulary: its passes stay in L2)


@dataclass(frozen=True)
class Budget:
    factor: float | None = None     # of the all-NVFP4 weight bytes
    gib: float | None = None        # or an absolute size

    def bytes_for(self, base_bytes: int) -> int:
        return int(self.factor * base_bytes) if self.factor is not None else int(self.gib * GiB)

    def __str__(self) -> str:
        return f"{self.factor:g}" if self.factor is not None else f"{self.gib:g}GiB"


def parse_budget(text: str) -> Budget:
    """'1.3' (or '1.3x'): a factor of the all-NVFP4 weight bytes; '0.25GiB': a size."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(x|gib|GiB|G|g)?\s*", text or "")
    if not m:
        raise CompileError(f"--budget {text}: give a factor of the all-NVFP4 weight bytes (1.3) or a size (0.25GiB)")
    value, unit = float(m.group(1)), (m.group(2) or "x").lower()
    if unit == "x":
        if value < 1.0:
            raise CompileError(f"--budget {text}: a factor below 1 is less than the all-NVFP4 weights")
        return Budget(factor=value)
    return Budget(gib=value)


@dataclass
class BudgetChoice:
    formats: dict[str, str]
    base_bytes: int                  # weight bytes with every candidate in NVFP4
    budget_bytes: int
    weights_bytes: int               # with the choice made (never above budget_bytes)
    sensitivity: dict[str, float]    # candidate -> mean KL with only it quantized (empty: not measured)
    widened: list[str]               # the candidates kept in bf16, most valuable first


def candidates(formats: Mapping[str, str]) -> list[str]:
    return [name for name, fmt in formats.items() if fmt == "nvfp4" and (name.startswith("layers.") or name == "lm_head")]


def sensitivity_chunks(chunks: np.ndarray, n_tokens: int = SENSITIVITY_TOKENS,
                       chunk: int = SENSITIVITY_CHUNK) -> np.ndarray:
    """Rows spread evenly over the calibration chunks (prose and conversations both), each cut short."""
    t = min(chunk, chunks.shape[1])
    n = max(1, min(chunks.shape[0], n_tokens // t))
    rows = np.linspace(0, chunks.shape[0] - 1, n).round().astype(int)
    return chunks[rows, :t]


def measurement_group(name: str) -> str:
    """Tensors measured together: a layer's ("layers.3"), or the head alone."""
    return name.rsplit(".", 1)[0] if name.startswith("layers.") else name


class SensitivityMeter:
    """The reference model on the sensitivity tokens, run once: each layer's input and the next-token
    distributions. measure_group() then runs each of a layer's tensors' replacement from that layer on
    (float32 log-probabilities: the KLs compared here are 1e-4 and up, far above float32's rounding). It
    is safe to call from several threads: it only reads what __init__ computed, and each value is
    computed the same way whichever thread runs it."""

    def __init__(self, spec: ModelSpec, reference: Mapping[str, np.ndarray], chunks: np.ndarray):
        self.spec, self.reference = spec, reference
        self.inputs = [embed(spec, reference["embed"], chunks)]
        for i in range(spec.n_layers):
            self.inputs.append(layer_forward(spec, i, layer_weights(reference, i), self.inputs[-1]))
        self.ref_logp = log_probs(spec, reference, self.inputs[-1], np.float32)
        self.ref_p = np.exp(self.ref_logp)       # mean_kl's first factor, computed once

    def measure(self, name: str, quantized: np.ndarray) -> float:
        """Mean KL(reference || reference with only `name` replaced by `quantized`)."""
        return self.measure_group({name: quantized})[name]

    def measure_group(self, replacements: Mapping[str, np.ndarray]) -> dict[str, float]:
        """measure() of several tensors of one layer (or of the head alone), each replaced on its own. The
        runs go through the layers after theirs as one batch: a layer's four runs of 128 tokens take
        ~20% less time as products of 512 rows than one by one."""
        spec, reference = self.spec, self.reference
        names = list(replacements)
        if len({measurement_group(n) for n in names}) != 1:
            raise ValueError(f"one layer's tensors at a time, not {names}")
        if names == ["lm_head"]:
            return {"lm_head": self._mean_kls({**reference, "lm_head": replacements["lm_head"]}, self.inputs[-1])[0]}
        layer = int(names[0].split(".")[1])
        runs = []
        for name in names:
            w = layer_weights(reference, layer)
            w[name.rsplit(".", 1)[1]] = replacements[name]
            runs.append(layer_forward(spec, layer, w, self.inputs[layer]))
        x = np.concatenate(runs)                          # [runs x chunks, T, D]
        for j in range(layer + 1, spec.n_layers):
            x = layer_forward(spec, j, layer_weights(reference, j), x)
        return dict(zip(names, self._mean_kls(reference, x)))

    def _mean_kls(self, weights: Mapping[str, np.ndarray], x: np.ndarray) -> list[float]:
        """The last layer's output of one or more runs, stacked along the chunk axis -> each run's mean
        KL(reference || run): forward.mean_kl of forward.log_probs in float32, worked in place."""
        spec = self.spec
        head = weights["embed"] if spec.tie_embeddings else weights["lm_head"]
        logits = final_hidden(spec, weights, x).reshape(-1, x.shape[-1]) @ head.T
        if spec.final_softcap:
            logits = np.tanh(logits / np.float32(spec.final_softcap)) * np.float32(spec.final_softcap)
        return self.kls_of_logits(logits)

    def kls_of_logits(self, logits: np.ndarray) -> list[float]:
        """Each run's mean KL(reference || run) from its logits, stacked [runs x rows, V] (overwritten)."""
        rows = self.ref_logp.shape[0]
        step = max(1, KL_ROWS_IN_CACHE // logits.shape[1])
        scratch = np.empty((step, logits.shape[1]), dtype=logits.dtype)
        per_row = np.empty(rows, dtype=np.float32)
        out = []
        for r in range(0, logits.shape[0], rows):
            # a few rows at a time, so that the eight passes over them stay in the core's cache (the
            # values are per row, so the same as over all rows at once)
            for a in range(0, rows, step):
                b = min(rows, a + step)
                logp, tmp = logits[r + a:r + b], scratch[:b - a]
                logp -= logp.max(axis=-1, keepdims=True)
                logp -= np.log(np.sum(np.exp(logp, out=tmp), axis=-1, keepdims=True))
                np.subtract(self.ref_logp[a:b], logp, out=logp)
                logp *= self.ref_p[a:b]
                np.sum(logp, axis=-1, out=per_row[a:b])
            out.append(float(np.mean(per_row)))
        return out


BACKGROUND_NICE = 19   # the niceness of the work beside the GPTQ thread (these measurements, nvcc)


def background_priority() -> None:
    """Lower the calling thread's scheduling priority (and that of the threads and processes it starts) to
    BACKGROUND_NICE. The GPTQ thread is the compile's critical path (each layer waits for the one before); the
    sensitivity measurements and nvcc can be done at any time before its end, so they take the CPU it leaves:
    at equal priority they took half its core while nvcc ran, and the compile ended with GPTQ's last layers
    alone on one core. Linux sets niceness per thread; elsewhere (or if refused) nothing changes."""
    import sys
    import threading
    if not sys.platform.startswith("linux"):     # elsewhere a thread id is no process id to renice
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), BACKGROUND_NICE))
    except (AttributeError, OSError):
        pass


class BackgroundMeasurements:
    """Sensitivities measured on worker threads while the caller goes on: the meter is built by a worker
    (make_meter: the reference model's run), then submit() each layer's tensors as soon as their
    quantized values exist. At most `beside` threads work at once until more_cores() (the caller's own
    work is done), then up to `after`. A context manager: leaving it cancels what has not started
    (after an error) and waits for what has."""

    def __init__(self, make_meter: Callable[[], SensitivityMeter], beside: int = 1,
                 after: int = min(2, os.cpu_count() or 1)):
        self.after = max(after, beside)
        self.slots = threading.Semaphore(beside)
        self.extra = self.after - beside
        self.pool = ThreadPoolExecutor(max_workers=self.after, initializer=background_priority)
        self.pending: dict[str, Future] = {}           # tensor -> its group's {tensor: KL}
        self.meter = self.pool.submit(self._in_slot, make_meter)

    def _in_slot(self, work: Callable[[], dict[str, float] | SensitivityMeter]):
        with self.slots:
            return work()

    def __enter__(self) -> "BackgroundMeasurements":
        return self

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def _measure(self, replacements: dict[str, np.ndarray]) -> dict[str, float]:
        meter = self.meter.result()                     # built by then: it was the first job
        return self._in_slot(lambda: meter.measure_group(replacements))

    def submit(self, replacements: dict[str, np.ndarray]) -> None:
        """One measurement group's tensors (measurement_group), by name."""
        job = self.pool.submit(self._measure, dict(replacements))
        for name in replacements:
            self.pending[name] = job

    def more_cores(self) -> None:
        for _ in range(self.extra):
            self.slots.release()
        self.extra = 0

    def results(self, names: list[str], progress: Progress | None = None) -> dict[str, float]:
        self.more_cores()
        p = progress or Progress(quiet=True)
        out = {}
        for n, name in enumerate(names, 1):
            out[name] = self.pending[name].result()[name]
            p.count("tensors measured", n, len(names))
        return out


class GroupCollector:
    """Hands tensors to BackgroundMeasurements a measurement group at a time: each group is submitted
    once all of its expected tensors have arrived (in the order they arrived, so the batch is the same
    on every run)."""

    def __init__(self, bg: BackgroundMeasurements, expected: list[str]):
        self.bg = bg
        self.left: dict[str, int] = {}
        for name in expected:
            self.left[measurement_group(name)] = self.left.get(measurement_group(name), 0) + 1
        self.waiting: dict[str, dict[str, np.ndarray]] = {}

    def add(self, name: str, values: np.ndarray) -> None:
        group = measurement_group(name)
        self.waiting.setdefault(group, {})[name] = values
        self.left[group] -= 1
        if self.left[group] == 0:
            self.bg.submit(self.waiting.pop(group))


def measure_sensitivity(spec: ModelSpec, reference: Mapping[str, np.ndarray], quantized: Mapping[str, np.ndarray],
                        chunks: np.ndarray, progress: Progress | None = None,
                        threads: int = min(2, os.cpu_count() or 1)) -> dict[str, float]:
    """Mean KL(reference || reference with one tensor replaced by its quantized values), per tensor.
    (The compiler overlaps these with the GPTQ pass instead: quantize_calibrated.py.)"""
    with BackgroundMeasurements(lambda: SensitivityMeter(spec, reference, chunks), threads, threads) as bg:
        collector = GroupCollector(bg, list(quantized))
        for name, values in quantized.items():
            collector.add(name, values)
        return bg.results(list(quantized), progress)


def choose_formats(spec: ModelSpec, formats: Mapping[str, str], budget: Budget,
                   sensitivity: Mapping[str, float], head_copy: bool = False) -> BudgetChoice:
    """Widen candidates to bf16 by sensitivity per extra byte while the weights fit the budget. head_copy: lm_head
    is an INT8 copy of a tied embedding table (impc/compile.py head_copy_spec)."""
    shapes = spec.tensor_shapes()
    base = weights_bytes(spec, dict(formats))
    if head_copy and budget.factor is not None:
        # a factor of the tied model's bytes, plus the copy: the body gets what it gets with the table as the head,
        # so the copy changes the head alone (its error, and half the head's bytes a step)
        copy = tensor_bytes(shapes["lm_head"], formats["lm_head"])
        limit = budget.bytes_for(base - copy) + copy
    else:
        # an INT8 head is budgeted as bf16: the bytes it saves go to the body (SmolLM2 untied, at a bf16 head's step
        # bytes: KL 0.030 against 0.044; scripts/head_int8_whole.py)
        ref = weights_bytes(spec, {**formats, "lm_head": "bf16"}) if formats.get("lm_head") == "int8" else base
        limit = budget.bytes_for(ref)
    if limit < base:
        raise CompileError(f"--budget {budget}: {limit / GiB:.3f} GiB is less than the all-NVFP4 weights "
                           f"({base / GiB:.3f} GiB)")
    extra = {t: tensor_bytes(shapes[t], "bf16") - tensor_bytes(shapes[t], "nvfp4") for t in sensitivity}
    order = sorted(sensitivity, key=lambda t: (-sensitivity[t] / extra[t], t))
    chosen, spent, widened = dict(formats), base, []
    for t in order:
        if sensitivity[t] > 0 and spent + extra[t] <= limit:
            chosen[t] = "bf16"
            spent += extra[t]
            widened.append(t)
    return BudgetChoice(chosen, base, limit, weights_bytes(spec, chosen), dict(sensitivity), widened)
