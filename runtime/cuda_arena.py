"""The device arena of a launch program: one allocation, every buffer at the offset the compiler planned.

At load: check the device has the memory the plan needs (a clear error if not), allocate the arena,
zero everything that is not a weight, upload the bundle's weights and the program's constants to their
buffers (a synthetic bundle's weights come from the program's `init` phase instead, run by the executor).
"""
from __future__ import annotations

import numpy as np

from imp_runtime.bundle import WEIGHTS, Bundle, BundleError
from imp_runtime.cuda_driver import check, cu, htod
from imp_runtime.program import Program

GiB = 1 << 30
NP_DTYPES = {"u8": np.uint8, "u16": np.uint16, "bf16": np.uint16, "f16": np.float16, "i32": np.int32,
             "f32": np.float32, "u64": np.uint64}


class DeviceArena:
    def __init__(self, program: Program, bundle: Bundle, stream, gpu_name: str):
        self.program, self.stream = program, stream
        need = program.arena_bytes
        free, total = (int(v) for v in check(cu.cuMemGetInfo()))
        if need > free:
            raise BundleError(
                f"{bundle.path}: its memory plan needs {need / GiB:.2f} GiB of device memory, and {gpu_name} has "
                f"{free / GiB:.2f} GiB free of {total / GiB:.2f} GiB: recompile with `impc compile ... --vram "
                f"{max(1, int(free / GiB) - 1)}` (or free the GPU)")
        self.base = int(check(cu.cuMemAlloc(need)))
        self.nbytes = need
        first = min((b.offset for b in program.buffers.values() if b.kind != "weight"), default=need)
        check(cu.cuMemsetD8Async(self.base + first, 0, need - first, stream))
        for b in program.buffers.values():
            if b.kind == "const":
                htod(self.ptr(b.name), np.asarray(b.values, NP_DTYPES[b.dtype]), stream)
        if not bundle.synthetic:
            self._upload_weights(bundle)
        check(cu.cuStreamSynchronize(stream))

    def _upload_weights(self, bundle: Bundle) -> None:
        from safetensors import safe_open
        weights = [b for b in self.program.buffers.values() if b.kind == "weight"]
        with safe_open(str(bundle.file(WEIGHTS)), framework="numpy") as f:
            keys = set(f.keys())
            for b in weights:
                if b.name not in keys:
                    raise BundleError(f"{bundle.path}: the weights file lacks {b.name}, which the launch program needs")
                arr = f.get_tensor(b.name)
                if arr.nbytes != b.bytes:
                    raise BundleError(f"{bundle.path}: {b.name} holds {arr.nbytes} bytes, the program plans {b.bytes}")
                htod(self.ptr(b.name), arr, self.stream)
                check(cu.cuStreamSynchronize(self.stream))     # the host array may go once copied

    def ptr(self, name: str, offset: int = 0) -> int:
        return self.base + self.program.buffers[name].offset + offset

    def bytes_of(self, kind: str) -> int:
        return sum(b.bytes for b in self.program.buffers.values() if b.kind == kind)

    def free(self) -> None:
        if self.base:
            cu.cuMemFree(self.base)
            self.base = 0
