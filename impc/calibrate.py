"""Calibrated NVFP4: the calibration tokens, and GPTQ layer by layer on activations they produce.

Calibration data (impc/data/, public domain or written for this project, see its README) is English
prose plus chat conversations rendered with the model's own chat template, so the statistics cover the
text a served model reads. `--calib FILE` replaces it: a plain-text file, or a JSON list of
conversations (each a list of {"role", "content"} messages).

The quantizer is sequential (the GPTQ paper's way): the calibration chunks run through the model one
layer at a time; inside a layer each linear's inputs are collected (H = X^T X), the linear is
quantized by GPTQ within the NVFP4 grid, and the chunks continue through the quantized linear, so each
layer compensates for the error of the layers before it as the served model will see them.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from impc.errors import CompileError
from impc.forward import embed, final_hidden, layer_forward, layer_weights
from impc.gptq import gptq_nvfp4_with_error, output_energy
from impc.progress import Progress
from impc.quantize import NVFP4Tensor
from imp_runtime.chat_template import ChatTemplate, TemplateError
from imp_runtime.spec import ModelSpec
from imp_runtime.tokenizer import Tokenizer

DATA_DIR = Path(__file__).parent / "data"
BUILTIN_TEXT = DATA_DIR / "calibration.txt"
BUILTIN_CHATS = DATA_DIR / "calibration_chats.json"
CHUNK_TOKENS = 512       # tokens per calibration chunk (each chunk starts at position 0)
MAX_TOKENS = 8192        # calibration tokens used at most (the rest of a long --calib file is ignored)


@dataclass
class CalibrationSet:
    chunks: np.ndarray          # int64 [C, T] token ids
    source: str                 # "builtin" or the --calib file's name
    sha256: str                 # of the text and conversations as read

    @property
    def n_tokens(self) -> int:
        return int(self.chunks.size)


def read_calibration(path: str | None) -> tuple[str, list[list[dict]], str]:
    """(prose, conversations, source name) from the built-in data or a --calib file."""
    if path is None:
        return BUILTIN_TEXT.read_text(), json.loads(BUILTIN_CHATS.read_text()), "builtin"
    f = Path(path)
    try:
        raw = f.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise CompileError(f"--calib {path}: cannot read it ({e.__class__.__name__})") from None
    if f.suffix == ".json":
        try:
            chats = json.loads(raw)
            ok = isinstance(chats, list) and all(isinstance(c, list) and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in c) for c in chats)
        except json.JSONDecodeError:
            ok = False
        if not ok:
            raise CompileError(f"--calib {path}: a .json file must be a list of conversations, each a list of "
                               '{"role": ..., "content": ...} messages')
        return "", chats, f.name
    return raw, [], f.name


def calibration_set(tokenizer_json: str, tok_info: dict, chat_template: str | None, path: str | None = None,
                    chunk_tokens: int = CHUNK_TOKENS, max_tokens: int = MAX_TOKENS) -> CalibrationSet:
    """Tokenize the calibration data into equal chunks: the prose (after BOS where the model expects
    one), then every conversation as the chat template renders it, cut every chunk_tokens tokens."""
    import hashlib

    text, chats, source = read_calibration(path)
    tok = Tokenizer(tokenizer_json, tok_info)
    ids: list[int] = []
    if text.strip():
        ids += ([tok.bos_id] if tok.add_bos and tok.bos_id is not None else []) + tok.encode(text)
    template = ChatTemplate(chat_template, tok_info.get("bos_token"), tok_info.get("eos_token"))
    for conv in chats:
        try:
            ids += tok.encode(template.render(conv, add_generation_prompt=False))
        except TemplateError as e:
            raise CompileError(f"calibration conversation cannot be rendered with the model's chat template: {e}")
    ids = ids[:max_tokens]
    if len(ids) < 16:
        raise CompileError(f"calibration data from {source} holds {len(ids)} tokens: give at least a few hundred")
    t = min(chunk_tokens, len(ids))
    chunks = np.asarray(ids[:len(ids) // t * t], dtype=np.int64).reshape(-1, t)
    digest = hashlib.sha256((text + json.dumps(chats, sort_keys=True)).encode()).hexdigest()
    return CalibrationSet(chunks, source, digest)


@dataclass
class CalibratedModel:
    tensors: dict[str, NVFP4Tensor]                       # every NVFP4 linear, GPTQ-quantized
    output_error: dict[str, float] = field(default_factory=dict)   # relative output error on calibration
    layer_seconds: list[float] = field(default_factory=list)


def relative_output_error(w: np.ndarray, error: float, hessian: np.ndarray) -> float:
    """sqrt(tr(dW H dW^T) / tr(W H W^T)) given the numerator: the change of the linear's outputs on the
    calibration inputs, relative to the outputs."""
    ref = output_energy(w, hessian)
    return float(np.sqrt(max(error, 0.0) / ref)) if ref > 0 else 0.0


def calibrate(spec: ModelSpec, weights: Mapping[str, np.ndarray], formats: Mapping[str, str],
              calib: CalibrationSet, progress: Progress | None = None,
              on_quantized: Callable[[str, np.ndarray], None] | None = None) -> CalibratedModel:
    """GPTQ every NVFP4 linear of the layers (and an NVFP4 untied head) on the calibration chunks,
    sequentially. weights hold float32 values: the checkpoint's for NVFP4 tensors, the stored values
    for the others (bf16-rounded where bf16). on_quantized(name, dequantized values) is called as each
    tensor is done (the byte budget measures it meanwhile)."""
    from concurrent.futures import ThreadPoolExecutor
    from impc.budget import background_priority

    p = progress or Progress(quiet=True)
    out = CalibratedModel({})
    errors = {}

    def quantize(name: str, inputs: np.ndarray) -> np.ndarray:
        w = weights[name]
        if formats[name] != "nvfp4":
            return w
        h = (inputs.T @ inputs).astype(np.float64)          # float32 products, float64 from here on
        res = gptq_nvfp4_with_error(w, h)
        deq = res.tensor.dequantize()
        out.tensors[name] = res.tensor
        # a diagnostic nothing here waits for: computed beside the sequential GPTQ (its critical path)
        errors[name] = side.submit(relative_output_error, w, res.weighted_error, h)
        if on_quantized:
            on_quantized(name, deq)
        return deq

    with ThreadPoolExecutor(max_workers=1, initializer=background_priority) as side:
        x = embed(spec, weights["embed"], calib.chunks)
        for i in range(spec.n_layers):
            t0 = time.perf_counter()
            x = layer_forward(spec, i, layer_weights(weights, i), x,
                              lambda short, inputs: quantize(f"layers.{i}.{short}", inputs))
            out.layer_seconds.append(time.perf_counter() - t0)
            p.count("layers calibrated", i + 1, spec.n_layers)
        if formats.get("lm_head") == "nvfp4":
            hidden = final_hidden(spec, weights, x)
            quantize("lm_head", hidden.reshape(-1, spec.hidden))
        out.output_error = {name: f.result() for name, f in errors.items()}
    return out
