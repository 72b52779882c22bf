"""The launch program: what the compiler decided about one target, as the runtime reads it.

A bundle holds one program per GPU target (`program/<target>.json`, hashed by the manifest like every
file). It has two parts:
- the **arena**: one device allocation cut into named buffers (weights, constants, the block tables, the
  per-step values the host sends, scratch, the KV pool), each with offset, bytes, dtype and shape;
- the **phases**: per decode batch bucket, per prefill chunk and per logits bucket, the ordered kernel
  launches with grid, block, dynamic shared memory, programmatic dependent launch, the arguments, and the
  bytes each launch reads and writes (per buffer).

An argument is a buffer reference (`{"ptr": name, "offset": v}`, or `{"ptr": null}` for a null pointer),
a TMA descriptor over a buffer (`{"tmap": {"ptr", "dtype", "rows", "cols", "box_rows", "box_cols"}}`, built by
the runtime at bind time, passed by value), a CUTLASS kernel's Params (`{"cutlass": {"table", "rows", "A", "W",
"C", "D"}}` and, for a scaled kernel, "scale": the bytes, descriptors and pointers of `constants["cutlass"][table]` over
those buffers, impc/cutlass.py) or a scalar (`{"i32": v}`, `{"u32": n}`, `{"u64": n}`, `{"f32": x}`). A value v is an int or a per-step
symbol `{"sym": name, "mul": a, "ceil_div": d, "add": c}` = ceil(sym * a / d) + c. Decode phases use no
symbols (their per-step values live in the `step` buffers, so a phase is captured once as a CUDA graph);
prefill and logits phases use `rows` (rows of x in this call), `dec` and `prows` (a prefill call's
decode rows riding along, rows 0 .. dec-1, and its chunk's tokens, rows dec .. rows-1), `start` (position of the
chunk's first token), `slot` (the chunk's sequence's block-table row), `row0` (first row of x the logits are
taken from), `schunks` (the prompt-ending chunks whose first token the call samples) and `srows` (= dec + schunks,
the rows of its head and sampler). `symbols` gives each symbol's largest value, which validation uses to bound every reference; a
launch whose grid evaluates to zero blocks at a step's values is skipped that step. A launch may carry `fallback`
launches doing its work where its own cannot run (a grid-barrier launch on a GPU that cannot hold its whole grid at
once: `unfuse`).

`validate` is run by the compiler before it writes a bundle and by the runtime when it loads one, so a
corrupted or inconsistent program is a one-line error, never a wild pointer on the GPU.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import numpy as np

ALIGN = 256
VERSION = 2          # 2: symbol expressions may carry a "range" (launches gated on a step's rows); an older runtime
READS = (1, 2)       # would run every alternative, so it must refuse such a program
PHASES = ("init", "decode", "prefill", "logits")
KINDS = ("weight", "const", "table", "step", "scratch", "kv")
DTYPES = {"u8": 1, "u16": 2, "bf16": 2, "f16": 2, "i32": 4, "f32": 4, "u64": 8}


class ProgramError(ValueError):
    """A launch program that is inconsistent; the message says what and where."""


@dataclass(frozen=True)
class Buffer:
    name: str
    offset: int
    bytes: int
    dtype: str
    shape: tuple[int, ...]
    kind: str
    values: tuple[float, ...] | None = None      # kind "const": the contents, uploaded at load


@dataclass(frozen=True)
class Launch:
    kernel: str
    grid: tuple                # of values
    block: tuple[int, ...]
    smem: int
    pdl: bool
    args: tuple[dict, ...]
    reads: tuple[tuple[str, int], ...]
    writes: tuple[tuple[str, int], ...]
    # the launches that do this one's work where it cannot run: a launch whose blocks wait for each other (a grid
    # barrier: --gemv-pair) needs them all resident at once, and a GPU with fewer SMs than the target's cannot hold
    # them; the runtime runs these instead (unfuse). Empty for every other launch (and then not written).
    fallback: tuple["Launch", ...] = ()


@dataclass(frozen=True)
class Phase:
    phase: str                 # init | decode | prefill | logits
    tokens: int                # rows: the batch of a decode bucket, the chunk of a prefill, the rows of logits
    launches: tuple[Launch, ...]


@dataclass
class Program:
    target: str
    arena_bytes: int
    buffers: dict[str, Buffer]
    phases: list[Phase]
    symbols: dict[str, int]
    kernel_smem: dict[str, int]        # kernel -> dynamic shared memory it is allowed (set at load)
    constants: dict                    # geometry the executor needs: page_size, max_pages, max_seqs, ...
    options: dict                      # the compile options that shaped the program

    def phase(self, name: str, tokens: int) -> Phase:
        for p in self.phases:
            if p.phase == name and p.tokens == tokens:
                return p
        raise KeyError(f"no {name} phase for {tokens} tokens")

    def buckets(self, name: str) -> list[int]:
        return sorted(p.tokens for p in self.phases if p.phase == name)

    def step_region(self) -> tuple[int, int]:
        """(offset, bytes) of the contiguous step buffers: the host sends them in one copy per step."""
        step = [b for b in self.buffers.values() if b.kind == "step"]
        lo = min(b.offset for b in step)
        hi = max(b.offset + b.bytes for b in step)
        return lo, hi - lo

    def step_pack(self) -> list[tuple[int, int]]:
        """A decode step's packed values (impc/arena_layout.py step_pack; [] for programs compiled before them): (byte
        offset in the step region, 4-byte words a row) of each array, in the order they are packed."""
        if "step_pack" not in self.buffers:
            return []
        t = [int(v) for v in self.buffers["step_pack"].values]
        return [(4 * t[1 + 2 * a], t[2 + 2 * a]) for a in range(t[0])]


def pack_step(region: np.ndarray, pack: list[tuple[int, int]], rows: int, generation: int, out: np.ndarray) -> int:
    """A decode step's values as its first kernel reads them (templates/embedding.cu.j2 step_token): into the bytes
    out, the generation (a 16-byte header), then the first `rows` rows of each array of the step region's bytes
    `region`, in `pack` order (Program.step_pack); the bytes used."""
    out[:16] = 0
    out[:4].view(np.uint32)[0] = generation & 0xFFFFFFFF
    at = 16
    for off, w in pack:
        n = 4 * w * rows
        out[at:at + n] = region[off:off + n]
        at += n
    return at


# ------------------------------------------------------------------ values


def evaluate(v, env: dict[str, int], gate: bool = True) -> int:
    """An int, or a symbol expression at the symbol values in env: (sym * mul) / ceil_div + add, and 0 where the
    symbol's value lies outside the expression's "range" [lo, hi] (a launch gated on it: a grid dimension of 0
    skips the launch, so a phase can hold alternative kernels for different row counts). gate=False ignores the
    range (validation checks every alternative at the phase's full size)."""
    if isinstance(v, bool):
        raise ProgramError(f"value {v!r} is not a number")
    if isinstance(v, int):
        return v
    if isinstance(v, dict) and "sym" in v:
        if gate and "range" in v:
            lo, hi = v["range"]
            if not int(lo) <= env[v["sym"]] <= int(hi):
                return 0
        x = env[v["sym"]] * int(v.get("mul", 1))
        d = int(v.get("ceil_div", 1))
        return -(-x // d) + int(v.get("add", 0))
    raise ProgramError(f"value {v!r} is neither an int nor a symbol expression")


def symbols_of(v) -> set[str]:
    return {v["sym"]} if isinstance(v, dict) and "sym" in v else set()


# ------------------------------------------------------------------ reading


def _launch(d: dict) -> Launch:
    return Launch(kernel=d["kernel"], grid=tuple(d["grid"]), block=tuple(d["block"]), smem=int(d["smem"]),
                  pdl=bool(d["pdl"]), args=tuple(d["args"]), reads=tuple((b, int(n)) for b, n in d["reads"]),
                  writes=tuple((b, int(n)) for b, n in d["writes"]),
                  fallback=tuple(_launch(f) for f in d.get("fallback", ())))


def from_dict(d: dict) -> Program:
    try:
        if d.get("version") not in READS:
            raise ProgramError(f"program version {d.get('version')}, this runtime reads {', '.join(map(str, READS))}")
        buffers = {}
        for b in d["buffers"]:
            buf = Buffer(b["name"], int(b["offset"]), int(b["bytes"]), b["dtype"], tuple(b["shape"]), b["kind"],
                         tuple(b["values"]) if b.get("values") is not None else None)
            if buf.name in buffers:
                raise ProgramError(f"buffer {buf.name} is declared twice")
            buffers[buf.name] = buf
        phases = [Phase(p["phase"], int(p["tokens"]), tuple(_launch(x) for x in p["launches"])) for p in d["phases"]]
        return Program(target=d["target"], arena_bytes=int(d["arena_bytes"]), buffers=buffers, phases=phases,
                       symbols={k: int(v) for k, v in d["symbols"].items()},
                       kernel_smem={k: int(v) for k, v in d.get("kernel_smem", {}).items()},
                       constants=dict(d["constants"]), options=dict(d.get("options", {})))
    except ProgramError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ProgramError(f"malformed program ({type(e).__name__}: {e})") from None


def to_dict(p: Program) -> dict:
    def launch(x: Launch) -> dict:
        d = {"kernel": x.kernel, "grid": list(x.grid), "block": list(x.block), "smem": x.smem, "pdl": x.pdl,
             "args": list(x.args), "reads": [list(r) for r in x.reads], "writes": [list(w) for w in x.writes]}
        if x.fallback:
            d["fallback"] = [launch(f) for f in x.fallback]
        return d
    bufs = []
    for b in p.buffers.values():
        e = {"name": b.name, "offset": b.offset, "bytes": b.bytes, "dtype": b.dtype, "shape": list(b.shape),
             "kind": b.kind}
        if b.values is not None:
            e["values"] = list(b.values)
        bufs.append(e)
    return {"version": VERSION, "target": p.target, "arena_bytes": p.arena_bytes, "constants": p.constants,
            "options": p.options, "symbols": p.symbols, "kernel_smem": p.kernel_smem, "buffers": bufs,
            "phases": [{"phase": ph.phase, "tokens": ph.tokens, "launches": [launch(x) for x in ph.launches]}
                       for ph in p.phases]}


def dumps(p: Program) -> str:
    return json.dumps(to_dict(p), indent=None, separators=(",", ":"), sort_keys=False) + "\n"


def loads(text: str) -> Program:
    try:
        d = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProgramError(f"not JSON ({e})") from None
    if not isinstance(d, dict):
        raise ProgramError("not a program object")
    return from_dict(d)


# ------------------------------------------------------------------ validation


def validate(p: Program, kernels: set[str] | None, max_smem: int | None = None) -> None:
    """Raise ProgramError unless every buffer lies inside the arena without overlapping another, every
    launch names a kernel of the cubin (when `kernels` is given) with a sane geometry, and every argument
    and every read/write stays inside the buffer it names at the symbols' largest values."""
    where = f"program for {p.target}"
    if p.arena_bytes <= 0:
        raise ProgramError(f"{where}: arena of {p.arena_bytes} bytes")
    spans = sorted((b.offset, b.offset + b.bytes, b.name) for b in p.buffers.values())
    for b in p.buffers.values():
        if b.kind not in KINDS or b.dtype not in DTYPES:
            raise ProgramError(f"{where}: buffer {b.name} has kind {b.kind!r} / dtype {b.dtype!r}")
        if b.offset < 0 or b.offset % ALIGN or b.bytes <= 0 or b.offset + b.bytes > p.arena_bytes:
            raise ProgramError(f"{where}: buffer {b.name} [{b.offset}, +{b.bytes}) is not an aligned piece of "
                               f"the {p.arena_bytes}-byte arena")
        if b.shape and math.prod(b.shape) * DTYPES[b.dtype] > b.bytes:
            raise ProgramError(f"{where}: buffer {b.name} of shape {list(b.shape)} {b.dtype} exceeds its {b.bytes} bytes")
        if b.values is not None and len(b.values) * DTYPES[b.dtype] > b.bytes:
            raise ProgramError(f"{where}: constant {b.name} holds more values than bytes")
    for (lo0, hi0, n0), (lo1, hi1, n1) in zip(spans, spans[1:]):
        if lo1 < hi0:
            raise ProgramError(f"{where}: buffers {n0} and {n1} overlap")
    if not any(b.kind == "step" for b in p.buffers.values()):
        raise ProgramError(f"{where}: no step buffers")
    for name in p.kernel_smem:
        if kernels is not None and name not in kernels:
            raise ProgramError(f"{where}: shared-memory attribute for kernel {name}, which the cubin lacks")
    for ph in p.phases:
        if ph.phase not in PHASES:
            raise ProgramError(f"{where}: unknown phase {ph.phase!r}")
        env = dict(p.symbols, rows=ph.tokens)
        for i, x in enumerate(ph.launches):
            at = f"{where}, {ph.phase} {ph.tokens}, launch {i} ({x.kernel})"
            _check_launch(p, x, env, kernels, max_smem, at, graph=ph.phase == "decode")
            for j, f in enumerate(x.fallback):
                if f.fallback:
                    raise ProgramError(f"{at}: its fallback launch {j} ({f.kernel}) has a fallback of its own")
                _check_launch(p, f, env, kernels, max_smem, f"{at}, fallback launch {j} ({f.kernel})",
                              graph=ph.phase == "decode")


def unfuse(p: Program, kernels: set[str]) -> Program:
    """The program with every launch of a kernel in `kernels` replaced by its fallback launches (the runtime's way out
    where a GPU cannot hold such a launch's blocks at once: its grid barrier would never return). Raises ProgramError
    for such a launch without a fallback."""
    def expand(ph: Phase) -> Phase:
        out = []
        for x in ph.launches:
            if x.kernel not in kernels:
                out.append(x)
            elif x.fallback:
                out.extend(x.fallback)
            else:
                raise ProgramError(f"program for {p.target}, {ph.phase} {ph.tokens}: {x.kernel} has no fallback")
        return Phase(ph.phase, ph.tokens, tuple(out))
    return dataclasses.replace(p, phases=[expand(ph) for ph in p.phases])


def _check_tmap(p: Program, t, at: str) -> None:
    """A TMA descriptor argument: a [rows, cols] matrix inside its buffer, boxes the hardware takes (16-bit:
    64 columns, the 128-byte swizzle; bytes: rows and boxes of a multiple of 16 bytes, unswizzled)."""
    try:
        b = p.buffers.get(t["ptr"])
        rows, cols, box_rows, box_cols = (int(t[k]) for k in ("rows", "cols", "box_rows", "box_cols"))
        dtype = t["dtype"]
    except (KeyError, TypeError, ValueError):
        raise ProgramError(f"{at}: malformed tensor-map argument {t!r}") from None
    if b is None:
        raise ProgramError(f"{at}: tensor map over buffer {t.get('ptr')!r}, which the arena lacks")
    size = {"f16": 2, "bf16": 2, "u8": 1}.get(dtype)
    if size is None or rows < 1 or cols < 1 or cols * size % 16 or rows * cols * size > b.bytes:
        raise ProgramError(f"{at}: tensor map [{rows}, {cols}] {dtype} does not fit buffer {b.name} ({b.bytes} bytes)")
    box_ok = box_cols * 2 == 128 if size == 2 else (box_cols % 16 == 0 and 16 <= box_cols <= 256)
    if not box_ok or not 1 <= box_rows <= 256:
        raise ProgramError(f"{at}: tensor-map box [{box_rows}, {box_cols}] {dtype} (16-bit: 64 columns; bytes: a "
                           f"multiple of 16 up to 256; at most 256 rows)")


# CUtensorMapDataType -> bytes an element
_TMAP_SIZES = {0: 1, 1: 2, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 4, 11: 4}


def _check_cutlass(p: Program, c, env: dict, at: str) -> set[str]:
    """A CUTLASS kernel's Params argument (impc/cutlass.py): its table in constants["cutlass"], a buffer for each
    operand, each descriptor's extent inside its operand's buffer, each patched word inside the Params bytes, a grid
    for each row bucket up to the rows at the symbols' largest values. Returns the symbols it uses."""
    try:
        t = p.constants["cutlass"][c["table"]]
        n = len(t["hex"]) // 2
        tile, grids, words = int(t["tile_m"]), t["grids"], t["words"]
        rows = c["rows"]
        ops = {k: c[k] for k in ("A", "W", "C", "D")}
        for q in t.get("pointers", []):
            if not 0 <= int(q["offset"]) <= n - 8 or p.buffers.get(c[q["operand"]]) is None:
                raise ProgramError(f"{at}: CUTLASS pointer {q['operand']} at {q['offset']} names no buffer")
    except (KeyError, TypeError, ValueError):
        raise ProgramError(f"{at}: malformed CUTLASS argument {c!r}") from None
    for tm in t["tmaps"]:
        b = p.buffers.get(ops.get(tm["operand"]))
        if b is None:
            raise ProgramError(f"{at}: CUTLASS operand {tm['operand']} names buffer {ops.get(tm['operand'])!r}, which "
                               "the arena lacks")
        size = _TMAP_SIZES.get(int(tm["dtype"]), 0)
        dims, strides = [int(d) for d in tm["dims"]], [int(s) for s in tm["strides"]]
        extent = dims[0] * size + sum((d - 1) * s for d, s in zip(dims[1:], strides))
        if not size or extent > b.bytes or not 0 <= int(tm["offset"]) <= n - 128:
            raise ProgramError(f"{at}: CUTLASS descriptor of {tm['operand']} ({extent} bytes) does not fit buffer "
                               f"{b.name} ({b.bytes} bytes) or its Params")
    if any(not 0 <= int(off) <= n - 4 or len(v) != len(grids) for off, v in words):
        raise ProgramError(f"{at}: CUTLASS table {c['table']} patches a word outside its Params")
    r = evaluate(rows, env, gate=False)
    if not 1 <= -(-r // tile) <= len(grids):
        raise ProgramError(f"{at}: CUTLASS table {c['table']} has {len(grids)} row buckets, the launch {r} rows")
    return symbols_of(rows)


def _check_launch(p: Program, x: Launch, env: dict, kernels, max_smem, at: str, graph: bool) -> None:
    if kernels is not None and x.kernel not in kernels:
        raise ProgramError(f"{at}: kernel not in the cubin")
    if len(x.grid) != 3 or len(x.block) != 3:
        raise ProgramError(f"{at}: grid and block need three dimensions")
    used = set().union(*(symbols_of(g) for g in x.grid))
    grid = [evaluate(g, env, gate=False) for g in x.grid]
    if min(grid) < 1 or min(x.block) < 1 or math.prod(x.block) > 1024:
        raise ProgramError(f"{at}: grid {grid} / block {list(x.block)} out of range")
    limit = p.kernel_smem.get(x.kernel, 48 * 1024)
    if x.smem < 0 or x.smem > limit or (max_smem is not None and x.smem > max_smem):
        raise ProgramError(f"{at}: {x.smem} bytes of dynamic shared memory (allowed {limit})")
    for a in x.args:
        if not isinstance(a, dict) or len(set(a) - {"offset"}) != 1:
            raise ProgramError(f"{at}: malformed argument {a!r}")
        if "ptr" in a:
            if a["ptr"] is None:
                continue
            b = p.buffers.get(a["ptr"])
            if b is None:
                raise ProgramError(f"{at}: argument names buffer {a['ptr']!r}, which the arena lacks")
            off = a.get("offset", 0)
            used |= symbols_of(off)
            if not 0 <= evaluate(off, env) < b.bytes:
                raise ProgramError(f"{at}: pointer {b.name}+{evaluate(off, env)} outside its {b.bytes} bytes")
        elif "tmap" in a:
            _check_tmap(p, a["tmap"], at)
        elif "cutlass" in a:
            used |= _check_cutlass(p, a["cutlass"], env, at)
        else:
            (kind, v), = a.items()
            if kind not in ("i32", "u32", "u64", "f32"):
                raise ProgramError(f"{at}: argument kind {kind!r}")
            if kind == "i32":
                used |= symbols_of(v)
                if not -2**31 <= evaluate(v, env) < 2**31:
                    raise ProgramError(f"{at}: i32 argument {v!r} out of range")
            elif kind == "f32":
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                    raise ProgramError(f"{at}: f32 argument {v!r}")
            elif not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ProgramError(f"{at}: {kind} argument {v!r}")
    if graph and used:
        raise ProgramError(f"{at}: a decode phase uses per-step symbols {sorted(used)} (it is captured as a graph)")
    unknown = used - set(env)
    if unknown:
        raise ProgramError(f"{at}: unknown symbols {sorted(unknown)}")
    for name, n in (*x.reads, *x.writes):
        b = p.buffers.get(name)
        if b is None or n < 0 or n > b.bytes:
            raise ProgramError(f"{at}: accesses {n} bytes of {name!r}, "
                               f"{'which the arena lacks' if b is None else f'which holds {b.bytes}'}")
