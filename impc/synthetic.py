"""`impc compile --synthetic CONFIG.json`: a bundle of a model's shape without its weights.

The config is a Hugging Face config.json (examples/ holds Qwen3-8B, Qwen3-0.6B and Llama-3.1-8B).
Everything a real bundle has is built (spec, memory plan, kernels, a stub tokenizer) except the weights
file: the manifest records `"synthetic": {"seed": N}` and the cuda executor fills every tensor on the
GPU at load with deterministic random NVFP4 codes and sane scales (templates/synthetic.cu.j2), so a
bundle of a few hundred KiB benchmarks an 8B model without moving gigabytes. The cpu executor cannot
run such a bundle (it has no values to read).
"""
from __future__ import annotations

import json
from pathlib import Path

from impc.errors import CompileError
from impc.compile import (CompileOptions, build_manifest, describe_spec, emit_stage, head_copy_spec, kernel_files,
                          plan_stage, program_stage)
from impc.cutlass import add_cutlass
from impc.emit import emit
from impc.families import family_for
from impc.progress import Progress
from impc.write_bundle import check_output_dir, write_bundle


def stub_tokenizer_json(vocab_size: int) -> str:
    """A word-level tokenizer with a word for every id of the model's vocabulary ("w3" is id 3), so every
    token the synthetic model samples detokenizes to text and the bundle can be served and streamed
    (prompts are words "w5 w17 ..." or arrays of ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok.to_str()


def compile_synthetic(config_path: str | Path, opts: CompileOptions, seed: int = 0,
                      progress: Progress | None = None) -> dict:
    p = progress or Progress(quiet=True)
    out = Path(opts.out)
    check_output_dir(out)
    path = Path(config_path)
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CompileError(f"{path}: cannot read the config ({e})") from None
    if "text_config" in config and "hidden_size" not in config:
        config = {**config["text_config"], "model_type": config["text_config"].get("model_type", "gemma3_text")}
    ck_spec = family_for(config).spec(config)
    spec = head_copy_spec(ck_spec, opts)       # a tied head's INT8 copy: generated as an untied head of its own
    p.stage(f"synthetic {spec.family} from {path.name} (weights from seed {seed})")
    p.info(describe_spec(ck_spec))
    formats, targets, plan = plan_stage(spec, opts, p)
    if not targets:
        raise CompileError("a synthetic bundle needs a GPU target (its weights are generated on the GPU)")
    emitted = add_cutlass(emit_stage(spec, targets, plan, p, emit(spec, targets, plan, opts.omitted_kernels(spec, targets))),
                          opts.program.prefill_gemm, p)
    programs = program_stage(spec, formats, targets, plan, emitted, opts, p, seed=int(seed))
    quant = {name: {"format": formats[name], "shape": list(shape)} for name, shape in spec.tensor_shapes().items()}
    tokenizer = {"file": "tokenizer.json", "chat_template": None, "bos_token": "<s>", "eos_token": "</s>",
                 "pad_token": None, "unk_token": "<unk>", "eos_token_ids": [2], "add_bos": False}
    manifest = build_manifest(opts, spec, formats, quant, tokenizer, {}, plan, emitted, source=path.name,
                              checkpoint_sha256="synthetic", name=path.stem, head_copy=spec is not ck_spec,
                              synthetic={"seed": int(seed), "config": path.name})
    p.stage(f"write {out}")
    write_bundle(out, manifest, {}, {"tokenizer.json": stub_tokenizer_json(spec.vocab_size)},
                 {**kernel_files(emitted), **programs})
    p.stage("done")
    return manifest
