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

from impc import __version__
from impc.checkpoint import CompileError
from impc.compile import CompileOptions, tensor_formats
from impc.emit import compiler_record, emit, template_hashes
from impc.families import family_for
from impc.plan import describe, plan_memory
from impc.progress import Progress
from impc.targets import parse_targets
from impc.write_bundle import check_output_dir, write_bundle


def stub_tokenizer_json(vocab_size: int) -> str:
    """A word-level tokenizer over w0..w255 (ids below the model's vocabulary): enough for `impc run`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, min(256, vocab_size)):
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
    family = family_for(config)
    spec = family.spec(config)
    p.stage(f"synthetic {spec.family} from {path.name}")
    p.info(f"{spec.n_layers} layers, hidden {spec.hidden}, heads {spec.n_heads}/{spec.n_kv_heads}, head_dim "
           f"{spec.head_dim}, vocab {spec.vocab_size}, {spec.n_params() / 1e9:.2f}B parameters (weights from seed {seed})")
    formats = tensor_formats(spec, opts)
    targets = parse_targets(opts.targets)
    if not targets:
        raise CompileError("a synthetic bundle needs a GPU target (its weights are generated on the GPU)")
    p.stage("plan memory")
    plan = plan_memory(spec, formats, targets, opts.vram_gib, opts.max_context, opts.max_batch)
    for line in describe(plan):
        p.info(line)
    p.stage(f"emit kernels for {', '.join(t['name'] for t in targets)}")
    emitted = emit(spec, targets, plan)
    for e in emitted:
        p.info(f"{e.target}: {len(e.kernels)} kernels, {len(e.cubin) / 1024:.0f} KiB{' (cached)' if e.cached else ''}")
    quant = {name: {"format": formats[name], "shape": list(shape)} for name, shape in spec.tensor_shapes().items()}
    manifest = {
        "name": opts.name or out.name,
        "model": spec.to_dict(),
        "synthetic": {"seed": int(seed), "config": path.name},
        "quantization": {"mode": opts.quant, "embed": formats["embed"], "lm_head": formats.get("lm_head", "tied"),
                         "tensors": quant},
        "tokenizer": {"file": "tokenizer.json", "chat_template": None, "bos_token": "<s>", "eos_token": "</s>",
                      "pad_token": None, "unk_token": "<unk>", "eos_token_ids": [2], "add_bos": False},
        "generation": {},
        "plan": plan,
        "kernels": {"targets": [e.target for e in emitted],
                    "cubins": {e.target: f"kernels/{e.target}.cubin" for e in emitted},
                    "functions": {e.target: e.kernels for e in emitted}},
        "build": {"imp_version": __version__, "source": path.name, "checkpoint_sha256": "synthetic",
                  "options": {"quant": opts.quant, "quant_embed": opts.quant_embed, "quant_head": opts.quant_head,
                              "targets": [t["name"] for t in targets], "vram_gib": opts.vram_gib,
                              "max_context": opts.max_context, "max_batch": opts.max_batch, "seed": int(seed)},
                  "compiler": compiler_record(), "templates": template_hashes()},
    }
    p.stage(f"write {out}")
    write_bundle(out, manifest, {}, {"tokenizer.json": stub_tokenizer_json(spec.vocab_size)},
                 {f"kernels/{e.target}.cubin": e.cubin for e in emitted})
    p.stage("done")
    return manifest
