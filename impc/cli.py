"""`impc`: compile a checkpoint into a bundle, run it, inspect it (and serve/bench where built)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _add_compile(sub) -> None:
    p = sub.add_parser("compile", help="compile a checkpoint into a bundle",
                       description="Read a checkpoint, quantize it, plan GPU memory, emit kernels, write a bundle.")
    p.add_argument("model", nargs="?", help="a .gguf file, a Hugging Face folder, or the name 'smollm2'")
    p.add_argument("--synthetic", default=None, metavar="CONFIG.json",
                   help="build from a config.json alone: no weights stored, the GPU runtime generates them from --seed")
    p.add_argument("--seed", type=int, default=0, help="seed of --synthetic weights (default 0)")
    p.add_argument("-o", "--output", required=True, type=Path, help="bundle directory to write")
    p.add_argument("--quant", default="nvfp4", choices=["nvfp4", "bf16"], help="linear weights' format (default nvfp4)")
    p.add_argument("--quant-embed", action="store_true", help="store the embedding table in NVFP4 too (default bf16)")
    p.add_argument("--quant-head", action="store_true",
                   help="store an untied output head in NVFP4 too, a byte-budget candidate (default bf16: NVFP4 "
                        "costs KL 0.03 alone on SmolLM2's head, for 17%% fewer bytes a step on an 8B model; "
                        "at the step bytes of --budget 1 it is the closer to bf16); the same as --head-format nvfp4")
    p.add_argument("--head-format", default=None, choices=["auto", "bf16", "int8", "nvfp4"],
                   help="an untied output head's format (default auto: int8 for an NVFP4 model, else bf16): int8 "
                        "(a scale a row) costs KL 0.0017 on SmolLM2's head alone and reads half the head's bytes; "
                        "the byte budget counts it as bf16, so at the same step bytes the bundle's KL is 0.030 "
                        "against 0.044 with a bf16 head (scripts/head_int8_whole.py); nvfp4 is --quant-head. A "
                        "tied head is the embedding table (bf16, or NVFP4 with --quant-embed); int8 stores an INT8 "
                        "copy of it as the head (half the table's bytes more memory, half the head's bytes a step)")
    p.add_argument("--scale-search", action="store_true",
                   help="search each block's E4M3 scale for the least squared error (default: amax / 6)")
    p.add_argument("--no-calib", dest="calibrate", action="store_false",
                   help="round NVFP4 to nearest, without calibration (faster; default: GPTQ on calibration data)")
    p.add_argument("--calib", default=None, metavar="FILE",
                   help="calibration data: a text file, or a .json list of chat conversations (default: built in)")
    p.add_argument("--budget", default="1.3", metavar="X|GiB",
                   help="weight bytes: a factor of the all-NVFP4 bytes, or a size like 0.2GiB; the tensors whose "
                        "quantization costs most accuracy stay bf16 within it (default 1.3; 1 for all NVFP4)")
    p.add_argument("--target", default=None,
                   help="GPU targets, comma-separated (default sm_90a,sm_120a); 'none' for a cpu-only bundle")
    p.add_argument("--vram", type=float, default=None, metavar="GiB",
                   help="GPU memory to plan for (default: the target's, sm_90a 141, sm_120a 32)")
    p.add_argument("--max-context", type=int, default=None, metavar="N",
                   help="longest sequence in tokens (default: the model's, at most 32768)")
    p.add_argument("--max-batch", type=int, default=64, metavar="N", help="most sequences decoded at once (default 64)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="most prompt tokens one prefill call (and one scheduler step) takes, as vLLM's "
                        "--max-num-batched-tokens: larger chunks run the prefill GEMMs nearer the tensor-core rate, "
                        "smaller ones keep other streams' decode steps shorter (default: the target's, sm_90a 4096, "
                        "sm_120a 512, halved where it does not fit; at most --max-context)")
    p.add_argument("--name", default=None,
                   help="model name the bundle serves under (default: the checkpoint's file or folder name)")
    p.add_argument("--gemv-max-rows", type=int, default=None, metavar="N", choices=[0, 1, 2, 4, 8, 16],
                   help="decode batches of up to N rows use the tensor-core GEMV, larger ones the GEMM (default by "
                        "the shape, as measured: on Hopper 4 for hidden sizes of 4096 and up and 8 below when the "
                        "NVFP4 decode GEMM takes every layer, else 8 for 4096 and up and 16 below). 0: every decode "
                        "batch on the GEMMs, the output head's too; where that GEMM takes every layer (Hopper, layer "
                        "K multiples of 256) a sequence's logits then do not depend on the batch it runs in "
                        "(batch-invariant decode, slower at few rows)")
    p.add_argument("--no-pdl", dest="pdl", action="store_false",
                   help="no programmatic dependent launch in the decode graphs (default: on)")
    p.add_argument("--prefill-split-k", action="store_true",
                   help="atomic split-K in prefill GEMMs: faster small chunks, not bitwise reproducible (default off)")
    p.add_argument("--prefill-weights", default="auto", choices=["auto", "copy", "dequant"],
                   help="Hopper prefill reads NVFP4 layer weights from an fp16 copy expanded at load (copy), or "
                        "expands each just before its GEMM every chunk (dequant; no extra memory); auto: copy when "
                        "the copies take at most a quarter of the GPU memory (default auto)")
    p.add_argument("--decode-gemm", default="nvfp4", choices=["nvfp4", "fp16"],
                   help="Hopper decode batches past the GEMV's rows: a GEMM reading the NVFP4 weights as stored "
                        "(nvfp4), or the fp16 copies prefill reads (fp16; needs --prefill-weights copy) (default nvfp4)")
    p.add_argument("--prefill-gemm", default="auto", choices=["auto", "tiles", "cutlass"],
                   help="Hopper prefill GEMMs of chunks past 256 rows: auto (the persistent ping-pong GEMM) or "
                        "tiles (one block a 128 x 256 tile); cutlass: CUTLASS 3.x's persistent ping-pong kernel for the "
                        "layers' plain and residual GEMMs (needs `pip install --no-deps nvidia-cutlass==4.2.0.0`; "
                        "opt-in: 3-6%% slower than auto on the 8B shape's NVFP4 prefill, BENCHMARKS.md)")
    p.add_argument("--rope-in-attention", action=argparse.BooleanOptionalAction, default=None,
                   help="decode: the attention kernel computes q/k norm and RoPE and appends the new key and value "
                        "itself, one launch a layer fewer (default: by the model's shape, on for head dims up to 64 "
                        "without q/k norm, where the launch it saves costs more than the work it moves at every "
                        "context measured; a Qwen3-8B shape gains ~1%% at short contexts with it and loses up to "
                        "5.6%% at 2,048; BENCHMARKS.md)")
    p.add_argument("--norm-tail", action=argparse.BooleanOptionalAction, default=True,
                   help="Hopper decode: the RMSNorm after the o and down projections in the tail of their GEMM past "
                        "the GEMV's rows (a block a row once all have finished; default on); --no-norm-tail keeps it a "
                        "launch of its own, for GPUs (MIG slices) with no more SMs than the batch has rows, where the "
                        "bundle refuses to load otherwise")
    p.add_argument("--norm-partials", action=argparse.BooleanOptionalAction, default=True,
                   help="Hopper decode at 1-4 rows: the same RMSNorm as partial sums in the epilogues of the streamed "
                        "GEMVs around it, no launch of its own (default on; BENCHMARKS.md: b1 +8.5%%)")
    p.add_argument("--norm-prologue-bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="one-row decode: the RMSNorm in the prologue of the GEMVs of bf16 weights too (the byte budget's "
                        "bf16 projections), as NVFP4 ones have it, instead of a launch before them (default on; "
                        "BENCHMARKS.md: SmolLM2 shape all bf16, b1 +6.4%%); --no-norm-prologue-bf16 keeps the launch")
    p.add_argument("--gemv-ring-unroll", action=argparse.BooleanOptionalAction, default=True,
                   help="Hopper decode at one row: gate_up's and down's streamed GEMVs with their stage loops "
                        "unrolled over a tile where it is one revolution of the ring (gate_up) or a block's one tile "
                        "(down) (constant slots and offsets; the same bits; default on: 8B shape b1 +0.6%% and +0.9%%, "
                        "BENCHMARKS.md thirty-third session); --no-gemv-ring-unroll keeps the rolled loops")
    p.add_argument("--qkv-rope-tail", action=argparse.BooleanOptionalAction, default=True,
                   help="Hopper decode at one row where the qkv projection runs the three-blocks-an-SM streamed GEMV "
                        "(the 8B shape): q/k norm, RoPE and the paged KV write in that launch's tail, one launch a "
                        "layer fewer (default on: b1 +0.5%%); --no-qkv-rope-tail keeps the qkv_rope launch")
    p.add_argument("--gemv-pair", action=argparse.BooleanOptionalAction, default=False,
                   help="Hopper decode at one row (the 8B shape): o and gate_up, and down and the next layer's qkv, "
                        "each pair in one launch with a grid barrier between, the second GEMV's weights streaming "
                        "under the first; a GPU that cannot hold a pair's grid at once (fewer SMs than the target's, "
                        "or shared by MPS) runs the two launches instead (off by default: measured slower on an H200, "
                        "8B shapes b1 -5.5 to -6.8%%; the o/gate_up pair alone level with the default, the down/qkv "
                        "pair alone -6.7%%; BENCHMARKS.md)")
    p.add_argument("--gemv-pair-only", choices=("o-gate-up", "down-qkv"), default="",
                   help="--gemv-pair with one of its two pairs only (implies --gemv-pair): o-gate-up, o and gate_up; "
                        "down-qkv, down and the next layer's qkv")
    p.add_argument("--attn-head-ready", action=argparse.BooleanOptionalAction, default=False,
                   help="Hopper decode at one row with the qkv projection's rope tail (the 8B shape): the decode "
                        "attention's blocks of a kv head start once its q, key and value are stored, instead of "
                        "waiting for the whole qkv launch (off by default: measured slower at one row, H200 -2.2%%, "
                        "H100 -1.6%%; not with --gemv-pair)")
    p.add_argument("--prefill-qkv-epilogue", action=argparse.BooleanOptionalAction, default=False,
                   help="Hopper prefill chunks past 256 rows: q/k norm, RoPE and the paged KV write in the qkv GEMM's "
                        "epilogue instead of a launch after it (heads of 64 or 128; off by default: measured no "
                        "faster on an H200, BENCHMARKS.md)")
    p.add_argument("--prefill-attention", default="wgmma", choices=["wgmma", "mma"],
                   help="Hopper prefill attention: on warpgroup MMA (wgmma; head dims that are multiples of 64, up to "
                        "256) or on mma.sync (mma, what other GPUs and head dims use) (default wgmma)")
    p.add_argument("--gpu-penalties", action=argparse.BooleanOptionalAction, default=True,
                   help="apply repetition / presence / frequency penalties on the GPU, before its sampler (per-"
                        "sequence token counts kept on the device; default on); with --no-gpu-penalties such "
                        "requests are sampled on the host, their logits copied back each step (8 streams with a "
                        "frequency penalty served 21%% fewer tokens a second that way, BENCHMARKS.md)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")


def _add_sampling(p) -> None:
    p.add_argument("--max-tokens", type=int, default=512, metavar="N")
    p.add_argument("--temperature", type=float, default=None, help="0 is greedy (default: the bundle's or 0.7)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _add_run(sub) -> None:
    p = sub.add_parser("run", help="generate from a bundle in the terminal",
                       description="Render the chat template, generate, and stream tokens as they come. "
                                   "Without --prompt: an interactive chat.")
    p.add_argument("bundle", type=Path)
    p.add_argument("--prompt", default=None, help="one user message; omit for an interactive chat")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--raw", action="store_true", help="use the prompt as is, without the chat template")
    p.add_argument("--stats", action="store_true", help="print tokens/s after each answer")
    _add_sampling(p)


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="describe a bundle",
                       description="Model, dimensions, quantization and its error, memory plan, targets, kernels, hashes.")
    p.add_argument("bundle", type=Path)
    p.add_argument("--json", action="store_true", help="print the whole manifest (with --program: the program's launches)")
    p.add_argument("--program", action="store_true",
                   help="print the launch program: per decode bucket and prefill chunk, every launch with its grid "
                        "and the bytes it reads and writes")
    p.add_argument("--target", default=None, help="which target's program (default: the bundle's first)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="impc", description="imp: an LLM inference engine built like a compiler.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_compile(sub)
    _add_run(sub)
    _add_inspect(sub)
    for extra in ("impc.cli_serve", "impc.cli_bench", "impc.cli_eval"):     # commands from later stages, where present
        try:
            __import__(extra, fromlist=["add_parser"]).add_parser(sub)
        except ImportError:
            pass
    return ap


# ------------------------------------------------------------------ commands


def program_options(a):
    """The launch program's options from the compile flags (each field's flag of its name); a combination the
    options refuse (impc/launches.py ProgramOptions) as a compile error, not a traceback."""
    import dataclasses

    from impc.errors import CompileError
    from impc.launches import ProgramOptions
    try:
        return ProgramOptions(**{f.name: getattr(a, f.name) for f in dataclasses.fields(ProgramOptions)})
    except ValueError as e:
        raise CompileError(str(e)) from None


def cmd_compile(a) -> int:
    from impc.compile import CompileOptions, compile_model
    from impc.progress import Progress

    if (a.model is None) == (a.synthetic is None):
        from impc.errors import CompileError
        raise CompileError("give either MODEL or --synthetic CONFIG.json")
    if a.gemv_pair_only:
        a.gemv_pair = True
    opts = CompileOptions(model=a.model or a.synthetic, out=a.output, quant=a.quant, quant_embed=a.quant_embed,
                          quant_head=a.quant_head, head_format=a.head_format or "auto", scale_search=a.scale_search,
                          calibrate=a.calibrate, calib=a.calib, budget=a.budget, targets=a.target, vram_gib=a.vram,
                          max_context=a.max_context, max_batch=a.max_batch, prefill_chunk=a.prefill_chunk,
                          name=a.name, prefill_weights=a.prefill_weights,
                          # the launch program's options: each ProgramOptions field from the flag of its name
                          program=program_options(a))
    if a.synthetic:
        from impc.synthetic import compile_synthetic
        compile_synthetic(a.synthetic, opts, seed=a.seed, progress=Progress(quiet=a.quiet))
    else:
        compile_model(opts, Progress(quiet=a.quiet))
    if not a.quiet:
        print(f"bundle written to {a.output}", file=sys.stderr)
    return 0


def sampling_params(a, engine):
    from imp_runtime.sampler import SamplingParams

    d = engine.generation_defaults
    pick = lambda v, key, default: v if v is not None else d.get(key, default)  # noqa: E731
    return SamplingParams(max_tokens=a.max_tokens, temperature=pick(a.temperature, "temperature", 0.7),
                          top_p=pick(a.top_p, "top_p", 1.0), top_k=pick(a.top_k, "top_k", 0),
                          min_p=pick(a.min_p, "min_p", 0.0),
                          repetition_penalty=pick(a.repetition_penalty, "repetition_penalty", 1.0),
                          seed=a.seed, stop=a.stop)


def _answer(engine, ids: list[int], params, stats: bool) -> str:
    t0 = time.perf_counter()
    first = None
    n = cached = 0
    parts = []
    for ev in engine.generate(ids, params):      # through the engine's scheduler, with its prefix cache
        if first is None:
            first, cached = time.perf_counter(), ev.cached_tokens
        n += 1
        parts.append(ev.text)
        print(ev.text, end="", flush=True)
    print()
    if stats and first is not None:
        t1 = time.perf_counter()
        rate = (n - 1) / (t1 - first) if n > 1 else 0.0
        print(f"[{len(ids)} prompt tokens ({cached} from the prefix cache), {n} generated; "
              f"first token {1000 * (first - t0):.0f} ms, "
              f"{rate:.1f} tok/s after it; {engine.executor.name} executor]", file=sys.stderr)
    return "".join(parts)


def cmd_run(a) -> int:
    from imp_runtime.engine import Engine

    engine = Engine(a.bundle, device=a.device)
    params = sampling_params(a, engine)
    history: list[dict] = [{"role": "system", "content": a.system}] if a.system else []
    if a.prompt is not None:
        ids = engine.tokenizer.encode(a.prompt) if a.raw else engine.encode_chat(history + [{"role": "user", "content": a.prompt}])
        _answer(engine, ids, params, a.stats)
        return 0
    print(f"imp chat with {engine.name} ({engine.executor.name} executor); empty line or Ctrl-D to quit",
          file=sys.stderr)
    while True:
        try:
            text = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not text.strip():
            return 0
        history.append({"role": "user", "content": text})
        reply = _answer(engine, engine.encode_chat(history), params, a.stats)
        history.append({"role": "assistant", "content": reply})


def cmd_inspect(a) -> int:
    import json

    from imp_runtime.bundle import load_bundle
    from impc.plan import describe

    b = load_bundle(a.bundle)
    m = b.manifest
    if a.program:
        return _inspect_program(b, a.target, a.json)
    if a.json:
        print(json.dumps(m, indent=1, sort_keys=True))
        return 0
    s = b.spec
    print(f"bundle   {a.bundle}  (name {m['name']}, format {m['format_version']})")
    copy = m["quantization"].get("head_copy_of_embed", False)      # (the copy is no parameter of the model)
    print(f"model    {s.family}: {s.n_layers} layers, hidden {s.hidden}, heads {s.n_heads}/{s.n_kv_heads} x {s.head_dim}, "
          f"ffn {s.intermediate}, vocab {s.vocab_size}, {(s.n_params() - copy * s.vocab_size * s.hidden) / 1e6:.1f}M params")
    tied = "True (the head an INT8 copy of the table)" if copy else s.tie_embeddings
    print(f"         rope theta {s.rope_theta:g} ({s.rope_scaling.kind}), tied {tied}, qkv bias {s.qkv_bias}, "
          f"qk norm {s.qk_norm}, activation {s.activation}, sliding window {s.sliding_window or 'none'}")
    q = m["quantization"]
    by_fmt: dict[str, list] = {}
    for name, e in q["tensors"].items():
        by_fmt.setdefault(e["format"], []).append(e)
    print(f"quant    {q['mode']} (embed {q['embed']}, head {q['lm_head']}): " +
          ", ".join(f"{len(v)} {k}" for k, v in sorted(by_fmt.items())))
    cal = q.get("calibration")
    if cal:
        print(f"         calibration: {json.dumps({k: v for k, v in cal.items() if k != 'widened'})}")
        if cal.get("widened"):
            print(f"         kept in bf16 by the byte budget: {', '.join(cal['widened'])}")
    for fmt in ("nvfp4", "int8", "bf16"):
        errs = [e["rel_rms"] for e in by_fmt.get(fmt, []) if "rel_rms" in e]   # (none: synthetic weights)
        if errs:
            print(f"         {fmt} error ||W-Q||/||W||: mean {sum(errs) / len(errs):.4f}, max {max(errs):.4f}")
    for line in describe(m["plan"]):
        print(f"plan     {line}")
    k = m["kernels"]
    print(f"targets  {', '.join(k['targets']) or 'none (cpu only)'}")
    for t in k["targets"]:
        print(f"kernels  {t}: {', '.join(k['functions'][t])}")
    for rel, digest in sorted(m["files"].items()):
        size = (b.path / rel).stat().st_size
        print(f"file     {rel:28s} {size / 2**20:9.2f} MiB  sha256 {digest[:16]}")
    print(f"build    imp {m['build']['imp_version']}, source {m['build']['source']} "
          f"(sha256 {(m['build']['checkpoint_sha256'] or '-')[:16]}), nvcc {(m['build']['compiler'] or {}).get('nvcc', '-')}")
    return 0


def _inspect_program(bundle, target: str | None, as_json: bool) -> int:
    """The compiler's disassembly: each decode bucket's and the prefill chunk's launches."""
    import json

    from imp_runtime.bundle import BundleError
    from imp_runtime.program import evaluate

    k = bundle.manifest["kernels"]
    if not k["targets"]:
        raise BundleError(f"{bundle.path}: a cpu-only bundle has no launch program")
    prog = bundle.program(target or k["targets"][0])
    target = prog.target
    buckets = []
    for ph in prog.phases:
        if ph.phase not in ("decode", "prefill"):
            continue
        env = dict(prog.symbols, rows=ph.tokens)
        buckets.append({"phase": ph.phase, "tokens": ph.tokens, "launches": [
            {"kernel": x.kernel, "grid": [evaluate(g, env) for g in x.grid], "block": list(x.block), "smem": x.smem,
             "reads": sum(n for _, n in x.reads), "writes": sum(n for _, n in x.writes),
             **({"fallback": [f.kernel for f in x.fallback]} if x.fallback else {})} for x in ph.launches]})
    if as_json:
        print(json.dumps({"target": target, "buckets": buckets}, indent=1))
        return 0
    print(f"launch program for {target}: arena {prog.arena_bytes / 2**30:.2f} GiB, options {prog.options} "
          f"(attention's KV reads grow with the context and are not counted)")
    for bk in buckets:
        reads = sum(x["reads"] for x in bk["launches"])
        writes = sum(x["writes"] for x in bk["launches"])
        print(f"{bk['phase']} {bk['tokens']}: {len(bk['launches'])} launches, reads {reads / 2**20:.2f} MiB, "
              f"writes {writes / 2**20:.2f} MiB")
        for i, x in enumerate(bk["launches"]):
            print(f"  {i:4d} {x['kernel']:26s} grid {str(tuple(x['grid'])):16s} block {str(tuple(x['block'])):14s} "
                  f"smem {x['smem']:6d}  reads {x['reads']:>11,d}  writes {x['writes']:>11,d}"
                  + (f"  (where its grid cannot be resident: {' + '.join(x['fallback'])})" if "fallback" in x else ""))
    return 0


COMMANDS = {"compile": cmd_compile, "run": cmd_run, "inspect": cmd_inspect}


def main(argv: list[str] | None = None) -> int:
    from impc.errors import CompileError
    from imp_runtime.bundle import BundleError
    from imp_runtime.chat_template import TemplateError
    from imp_runtime.engine import RequestError

    args = build_parser().parse_args(argv)
    handler = COMMANDS.get(args.command) or args.handler
    try:
        return handler(args)
    except (CompileError, BundleError, RequestError, TemplateError) as e:
        print(f"impc {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
