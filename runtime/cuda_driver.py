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


def pdl_attribute():
    """The launch attribute of programmatic dependent launch (Hopper and later): the kernel may start
    before the previous kernel in the stream completes, and runs griddepcontrol.wait (the prelude's
    pdl_wait) before it touches anything an earlier kernel wrote."""
    global _PDL_ATTR
    if _PDL_ATTR is None:
        a = cu.CUlaunchAttribute()
        a.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        a.value.programmaticStreamSerializationAllowed = 1
        _PDL_ATTR = a
    return _PDL_ATTR


class Module:
    """A loaded cubin and its kernels by name."""

    def __init__(self, cubin: bytes, *more: bytes):
        """One cubin, and any more a bundle carries (its CUTLASS kernels: impc/cutlass.py); a kernel is looked up
        in each in turn."""
        self._data = [np.frombuffer(c, dtype=np.uint8).copy() for c in (cubin, *more)]
        self.modules = [check(cu.cuModuleLoadData(d.ctypes.data)) for d in self._data]
        self.module = self.modules[0]
        self.funcs: dict[str, object] = {}

    def func(self, name: str):
        f = self.funcs.get(name)
        if f is None:
            for i, m in enumerate(self.modules):
                err, f = cu.cuModuleGetFunction(m, name.encode())
                if err == cu.CUresult.CUDA_SUCCESS:
                    break
                if i == len(self.modules) - 1:
                    check((err, f))
            self.funcs[name] = f
        return f

    def set_max_dynamic_smem(self, name: str, nbytes: int) -> None:
        check(cu.cuFuncSetAttribute(self.func(name),
                                    cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes))


def new_event():
    """An event without timing (the cheapest to record and wait for)."""
    return check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING.value))


def htod(dst: int, arr: np.ndarray, stream) -> None:
    arr = np.ascontiguousarray(arr)
    if arr.nbytes:
        check(cu.cuMemcpyHtoDAsync(dst, arr.ctypes.data, arr.nbytes, stream))


class PinnedBuffer:
    """Page-locked host memory (copies from and to it are truly asynchronous), viewed as bytes. mapped: also in the
    device's address space (device_ptr), so kernels read and write it over the bus without a copy; zeroed."""

    def __init__(self, nbytes: int, mapped: bool = False):
        self.nbytes = max(int(nbytes), 16)
        flags = cu.CU_MEMHOSTALLOC_DEVICEMAP if mapped else 0
        self.ptr = int(check(cu.cuMemHostAlloc(self.nbytes, flags)))
        self.array = np.frombuffer((ctypes.c_uint8 * self.nbytes).from_address(self.ptr), np.uint8)
        self.device_ptr = int(check(cu.cuMemHostGetDevicePointer(self.ptr, 0))) if mapped else 0
        if mapped:
            self.array[:] = 0

    def view(self, offset: int, dtype, count: int) -> np.ndarray:
        return self.array[offset:offset + count * np.dtype(dtype).itemsize].view(dtype)

    def free(self) -> None:
        if self.ptr:
            self.array = None
            cu.cuMemFreeHost(self.ptr)
            self.ptr = 0


def dtoh(arr: np.ndarray, src: int, stream) -> np.ndarray:
    check(cu.cuMemcpyDtoHAsync(arr.ctypes.data, src, arr.nbytes, stream))
    check(cu.cuStreamSynchronize(stream))
    return arr


_TMAP_DTYPES = {"f16": "CU_TENSOR_MAP_DATA_TYPE_FLOAT16", "bf16": "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16",
                "u8": "CU_TENSOR_MAP_DATA_TYPE_UINT8"}


def tensor_map_bytes(ptr: int, tm: dict) -> bytes:
    """The 128 bytes of a TMA descriptor at ptr with the arguments CUTLASS's host code would pass (a CUTLASS table's
    "tmaps" entry, impc/cutlass.py: data type, rank, dims, strides of dims 1.., box, element strides, interleave,
    swizzle, L2 promotion, out-of-bounds fill, as the driver's enum values)."""
    rank = int(tm["rank"])
    m = check(cu.cuTensorMapEncodeTiled(
        cu.CUtensorMapDataType(int(tm["dtype"])), rank, int(ptr), [cu.cuuint64_t(int(d)) for d in tm["dims"]],
        [cu.cuuint64_t(int(s)) for s in tm["strides"]], [cu.cuuint32_t(int(b)) for b in tm["box"]],
        [cu.cuuint32_t(int(e)) for e in tm["elem_strides"]], cu.CUtensorMapInterleave(int(tm["interleave"])),
        cu.CUtensorMapSwizzle(int(tm["swizzle"])), cu.CUtensorMapL2promotion(int(tm["l2"])),
        cu.CUtensorMapFloatOOBfill(int(tm["oob"]))))
    return bytes((ctypes.c_uint64 * 16)(*[int(x) for x in m.opaque]))


def tensor_map(ptr: int, dtype: str, rows: int, cols: int, box_rows: int, box_cols: int) -> ctypes.Array:
    """A TMA descriptor (CUtensorMap, 128 bytes) of a row-major [rows, cols] matrix at ptr, read in
    [box_rows, box_cols] boxes, out-of-bounds elements read as zero: 16-bit matrices with the 128-byte swizzle
    (box_cols * 2 bytes = 128; templates/gemm_wgmma.cu.j2), bytes (u8: NVFP4 codes and scales) unswizzled
    (templates/gemm_wgmma_nvfp4.cu.j2). Returned as the ctypes block a kernel argument points at."""
    size = 1 if dtype == "u8" else 2
    swizzle = cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE if dtype == "u8" else \
        cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B
    m = check(cu.cuTensorMapEncodeTiled(
        getattr(cu.CUtensorMapDataType, _TMAP_DTYPES[dtype]), 2, int(ptr),
        [cu.cuuint64_t(int(cols)), cu.cuuint64_t(int(rows))], [cu.cuuint64_t(int(cols) * size)],
        [cu.cuuint32_t(int(box_cols)), cu.cuuint32_t(int(box_rows))], [cu.cuuint32_t(1), cu.cuuint32_t(1)],
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE))
    return (ctypes.c_uint64 * 16)(*[int(x) for x in m.opaque])
