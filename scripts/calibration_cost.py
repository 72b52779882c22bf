"""What calibrated quantization costs per layer, measured, and extrapolated to an 8B model.

Measures, for the first --layers layers of two models: the sequential GPTQ pass (forward of the
calibration chunks, Hessians, GPTQ of the four linears) and the sensitivity pass (one KL measurement
per tensor, a layer's four run as one batch), in seconds per layer and peak Python-heap bytes above the
weights (tracemalloc sees numpy's buffers). Models: SmolLM2-135M (its real weights and the built-in
calibration data) and the Qwen3-0.6B shape (examples/qwen3-0.6b.json, random weights and tokens: the
cost does not depend on the values).
Then scales each cost by its FLOPs to examples/qwen3-8b.json: forward and Hessians by tokens x layer
parameters, GPTQ by N x K^2 per linear, sensitivity by tensors x the layers after them.

  python scripts/calibration_cost.py [--layers 2]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
import tracemalloc
from pathlib import Path

import numpy as np

from impc.budget import measure_sensitivity, sensitivity_chunks
from impc.calibrate import CHUNK_TOKENS, CalibrationSet, calibrate, calibration_set
from impc.families import family_for
from impc.forward import LINEARS
from impc.quantize import quantize_nvfp4
from imp_runtime.spec import ModelSpec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def spec_of(config: str) -> ModelSpec:
    cfg = json.loads((EXAMPLES / config).read_text())
    return family_for(cfg).spec(cfg)


def smollm2(layers: int) -> tuple[ModelSpec, dict, CalibrationSet]:
    from impc.checkpoint import load_checkpoint

    ck = load_checkpoint("smollm2")
    family = family_for(ck.config)
    spec = family.spec(ck.config)
    weights = {}
    for name, w in family.tensors(spec, ck):
        weights[name] = np.ascontiguousarray(w, dtype=np.float32)
    info = {**ck.special_tokens, "eos_token_ids": ck.eos_token_ids, "add_bos": ck.add_bos}
    return (dataclasses.replace(spec, n_layers=layers), weights,
            calibration_set(ck.tokenizer_json, info, ck.chat_template))


def random_model(config: str, layers: int, tokens: int) -> tuple[ModelSpec, dict, CalibrationSet]:
    spec = dataclasses.replace(spec_of(config), n_layers=layers)
    rng = np.random.default_rng(0)
    weights = {name: (rng.standard_normal(shape, dtype=np.float32) * (0.02 if len(shape) == 2 else 1) +
                      (0 if len(shape) == 2 else 1)).astype(np.float32) for name, shape in spec.tensor_shapes().items()}
    chunks = rng.integers(0, spec.vocab_size, (tokens // CHUNK_TOKENS, CHUNK_TOKENS))
    return spec, weights, CalibrationSet(chunks, "random", "")


def measure(spec: ModelSpec, weights: dict, calib: CalibrationSet) -> dict:
    formats = {n: ("nvfp4" if n.split(".")[-1] in LINEARS else "f32") for n in weights}
    formats["embed"] = "bf16"
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    cal = calibrate(spec, weights, formats, calib)
    gptq_s = time.perf_counter() - t0
    gptq_peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.reset_peak()
    cands = [n for n in cal.tensors]
    quantized = {n: quantize_nvfp4(weights[n]).dequantize() for n in cands}
    t0 = time.perf_counter()
    measure_sensitivity(spec, weights, quantized, sensitivity_chunks(calib.chunks))
    sens_s = time.perf_counter() - t0
    sens_peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return {"tokens": calib.n_tokens, "gptq_s_per_layer": gptq_s / spec.n_layers, "gptq_peak_bytes": gptq_peak,
            "sensitivity_s": sens_s, "sensitivity_peak_bytes": sens_peak}


def gptq_flops(spec: ModelSpec, tokens: int) -> float:
    """One layer: forward and Hessians (float32) plus GPTQ's N x K^2 (float64, counted twice)."""
    shapes = spec.linear_shapes().values()
    forward = 2 * tokens * sum(n * k for n, k in shapes)
    hessians = 2 * tokens * sum(k * k for n, k in shapes)
    return forward + hessians + 2 * sum(n * k * k for n, k in shapes)


def sensitivity_flops(spec: ModelSpec, tokens: int) -> float:
    """Every layer's four tensors, each through the layers from its own on, plus the head each time."""
    layer = 2 * tokens * sum(n * k for n, k in spec.linear_shapes().values())
    head = 2 * tokens * spec.vocab_size * spec.hidden
    runs = sum(4 * (spec.n_layers - i) for i in range(spec.n_layers))
    return runs * layer + 4 * spec.n_layers * head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    a = ap.parse_args()
    target = spec_of("qwen3-8b.json")
    rows = {}
    spec, w, calib = smollm2(a.layers)
    rows["SmolLM2-135M"] = (spec, measure(spec, w, calib))
    spec, w, calib = random_model("qwen3-0.6b.json", a.layers, 5632)
    rows["Qwen3-0.6B shape"] = (spec, measure(spec, w, calib))
    for name, (spec, m) in rows.items():
        t, ts = m["tokens"], 128
        gptq_rate = gptq_flops(spec, t) / m["gptq_s_per_layer"]
        sens_rate = sensitivity_flops(spec, ts) / m["sensitivity_s"]
        full = target
        print(f"{name}: {t} calibration tokens; GPTQ pass {m['gptq_s_per_layer']:.2f} s/layer, peak "
              f"{m['gptq_peak_bytes'] / 2**20:.0f} MiB above the weights; sensitivity of {4 * spec.n_layers} tensors "
              f"over {spec.n_layers} layers {m['sensitivity_s']:.2f} s, peak {m['sensitivity_peak_bytes'] / 2**20:.0f} MiB; "
              f"rates {gptq_rate / 1e9:.0f} / {sens_rate / 1e9:.0f} GFLOP/s")
        g8 = gptq_flops(full, t) / gptq_rate
        s8 = sensitivity_flops(full, ts) / sens_rate
        print(f"  -> Qwen3-8B at these rates: GPTQ {g8:.0f} s/layer x {full.n_layers} = {g8 * full.n_layers / 60:.0f} min, "
              f"sensitivity {s8 / 60:.0f} min")


if __name__ == "__main__":
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):      # as the compiler runs it
        main()
