"""Thin helpers over `cuda.bindings.driver`: error checking, kernel launches with packed parameters,
device allocations. Imported only on the cuda path (never by the cpu executor)."""
from __future__ import annotations

import ctypes

import numpy as np
from cuda.bindings import driver as cu


class CudaError(RuntimeError):
    pass


def check(res):
    """cuda.bindings returns (err, *values): raise on error, return the values (one or a tuple)."""
    err = res[0] if isinstance(res, tuple) else res
    if err != cu.CUresult.CUDA_SUCCESS:
        try:
            name = cu.cuGetErrorName(err)[1].decode()
        except Exception:
            name = str(err)
        raise CudaError(f"CUDA driver error {name}")
    if not isinstance(res, tuple) or len(res) == 1:
        return None
    return res[1] if len(res) == 2 else res[1:]


def gpu_available() -> bool:
    """A driver that initialises and at least one device; False (never a crash) on a machine without."""
    try:
        (err,) = cu.cuInit(0)
        if err != cu.CUresult.CUDA_SUCCESS:
            return False
        err, n = cu.cuDeviceGetCount()
        return err == cu.CUresult.CUDA_SUCCESS and n > 0
    except Exception:
        return False


# Kernel argument wrappers: each becomes a ctypes scalar the launch points at.
def P(ptr) -> ctypes.c_uint64:
    return ctypes.c_uint64(int(ptr))


def I(v) -> ctypes.c_int32:
    return ctypes.c_int32(int(v))


def F(v) -> ctypes.c_float:
    return ctypes.c_float(float(v))


def U64(v) -> ctypes.c_uint64:
    return ctypes.c_uint64(int(v))


def U32(v) -> ctypes.c_uint32:
    return ctypes.c_uint32(int(v))


_PDL_ATTR = None


def _pdl_attr():
    global _PDL_ATTR
    if _PDL_ATTR is None:
        a = cu.CUlaunchAttribute()
        a.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        a.value.programmaticStreamSerializationAllowed = 1
        _PDL_ATTR = a
    return _PDL_ATTR


class Module:
    """A loaded cubin and its kernels by name."""

    def __init__(self, cubin: bytes):
        self._data = np.frombuffer(cubin, dtype=np.uint8).copy()
        self.module = check(cu.cuModuleLoadData(self._data.ctypes.data))
        self.funcs: dict[str, object] = {}

    def func(self, name: str):
        f = self.funcs.get(name)
        if f is None:
            f = check(cu.cuModuleGetFunction(self.module, name.encode()))
            self.funcs[name] = f
        return f

    def set_max_dynamic_smem(self, name: str, nbytes: int) -> None:
        check(cu.cuFuncSetAttribute(self.func(name),
                                    cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes))

    def launch(self, stream, name: str, grid, block, args, smem: int = 0, pdl: bool = False) -> None:
        """pdl: launch with programmatic stream serialization (Hopper's programmatic dependent launch): the
        kernel may start before the previous kernel in the stream completes, and must run griddepcontrol.wait
        (prelude's pdl_wait) before it reads or writes anything an earlier kernel touches."""
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        ptrs = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        if not pdl:
            check(cu.cuLaunchKernel(self.func(name), *grid, *block, smem, stream, ctypes.addressof(ptrs), 0))
            return
        cfg = cu.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
        cfg.sharedMemBytes = smem
        cfg.hStream = stream
        cfg.attrs = [_pdl_attr()]
        cfg.numAttrs = 1
        check(cu.cuLaunchKernelEx(cfg, self.func(name), ctypes.addressof(ptrs), 0))


class Arena:
    """One device allocation cut into 256-byte aligned pieces (all sizes known at load)."""

    ALIGN = 256

    def __init__(self, sizes: dict[str, int]):
        self.offsets: dict[str, int] = {}
        off = 0
        for name, n in sizes.items():
            self.offsets[name] = off
            off += (int(n) + self.ALIGN - 1) // self.ALIGN * self.ALIGN
        self.nbytes = max(off, self.ALIGN)
        self.base = int(check(cu.cuMemAlloc(self.nbytes)))

    def __getitem__(self, name: str) -> int:
        return self.base + self.offsets[name]

    def free(self) -> None:
        if self.base:
            cu.cuMemFree(self.base)
            self.base = 0


def htod(dst: int, arr: np.ndarray, stream) -> None:
    arr = np.ascontiguousarray(arr)
    if arr.nbytes:
        check(cu.cuMemcpyHtoDAsync(dst, arr.ctypes.data, arr.nbytes, stream))


def dtoh(arr: np.ndarray, src: int, stream) -> np.ndarray:
    check(cu.cuMemcpyDtoHAsync(arr.ctypes.data, src, arr.nbytes, stream))
    check(cu.cuStreamSynchronize(stream))
    return arr
