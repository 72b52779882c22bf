"""`impc compile`: the pipeline, stage by stage: load -> spec -> quantize -> plan -> emit -> bundle."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from impc import __version__
from impc.checkpoint import load_checkpoint
from impc.errors import CompileError
from impc.cutlass import add_cutlass, cutlass_root
from impc.emit import Emitted, compiler_record, emit, nvcc_path, template_hashes
from impc.families import family_for
from impc.launches import ProgramOptions, build_program, kernels_not_launched
from impc.plan import describe, plan_memory
from impc.progress import Progress
from impc.quantize import bf16_values, measure_error, quantize_int8_rows, quantize_nvfp4, to_bf16_bits
from impc.targets import parse_targets
from impc.write_bundle import check_output_dir, write_bundle
from imp_runtime.spec import ModelSpec, is_linear

GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class CompileOptions:
    model: str
    out: Path
    quant: str = "nvfp4"             # nvfp4 | bf16
    quant_embed: bool = False        # NVFP4 for the embedding table too
    quant_head: bool = False         # NVFP4 for an untied output head too (= head_format "nvfp4")
    head_format: str = "auto"        # an untied output head's format: auto (int8) | bf16 | int8 | nvfp4 (quant_head)
    scale_search: bool = False       # per-block search for the E4M3 scale of least squared error
    calibrate: bool = True           # GPTQ on calibration activations (nvfp4 only); False: round to nearest
    calib: str | None = None         # calibration data file (default: impc/data/)
    budget: str = "1.3"              # weight bytes: a factor of the all-NVFP4 bytes ("1.3") or a size ("0.2GiB")
    targets: str | None = None       # "sm_90a,sm_120a" (default both) or "none"
    vram_gib: float | None = None
    max_context: int | None = None
    max_batch: int = 64
    prefill_chunk: int | None = None   # most prompt tokens one prefill call takes (None: the target's)
    name: str | None = None          # served model name (default: the checkpoint's file or folder name)
    prefill_weights: str = "auto"    # Hopper prefill's NVFP4 weights: auto | copy | dequant (impc/arena_layout.py)
    # the launch program's options (--gemv-max-rows, --pdl, ...: impc/launches.py ProgramOptions, one field each)
    program: ProgramOptions = dataclasses.field(default_factory=ProgramOptions)

    def __post_init__(self):
        # --quant-head is --head-format nvfp4: each implies the other, and any other head format with it is refused
        # here, when the options are made (before a checkpoint is read)
        if self.quant_head and self.head_format not in ("auto", "nvfp4"):
            raise CompileError(f"--quant-head is --head-format nvfp4; it contradicts --head-format {self.head_format}")
        if self.quant_head and self.head_format == "auto":
            self.head_format = "nvfp4"
        if self.head_format == "nvfp4":
            self.quant_head = True

    def omitted_kernels(self, spec: ModelSpec, targets: list[dict]) -> dict[str, frozenset[str]]:
        """Per target, the kernels no program of these options launches (emit leaves them out of the cubin)."""
        return {t["name"]: kernels_not_launched(spec, t, self.program) for t in targets}


def tensor_formats(spec: ModelSpec, opts: CompileOptions) -> dict[str, str]:
    """Which stored format each canonical tensor gets. Norms and biases stay float32; the embedding
    and the head stay bf16 unless asked. The head by measurement (scripts/head_quality.py, SmolLM2's
    real head): NVFP4 it costs KL 0.032 alone even GPTQ'd (0.122 as a tied table rounded), against
    0.044 for the whole calibrated body; at the default budget's step bytes, the bf16 head with the
    body's bf16 tensors gives KL 0.044, the NVFP4 head with more of the body in bf16 0.055. INT8 with a
    scale a row (scripts/head_8bit_quality.py) costs KL 0.0014 alone for half the bf16 head's bytes; it is
    never a GPTQ or byte-budget candidate, and applies with --quant bf16 too."""
    if opts.quant not in ("nvfp4", "bf16"):
        raise CompileError(f"--quant {opts.quant}: choose nvfp4 or bf16")
    head = head_format(spec, opts)
    formats = {}
    for name in spec.tensor_shapes():
        if not is_linear(name):
            formats[name] = "f32"
        elif name == "lm_head":
            formats[name] = head if opts.quant == "nvfp4" or head == "int8" else "bf16"
        elif opts.quant == "bf16":
            formats[name] = "bf16"
        elif name == "embed":
            formats[name] = "nvfp4" if opts.quant_embed else "bf16"
        else:
            formats[name] = "nvfp4"
    return formats


def head_format(spec: ModelSpec, opts: CompileOptions) -> str:
    """The untied head's format asked for (--head-format, --quant-head), checked against the model. auto (the
    default): INT8 for an untied head of an NVFP4 model, by measurement (scripts/head_int8_whole.py, SmolLM2's
    real weights untied): at the step bytes of a bf16 head the bundle's KL is 0.030 instead of 0.044 (the byte
    budget counts an INT8 head as bf16, impc/budget.py, so the bytes it saves go to the body), and without a budget
    (--no-calib, synthetic weights) a step reads half the head's bytes (the 8B shape: b1 +5.8%, b8 +3.8% on the
    H200); bf16 for --quant bf16, and for a tied head (the embedding table): an INT8 copy of it (head_copy_spec,
    --head-format int8) measured KL 0.0513 against 0.0494 on SmolLM2 (the same body; impc eval, 2,000 tokens) for a
    step only 1.6% faster at one row on the H200 (BENCHMARKS.md, twenty-seventh session)."""
    fmt = opts.head_format
    if fmt == "auto":
        return "bf16" if spec.tie_embeddings or opts.quant == "bf16" else "int8"
    if fmt not in ("bf16", "int8", "nvfp4"):
        raise CompileError(f"--head-format {fmt}: choose auto, bf16, int8 or nvfp4")
    if fmt == "int8" and spec.tie_embeddings and opts.quant_embed:
        raise CompileError("--head-format int8 with --quant-embed: this model's head is tied, and an NVFP4 table "
                           "is its own head; drop one of the two")
    return fmt


def head_copy_spec(spec: ModelSpec, opts: CompileOptions) -> ModelSpec:
    """The spec a bundle is built for: a tied head whose format is INT8 is stored apart from the table, as an
    untied head made from the embedding (the table stays bf16 for the lookups; the copy costs half the table's
    bytes of memory); a step reads half the head's bytes."""
    if spec.tie_embeddings and head_format(spec, opts) == "int8":
        return dataclasses.replace(spec, tie_embeddings=False)
    return spec


def with_head_copy(tensors, head_copy: bool):
    """The checkpoint's tensors, and the embedding again as lm_head where head_copy_spec untied the head."""
    for name, w in tensors:
        yield name, w
        if head_copy and name == "embed":
            yield "lm_head", w


def describe_spec(spec: ModelSpec) -> str:
    return (f"{spec.family}: {spec.n_layers} layers, hidden {spec.hidden}, heads {spec.n_heads}/{spec.n_kv_heads}, "
            f"head_dim {spec.head_dim}, vocab {spec.vocab_size}, {spec.n_params() / 1e6:.1f}M parameters")


def plan_stage(spec: ModelSpec, opts: CompileOptions, p: Progress,
               formats: dict[str, str] | None = None) -> tuple[dict[str, str], list[dict], dict]:
    """Stage 4, before anything is quantized or written: formats, targets, the memory plan (planned
    again with the formats the byte budget chose, when it widened any)."""
    formats = formats or tensor_formats(spec, opts)
    targets = parse_targets(opts.targets)
    p.stage("plan memory")
    plan = plan_memory(spec, formats, targets, opts.vram_gib, opts.max_context, opts.max_batch, opts.prefill_weights,
                       opts.program.gpu_penalties, opts.prefill_chunk, opts.program.gemv_pair)
    for line in describe(plan):
        p.info(line)
    return formats, targets, plan


def quantize_stage(spec: ModelSpec, tensors, formats: dict[str, str], opts: CompileOptions,
                   p: Progress, checkpoint=None, head_copy: bool = False) -> Quantized:
    """Stage 3: every canonical tensor into its stored format, with the error each introduced. With
    calibration (NVFP4 and a checkpoint's tokenizer at hand): GPTQ on the calibration activations and
    the byte budget's choice of tensors kept in bf16 (impc/quantize_calibrated.py)."""
    p.stage(f"quantize ({opts.quant})")
    shapes = spec.tensor_shapes()
    calibrated = None
    if opts.calibrate and opts.quant == "nvfp4" and checkpoint is not None:
        from impc.quantize_calibrated import quantize_calibrated
        calibrated = quantize_calibrated(spec, tensors, formats, opts, checkpoint, p, head_copy)
        tensors, formats = calibrated.weights.items(), calibrated.formats
    arrays: dict[str, np.ndarray] = {}
    quant: dict[str, dict] = {}

    def store(item: tuple[str, np.ndarray]) -> tuple[str, dict, dict[str, np.ndarray]]:
        """One tensor's stored arrays and manifest entry (a function of that tensor alone)."""
        name, w = item
        if tuple(w.shape) != shapes[name]:
            raise CompileError(f"tensor {name} has shape {tuple(w.shape)}, the config implies {shapes[name]}")
        fmt = formats[name]
        entry: dict = {"format": fmt, "shape": list(w.shape)}
        if calibrated and name in calibrated.output_error:
            entry.update(calibrated.output_error[name])
        if fmt == "nvfp4":
            q = calibrated.tensors[name] if calibrated and name in calibrated.tensors else quantize_nvfp4(w, opts.scale_search)
            stored = {name + ".codes": q.codes, name + ".scales": q.scales, name + ".tscale": q.tscale}
            err = measure_error(w, q.dequantize())
            entry.update(rel_rms=round(err.rel_rms, 6), max_abs=float(np.float32(err.max_abs)))
        elif fmt == "int8":
            q = quantize_int8_rows(w)
            stored = {name + ".codes": q.codes, name + ".rscale": q.rscale}
            err = measure_error(w, q.dequantize())
            entry.update(rel_rms=round(err.rel_rms, 6), max_abs=float(np.float32(err.max_abs)))
        elif fmt == "bf16":
            stored = {name: to_bf16_bits(w)}
            err = measure_error(w, bf16_values(w))
            entry.update(rel_rms=round(err.rel_rms, 6), max_abs=float(np.float32(err.max_abs)))
        else:
            stored = {name: np.ascontiguousarray(w, dtype=np.float32)}
        return name, entry, stored

    # two tensors at a time (numpy leaves the lock for the long passes), a few ahead at most (the checkpoint's
    # tensors may be read one at a time); stored in the checkpoint's order whatever finishes first
    for i, (name, entry, stored) in enumerate(ordered_map(store, tensors, workers=2, ahead=4), 1):
        arrays.update(stored)
        quant[name] = entry
        p.count("tensors", i, len(shapes))
    missing = set(shapes) - set(quant)
    if missing:
        raise CompileError(f"checkpoint lacks tensors for {sorted(missing)[:3]}")
    errs = [e["rel_rms"] for e in quant.values() if e["format"] == "nvfp4"]
    if errs:
        p.info(f"NVFP4 error ||W-Q||/||W||: mean {np.mean(errs):.4f}, max {np.max(errs):.4f} over {len(errs)} tensors")
    for name, e in quant.items():
        if e["format"] == "int8":
            p.info(f"INT8 (a scale a row) error ||W-Q||/||W|| of {name}: {e['rel_rms']:.4f}")
    return Quantized(arrays, quant, formats, calibrated.record if calibrated else None)


def ordered_map(fn, items, workers: int = 2, ahead: int = 4):
    """fn over items on `workers` threads, results yielded in the items' order, at most `ahead` items taken
    from the iterable before their results are yielded."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque = deque()
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= ahead:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()


@dataclass
class Quantized:
    arrays: dict[str, np.ndarray]      # what the weights file stores, by key
    tensors: dict[str, dict]           # the manifest's entry per canonical tensor
    formats: dict[str, str]            # the stored format per tensor (the budget may have widened some)
    calibration: dict | None           # how calibration and the budget ran, for the manifest


def emit_stage(spec: ModelSpec, targets: list[dict], plan: dict, p: Progress,
               emitted: list[Emitted] | None = None) -> list[Emitted]:
    """Stage 5 (or its result, when nvcc already ran alongside quantization)."""
    p.stage(f"emit kernels for {', '.join(t['name'] for t in targets) or 'no GPU target (cpu only)'}")
    if emitted is None:
        emitted = emit(spec, targets, plan)
    for e in emitted:
        p.info(f"{e.target}: {len(e.kernels)} kernels, {len(e.cubin) / 1024:.0f} KiB{' (cached)' if e.cached else ''}")
    return emitted


def program_stage(spec: ModelSpec, formats: dict[str, str], targets: list[dict], plan: dict,
                  emitted: list[Emitted], opts: CompileOptions, p: Progress, seed: int | None = None) -> dict[str, bytes]:
    """Stage 4b: each target's launch program, validated against its cubin, as the bundle's files."""
    from imp_runtime.program import dumps
    files = {}
    for t, e in zip(targets, emitted):
        prog = build_program(spec, formats, t, plan, opts.program, set(e.kernels), seed)
        step = prog.phase("decode", prog.buckets("decode")[0])
        p.info(f"{t['name']}: launch program, {len(step.launches)} launches a batch-1 decode step, "
               f"arena {prog.arena_bytes / 2**30:.2f} GiB ({prog.constants['kv_pages']} KV pages)")
        if opts.program.prefill_gemm == "cutlass" and t["name"] == "sm_90a":
            n = sum(x.kernel.startswith("cutlass_") for ph in prog.phases for x in ph.launches)
            p.info(f"{t['name']}: {n} prefill launches on CUTLASS's GEMM" if n else
                   f"{t['name']}: --prefill-gemm cutlass: no GEMM qualifies (bf16 weights in prefill phases past "
                   "256 rows only, so far); the others run imp's")
        files[program_file(t["name"])] = dumps(prog).encode()
    return files


def cutlass_file(target: str) -> str:
    return f"kernels/{target}.cutlass.cubin"


def kernel_files(emitted: list[Emitted]) -> dict[str, bytes]:
    """The bundle's cubins: one a target, and the CUTLASS kernels' beside it where built."""
    files = {f"kernels/{e.target}.cubin": e.cubin for e in emitted}
    files.update({cutlass_file(e.target): e.cutlass for e in emitted if e.cutlass})
    return files


def program_file(target: str) -> str:
    return f"program/{target}.json"


def default_name(source: Path) -> str:
    """The served model name of a checkpoint: its folder's name, or its file's without the extension."""
    return source.name[:-len(source.suffix)] if source.is_file() and source.suffix else source.name


def build_manifest(opts: CompileOptions, spec: ModelSpec, formats: dict[str, str], quant: dict[str, dict],
                   tokenizer: dict, generation: dict, plan: dict, emitted: list[Emitted], source: str,
                   checkpoint_sha256: str, calibration: dict | None = None, name: str | None = None,
                   head_copy: bool = False, **extra) -> dict:
    return {
        "name": opts.name or name or source,
        "model": spec.to_dict(),
        **extra,
        "quantization": {"mode": opts.quant, "scale_search": opts.scale_search, "embed": formats["embed"],
                         "lm_head": formats.get("lm_head", "tied"), "head_copy_of_embed": head_copy,
                         "calibration": calibration, "tensors": quant},
        "tokenizer": tokenizer,
        "generation": generation,
        "plan": plan,
        "kernels": {"targets": [e.target for e in emitted],
                    "cubins": {e.target: f"kernels/{e.target}.cubin" for e in emitted},
                    **({"cutlass_cubins": {e.target: cutlass_file(e.target) for e in emitted if e.cutlass}}
                       if any(e.cutlass for e in emitted) else {}),
                    "functions": {e.target: e.kernels for e in emitted},
                    "programs": {e.target: program_file(e.target) for e in emitted}},
        "build": {"imp_version": __version__, "source": source, "checkpoint_sha256": checkpoint_sha256,
                  "options": {"quant": opts.quant, "quant_embed": opts.quant_embed, "quant_head": opts.quant_head,
                              "head_format": opts.head_format,
                              "scale_search": opts.scale_search, "calibrate": opts.calibrate,
                              "calib": Path(opts.calib).name if opts.calib else None, "budget": opts.budget, "targets": [e.target for e in emitted],
                              "vram_gib": opts.vram_gib, "max_context": opts.max_context,
                              "max_batch": opts.max_batch, "prefill_weights": opts.prefill_weights,
                              **opts.program.to_dict(), **{k: v for k, v in extra.get("synthetic", {}).items()
                                                              if k == "seed"}},
                  "compiler": compiler_record() if emitted else None,
                  "templates": template_hashes()},
    }


def compile_model(opts: CompileOptions, progress: Progress | None = None) -> dict:
    p = progress or Progress(quiet=True)
    out = Path(opts.out)
    check_output_dir(out)

    p.stage(f"load {opts.model}")
    ck = load_checkpoint(opts.model)
    family = family_for(ck.config)
    ck_spec = family.spec(ck.config)
    spec = head_copy_spec(ck_spec, opts)
    head_copy = spec is not ck_spec
    p.info(describe_spec(ck_spec))
    if head_copy:
        p.info("the tied head stored apart in INT8 (the embedding table stays bf16): --head-format bf16 keeps it tied")
    formats, targets, plan = plan_stage(spec, opts, p)
    # The kernels depend on the model's shape and the targets only (not on the formats the byte budget picks),
    # so nvcc runs in its own process while the weights are quantized: the two longest stages overlap.
    from concurrent.futures import ThreadPoolExecutor
    if targets:
        nvcc_path()                   # a missing compiler is said now, not after quantization
        if opts.program.prefill_gemm == "cutlass":
            cutlass_root()            # ... and missing CUTLASS headers
    from impc.budget import background_priority
    from impc.quantize_calibrated import one_malloc_arena
    one_malloc_arena()
    with ThreadPoolExecutor(max_workers=1, initializer=background_priority) as nvcc_pool:
        omit = opts.omitted_kernels(spec, targets)
        kernels = nvcc_pool.submit(emit, spec, targets, plan, omit)
        q = quantize_stage(spec, with_head_copy(family.tensors(ck_spec, ck), head_copy), formats, opts, p, ck,
                           head_copy=head_copy)
        if q.formats != formats:
            formats, targets, plan = plan_stage(spec, opts, p, q.formats)
        arrays, quant = q.arrays, q.tensors
        emitted = add_cutlass(emit_stage(spec, targets, plan, p, kernels.result()), opts.program.prefill_gemm, p)
    programs = program_stage(spec, formats, targets, plan, emitted, opts, p)

    p.stage(f"write {out}")
    texts = {"tokenizer.json": ck.tokenizer_json}
    if ck.chat_template:
        texts["chat_template.jinja"] = ck.chat_template
    tokenizer = {"file": "tokenizer.json", "chat_template": "chat_template.jinja" if ck.chat_template else None,
                 **ck.special_tokens, "eos_token_ids": ck.eos_token_ids, "add_bos": ck.add_bos}
    generation = {k: ck.generation_config[k] for k in GENERATION_KEYS if k in ck.generation_config}
    manifest = build_manifest(opts, spec, formats, quant, tokenizer, generation, plan, emitted,
                              source=Path(ck.path).name, checkpoint_sha256=ck.source_hash(), calibration=q.calibration,
                              name=default_name(Path(ck.path)), head_copy=head_copy)
    write_bundle(out, manifest, arrays, texts, {**kernel_files(emitted), **programs})
    p.stage("done")
    return manifest
