"""`impc bench BUNDLE`: decode and prefill throughput of a bundle on the GPU it runs on.

Reports decode tok/s at several batch sizes (tg: tokens generated per sequence after a short prompt; each
step is the step the server runs: step values in, one graph replay with the GPU sampler, the sampled ids
back; each launched before the last one's ids are read, its rows fed the ids the last one sampled on the
device, as the server's scheduler does where the executor can: the host's work on a step runs beside the
next. The same decode with each step written after the last one's ids are back, the host's time between
steps counted, is reported beside it as "host-serial"), prefill tok/s (pp: one prompt of that many tokens, chunked as
planned), time to first token (a 128-token prompt to its first token id on the host), load time, GPU
memory, and the weight bandwidth decode achieves at batch 1 as a fraction of the device-to-device copy
bandwidth measured in the same run (bytes read + written per second). Each figure is the median of
--runs runs. Needs the cuda executor (and so an NVIDIA GPU)."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure decode/prefill throughput of a bundle on this GPU",
                       description=__doc__)
    p.add_argument("bundle")
    p.add_argument("--batches", default="1,8,32,64", help="decode batch sizes (default 1,8,32,64)")
    p.add_argument("--tg", type=int, default=128, help="tokens generated per sequence (default 128)")
    p.add_argument("--pp", default="128,512,4096", help="prefill lengths (default 128,512,4096)")
    p.add_argument("--prompt", type=int, default=16, help="prompt length before a decode run (default 16)")
    p.add_argument("--mixed", default="", metavar="B:T,...",
                   help="mixed steps: B decode rows with a T-token prefill chunk of another sequence (after a "
                        "--prompt-long prefix) riding in the same launches, timed against the decode step and the "
                        "prefill run apart (default none)")
    p.add_argument("--runs", type=int, default=3, help="runs per figure; the median is reported (default 3)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(handler=cmd_bench)


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy: (read + write) bytes per second, median of reps."""
    from imp_runtime.cuda_driver import check, cu
    src = int(check(cu.cuMemAlloc(nbytes)))
    dst = int(check(cu.cuMemAlloc(nbytes)))
    try:
        st = check(cu.cuStreamCreate(0))
        check(cu.cuMemsetD8Async(src, 1, nbytes, st))
        e0, e1 = check(cu.cuEventCreate(0)), check(cu.cuEventCreate(0))
        times = []
        for i in range(reps + 2):
            check(cu.cuEventRecord(e0, st))
            check(cu.cuMemcpyDtoDAsync(dst, src, nbytes, st))
            check(cu.cuEventRecord(e1, st))
            check(cu.cuEventSynchronize(e1))
            if i >= 2:
                times.append(check(cu.cuEventElapsedTime(e0, e1)) / 1e3)
        return 2 * nbytes / statistics.median(times)
    finally:
        cu.cuMemFree(src)
        cu.cuMemFree(dst)


def decode_weight_bytes(bundle) -> int:
    """Bytes of weights one decode step reads: every tensor but the embedding table (only B rows of it are
    gathered), plus the table itself when it is also the output head."""
    from impc.plan import tensor_bytes
    total = 0
    for name, info in bundle.tensors.items():
        if name == "embed" and not bundle.spec.tie_embeddings:
            continue
        total += tensor_bytes(tuple(info["shape"]), info["format"])
    return total


def run_bench(bundle_path: str, batches: list[int], tg: int, pps: list[int], prompt: int, runs: int,
              log=lambda s: None, mixed: list[tuple[int, int]] = ()) -> dict:
    import numpy as np

    from imp_runtime.bundle import load_bundle
    from imp_runtime.cuda_driver import check, cu
    from imp_runtime.executor import PrefillChunk, StepRow
    from imp_runtime.executor_cuda import CudaExecutor, gpu_available
    from imp_runtime.kv_blocks import BlockManager, BlockTable
    from imp_runtime.sampler import SamplingParams

    if not gpu_available():
        raise SystemExit("impc bench: no NVIDIA GPU with a working driver")
    check(cu.cuInit(0))
    ctx = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(0))))
    check(cu.cuCtxSetCurrent(ctx))
    bw = copy_bandwidth()
    log(f"device copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    t0 = time.perf_counter()
    bundle = load_bundle(bundle_path)
    ex = CudaExecutor(bundle)
    load_s = time.perf_counter() - t0
    log(f"loaded {bundle.name} on {ex.gpu_name} ({ex.target}) in {load_s:.2f} s")
    blocks = BlockManager(ex.num_pages, ex.page_size)
    rng = np.random.default_rng(0)
    vocab = bundle.spec.vocab_size
    greedy = SamplingParams(temperature=0.0)
    res: dict = {"bundle": bundle.name, "gpu": ex.gpu_name, "target": ex.target, "load_s": load_s,
                 "copy_bandwidth_Bps": bw, "decode": {}, "prefill": {}, "runs": runs, "tg": tg,
                 "weights_bytes": ex.memory()["weights_bytes"], "decode_weight_bytes": decode_weight_bytes(bundle)}

    def sequence(n_tokens: int) -> tuple[int, BlockTable]:
        sid, table = ex.new_sequence(), BlockTable()
        if not blocks.grow(table, n_tokens):
            raise SystemExit(f"impc bench: the KV pool cannot hold {n_tokens} more tokens")
        ex.set_pages(sid, table.pages)
        return sid, table

    def release(sid: int, table: BlockTable) -> None:
        ex.free(sid)
        blocks.release(table)

    def decode_run(b: int, ahead: bool) -> float:
        """tok/s of tg steps of b sequences after a prompt-long prefill. ahead: each step launched before the last
        one's tokens are read, its rows fed on the device the tokens the last one sampled (the server's way where
        the executor feeds them: runtime/scheduler.py `ahead`), so the host's work on a step runs beside the next;
        else each step's values written after the last one's tokens are back (the host's time between steps
        counted)."""
        seqs = [sequence(prompt + tg + 2) for _ in range(b)]
        toks = [int(np.argmax(ex.prefill(sid, rng.integers(3, vocab, prompt).tolist(), 0))) for sid, _ in seqs]
        toks = ex.decode([StepRow(sid, tok, prompt, greedy) for (sid, _), tok in zip(seqs, toks)]).tokens  # warm-up
        pos = prompt + 1
        t = time.perf_counter()
        if ahead:
            last = None
            for i in range(tg):
                h = ex.decode_submit([StepRow(sid, None if i else tok, pos, greedy) for (sid, _), tok in zip(seqs, toks)])
                if last is not None:
                    ex.decode_collect(last)
                last, pos = h, pos + 1
            ex.decode_collect(last)
        else:
            for _ in range(tg):
                toks = ex.decode([StepRow(sid, tok, pos, greedy) for (sid, _), tok in zip(seqs, toks)]).tokens
                pos += 1
        dt = time.perf_counter() - t
        for seq in seqs:
            release(*seq)
        return b * tg / dt

    for b in batches:
        if b > ex.max_batch:
            continue
        rates, serial = [], []
        for _ in range(runs):
            serial.append(decode_run(b, False))
            rates.append(decode_run(b, True) if ex.feeds_sampled else serial[-1])
        res["decode"][str(b)] = {"tok_s": statistics.median(rates), "step_ms": 1e3 * b / statistics.median(rates),
                                 "serial_tok_s": statistics.median(serial), "ahead": bool(ex.feeds_sampled)}
        log(f"decode batch {b}: {statistics.median(rates):.1f} tok/s")
    for pp in pps:
        if pp + 1 > ex.max_context:
            continue
        times = []
        for r in range(runs + 1):
            seq = sequence(pp)
            toks = rng.integers(3, vocab, pp).tolist()
            t = time.perf_counter()
            int(np.argmax(ex.prefill(seq[0], toks, 0)))
            dt = time.perf_counter() - t
            release(*seq)
            if r:
                times.append(dt)
        res["prefill"][str(pp)] = {"tok_s": pp / statistics.median(times), "ms": 1e3 * statistics.median(times)}
        if pp == 128:
            res["ttft_ms"] = 1e3 * statistics.median(times)
        log(f"prefill {pp}: {pp / statistics.median(times):.0f} tok/s")
    steps = 8
    for b, t, nc in mixed:
        if b > ex.max_batch or b + t * nc > ex.prefill_buckets[-1] or nc > getattr(ex, "max_segments", 1):
            log(f"mixed {b}:{t}x{nc}: more rows or chunks than a prefill phase holds, skipped")
            continue
        seqs = [sequence(prompt + 2 * (steps + 1) * runs + 2) for _ in range(b)]
        others = [sequence(prompt + t) for _ in range(nc)]   # each chunk after a prompt-long prefix (a later chunk)
        for other in others:
            ex.prefill(other[0], rng.integers(3, vocab, prompt).tolist(), 0)
        chunk = rng.integers(3, vocab, t).tolist()
        toks = [int(np.argmax(ex.prefill(sid, rng.integers(3, vocab, prompt).tolist(), 0))) for sid, _ in seqs]
        pos, times = prompt, {"mixed": [], "apart": []}
        for _ in range(runs):
            for how in times:
                for i in range(steps + 1):             # the first step warms up
                    if i == 1:
                        t0 = time.perf_counter()
                    rows = [StepRow(sid, tok, pos, greedy) for (sid, _), tok in zip(seqs, toks)]
                    if how == "mixed":                 # the chunks' logits come back too, as prefill's do
                        chunks = [PrefillChunk(o[0], chunk, prompt, True) for o in others]
                        toks = ex.decode_collect(ex.decode_submit(rows, chunks)).tokens
                    else:
                        toks = ex.decode(rows).tokens if rows else []
                        for o in others:
                            ex.prefill(o[0], chunk, prompt)
                    pos += 1
                times[how].append((time.perf_counter() - t0) / steps)
        for seq in seqs + others:
            release(*seq)
        m, a = statistics.median(times["mixed"]), statistics.median(times["apart"])
        res.setdefault("mixed", {})[f"{b}:{t}x{nc}"] = {"mixed_ms": 1e3 * m, "apart_ms": 1e3 * a,
                                                       "decode_tok_s_mixed": b / m, "decode_tok_s_apart": b / a,
                                                       "prefill_tok_s_mixed": t * nc / m, "prefill_tok_s_apart": t * nc / a}
        log(f"mixed {b} rows + {nc} chunks of {t} tokens: {1e3 * m:.2f} ms a step, apart {1e3 * a:.2f} ms")
    mem = ex.memory()
    res["memory"] = mem
    res["peak_gpu_memory_bytes"] = mem["device_used_bytes"]
    b1 = res["decode"].get("1")
    if b1:
        achieved = res["decode_weight_bytes"] * b1["tok_s"]
        res["decode_b1_weight_bandwidth_Bps"] = achieved
        res["decode_b1_bandwidth_fraction"] = achieved / bw
    ex.close()
    return res


def _commit() -> str:
    try:
        h = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
        return h + ("+uncommitted" if dirty else "") if h else "unknown"
    except OSError:
        return "unknown"


def format_table(r: dict) -> str:
    lines = [f"bundle {r['bundle']} on {r['gpu']} ({r['target']}), median of {r['runs']} runs"]
    for b, d in r["decode"].items():
        serial = f"; host-serial steps {d['serial_tok_s']:.1f}" if d.get("ahead") else ""
        lines.append(f"  decode  batch {b:>3}  tg{r.get('tg', 128)}  {d['tok_s']:10.1f} tok/s  ({d['step_ms']:.2f} ms/step{serial})")
    for pp, d in r["prefill"].items():
        lines.append(f"  prefill pp{pp:<5}        {d['tok_s']:10.0f} tok/s  ({d['ms']:.1f} ms)")
    for bt, d in r.get("mixed", {}).items():
        b, tn = bt.split(":")
        t, n = tn.split("x")
        lines.append(f"  mixed   {b:>3} decode rows + {n} x {t}-token chunk  {d['mixed_ms']:.2f} ms a step "
                     f"(apart: {d['apart_ms']:.2f} ms = decode step + prefills)")
    if "ttft_ms" in r:
        lines.append(f"  time to first token (128-token prompt)  {r['ttft_ms']:.1f} ms")
    lines.append(f"  load {r['load_s']:.2f} s; GPU memory in use {r['peak_gpu_memory_bytes'] / 2**30:.2f} GiB "
                 f"(weights {r['memory']['weights_bytes'] / 2**30:.2f}, KV {r['memory']['kv_bytes'] / 2**30:.2f}, "
                 f"scratch {r['memory']['scratch_bytes'] / 2**30:.2f})")
    if "decode_b1_weight_bandwidth_Bps" in r:
        lines.append(f"  decode batch 1 weight bandwidth {r['decode_b1_weight_bandwidth_Bps'] / 1e12:.2f} TB/s = "
                     f"{100 * r['decode_b1_bandwidth_fraction']:.0f}% of the measured copy bandwidth "
                     f"{r['copy_bandwidth_Bps'] / 1e12:.2f} TB/s")
    return "\n".join(lines)


def _counts(flag: str, text: str, low: int) -> list[int]:
    """A comma-separated list of whole numbers of at least `low` (--batches, --pp); ValueError with what is wrong."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text}: give whole numbers separated by commas, e.g. 1,8,64") from None
    if any(v < low for v in out):
        raise ValueError(f"{flag} {text}: every value must be at least {low}")
    return out


def cmd_bench(a) -> int:
    try:
        batches = _counts("--batches", a.batches, 1)
        pps = _counts("--pp", a.pp, 1)
        for flag, v in (("--tg", a.tg), ("--runs", a.runs), ("--prompt", a.prompt)):
            if v < 1:
                raise ValueError(f"{flag} {v}: must be at least 1")
    except ValueError as e:
        print(f"impc bench: {e}", file=sys.stderr)
        return 2
    log = (lambda s: None) if a.json else (lambda s: print(s, file=sys.stderr, flush=True))
    try:      # B:T or B:TxN (N chunks of T tokens, each of its own sequence)
        mixed = [tuple(int(v) for v in x.replace("x", ":").split(":")) for x in a.mixed.split(",") if x]
        mixed = [m if len(m) == 3 else (*m, 1) for m in mixed]
        if any(len(m) != 3 or m[0] < 0 or min(m[1:]) < 1 or m[0] + m[2] < 2 for m in mixed):
            raise ValueError
    except ValueError:
        print(f"impc bench: --mixed {a.mixed}: give B:T or B:TxN (B decode rows, N chunks of T tokens), e.g. "
              f"64:128,64:448,0:512x4",
              file=sys.stderr)
        return 2
    r = run_bench(a.bundle, batches, a.tg, pps, a.prompt, a.runs, log, mixed)
    r["commit"] = _commit()
    r["date"] = time.strftime("%Y-%m-%d")
    print(json.dumps(r, indent=1) if a.json else format_table(r))
    return 0
