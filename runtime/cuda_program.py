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

    def run(self, stream, env: dict[str, int] | None = None) -> None:
        x = self.launch
        if env is not None:
            for obj, v, base in self.symbolic_args:
                obj.value = base + evaluate(v, env)
            self.grid = [evaluate(g, env) for g in x.grid]
            if not all(self.grid):      # e.g. a prefill phase's decode-row launches in a step without decode rows
                return
        if self.config is not None:
            self.config.hStream = stream
            check(cu.cuLaunchKernelEx(self.config, self.func, ctypes.addressof(self.params), 0))
        else:
            check(cu.cuLaunchKernel(self.func, *self.grid, *x.block, x.smem, stream,
                                    ctypes.addressof(self.params), 0))


def bind_launch(x: Launch, module: Module, arena: DeviceArena, env: dict[str, int]) -> BoundLaunch:
    values, symbolic = [], []
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
        else:
            (kind, v), = a.items()
            obj = _CTYPES[kind](evaluate(v, env) if kind == "i32" else v)
            if kind == "i32" and symbols_of(v):
                symbolic.append((obj, v, 0))
        values.append(obj)
    params = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
    grid = [evaluate(g, env) for g in x.grid]
    b = BoundLaunch(x, module.func(x.kernel), values, params, grid, symbolic)
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
        self.symbolic = any(b.symbolic_args or any(symbols_of(g) for g in b.launch.grid) for b in self.launches)
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
