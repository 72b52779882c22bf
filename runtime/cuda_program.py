"""Binding a launch program to the device, and its CUDA graphs.

Every launch of every phase is bound once at load: its kernel function, its argument block (ctypes
values at the arena's addresses) and, for launches with programmatic dependent launch, its launch
configuration. A phase with per-step symbols (prefill, logits) keeps a list of the arguments and grid
dimensions that depend on them and rewrites just those before it runs (a launch whose grid is then empty is
skipped); a decode phase has none and is captured once as a CUDA graph, replayed every step.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

from imp_runtime.cuda_arena import DeviceArena
from imp_runtime.cuda_driver import Module, check, cu, pdl_attribute, tensor_map
from imp_runtime.program import Launch, Phase, evaluate, symbols_of

_CTYPES = {"i32": ctypes.c_int32, "u32": ctypes.c_uint32, "u64": ctypes.c_uint64, "f32": ctypes.c_float}


@dataclass
class BoundLaunch:
    launch: Launch
    func: object
    values: list                      # ctypes scalars the argument block points at
    params: object                    # (c_void_p * n) of their addresses
    grid: list[int]
    symbolic_args: list[tuple[object, object, int]] = field(default_factory=list)   # (ctype, value, base)
    config: object | None = None      # CUlaunchConfig when launched with PDL
    cutlass: "CutlassParams | None" = None    # a CUTLASS kernel's Params, patched for each step's rows

    def run(self, stream, env: dict[str, int] | None = None) -> None:
        x = self.launch
        if env is not None:
            for obj, v, base in self.symbolic_args:
                obj.value = base + evaluate(v, env)
            self.grid = [evaluate(g, env) for g in x.grid]
            if self.cutlass is not None:
                self.grid = self.cutlass.for_rows(evaluate(self.cutlass.rows, env))
            if not all(self.grid):      # e.g. a prefill phase's decode-row launches in a step without decode rows
                return
        if self.config is not None:
            self.config.hStream = stream
            check(cu.cuLaunchKernelEx(self.config, self.func, ctypes.addressof(self.params), 0))
        else:
            check(cu.cuLaunchKernel(self.func, *self.grid, *x.block, x.smem, stream,
                                    ctypes.addressof(self.params), 0))


class CutlassParams:
    """A CUTLASS kernel's one argument (impc/cutlass.py): its table's Params bytes with the four TMA descriptors
    encoded over the arena, and, for a step of r rows, row bucket ceil(r / tile)'s words written in and its grid."""

    def __init__(self, table: dict, arg: dict, arena: DeviceArena):
        from imp_runtime.cuda_driver import tensor_map_bytes
        raw = bytes.fromhex(table["hex"])
        self.buf = (ctypes.c_ubyte * len(raw)).from_buffer_copy(raw)
        for tm in table["tmaps"]:
            ctypes.memmove(ctypes.addressof(self.buf) + int(tm["offset"]),
                           tensor_map_bytes(arena.ptr(arg[tm["operand"]]), tm), 128)
        for q in table.get("pointers", []):          # a scaled kernel's tensor-scale pointer
            ctypes.c_uint64.from_address(ctypes.addressof(self.buf) + int(q["offset"])).value = \
                arena.ptr(arg[q["operand"]])
        self.words = [(int(off), [int(v) for v in vals]) for off, vals in table["words"]]
        self.grids = [list(g) for g in table["grids"]]
        self.tile, self.rows = int(table["tile_m"]), arg["rows"]
        self.bucket = None            # whose words the bytes hold: rewritten only when a step's bucket differs

    def for_rows(self, rows: int) -> list[int]:
        if rows < 1:
            return [0, 0, 0]
        b = min(-(-rows // self.tile), len(self.grids)) - 1
        if b != self.bucket:
            base = ctypes.addressof(self.buf)
            for off, vals in self.words:
                ctypes.c_uint32.from_address(base + off).value = vals[b]
            self.bucket = b
        return self.grids[b]


def bind_launch(x: Launch, module: Module, arena: DeviceArena, env: dict[str, int]) -> BoundLaunch:
    values, symbolic = [], []
    cutlass = None
    for a in x.args:
        if "ptr" in a:
            if a["ptr"] is None:
                values.append(ctypes.c_uint64(0))
                continue
            base = arena.ptr(a["ptr"])
            off = a.get("offset", 0)
            obj = ctypes.c_uint64(base + evaluate(off, env))
            if symbols_of(off):
                symbolic.append((obj, off, base))
        elif "tmap" in a:
            t = a["tmap"]
            obj = tensor_map(arena.ptr(t["ptr"]), t["dtype"], t["rows"], t["cols"], t["box_rows"], t["box_cols"])
        elif "cutlass" in a:
            c = a["cutlass"]
            cutlass = CutlassParams(arena.program.constants["cutlass"][c["table"]], c, arena)
            obj = cutlass.buf
        else:
            (kind, v), = a.items()
            obj = _CTYPES[kind](evaluate(v, env) if kind == "i32" else v)
            if kind == "i32" and symbols_of(v):
                symbolic.append((obj, v, 0))
        values.append(obj)
    params = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
    grid = [evaluate(g, env) for g in x.grid] if cutlass is None else cutlass.for_rows(evaluate(cutlass.rows, env))
    b = BoundLaunch(x, module.func(x.kernel), values, params, grid, symbolic, cutlass=cutlass)
    if x.pdl:
        cfg = cu.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = x.block
        cfg.sharedMemBytes = x.smem
        cfg.attrs = [pdl_attribute()]
        cfg.numAttrs = 1
        b.config = cfg
    return b


class BoundPhase:
    def __init__(self, phase: Phase, module: Module, arena: DeviceArena, symbols: dict[str, int]):
        self.phase = phase
        env = dict(symbols, rows=phase.tokens)
        self.launches = [bind_launch(x, module, arena, env) for x in phase.launches]
        self.symbolic = any(b.symbolic_args or b.cutlass is not None or any(symbols_of(g) for g in b.launch.grid)
                            for b in self.launches)
        self.graph = None

    def run(self, stream, env: dict[str, int] | None = None) -> None:
        if self.graph is not None and env is None:
            check(cu.cuGraphLaunch(self.graph[1], stream))
            return
        for b in self.launches:
            b.run(stream, env)

    def capture(self, stream) -> None:
        """Record the phase once as a CUDA graph (its launches must not depend on per-step symbols)."""
        if self.symbolic:
            raise ValueError(f"{self.phase.phase} {self.phase.tokens} depends on per-step values")
        check(cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        try:
            for b in self.launches:
                b.run(stream)
        finally:
            graph = check(cu.cuStreamEndCapture(stream))
        self.graph = (graph, check(cu.cuGraphInstantiate(graph, 0)))

    def release(self) -> None:
        if self.graph is not None:
            try:
                cu.cuGraphExecDestroy(self.graph[1])
                cu.cuGraphDestroy(self.graph[0])
            except Exception:      # the context may already be gone at interpreter exit
                pass
            self.graph = None
