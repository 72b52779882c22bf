"""`--prefill-gemm cutlass` without a GPU (impc/cutlass.py): the CUTLASS kernel compiles into the bundle's second
cubin; the Params probe's table against hand-computed values (the problem shape, the persistent scheduler's tile
counts, the grid, each descriptor's extent) and against the probe run at each bucket's rows; the program's launches
and their validation. The kernel itself runs only on a GPU (tests/test_gpu_kernels.py, test_gpu_model.py)."""
from __future__ import annotations

import copy
import math
import struct

import pytest

from impc.errors import CompileError


@pytest.fixture(scope="module")
def cutlass():
    from impc import cutlass
    from impc.emit import nvcc_path
    try:
        nvcc_path()
        cutlass.cutlass_root()
    except CompileError as e:
        pytest.skip(str(e))
    return cutlass


def test_kernel_compiles(cutlass):
    from impc.cubin import kernel_symbols
    cubin, _ = cutlass.compile_kernels(list(cutlass.KERNELS))
    assert kernel_symbols(cubin) == {"cutlass_gemm_bf16", "cutlass_gemm_f16s"}


def test_scaled_table(cutlass):
    """The NVFP4 copies' kernel: alpha 2^20 in the Params' bytes, the tensor scale's pointer where the probe put its
    fake address (written by the runtime), fp16 descriptors; the same row buckets as the bf16 kernel's."""
    t = cutlass.params_table("f16", 6144, 4096, 0.0, 1000, 132, 2.0 ** 20)
    raw = bytes.fromhex(t["hex"])
    (q,) = t["pointers"]
    assert q["operand"] == "scale" and struct.unpack_from("<Q", raw, q["offset"])[0] == 0x7E0000000000
    assert struct.pack("<f", 2.0 ** 20) in raw
    assert struct.unpack_from("<4i", raw, 4) == (1000, 6144, 4096, 1)
    b = cutlass.params_table("bf16", 6144, 4096, 0.0, 1000, 132)
    assert t["grids"] == b["grids"] and [w[1] for w in t["words"]][:1] == [w[1] for w in b["words"]][:1]


@pytest.mark.parametrize("n,k,beta,rows_max", [(6144, 4096, 0, 1000), (4096, 12288, 1, 4096), (64, 64, 1, 512)])
def test_params_table(cutlass, n, k, beta, rows_max):
    t = cutlass.params_table("bf16", n, k, float(beta), rows_max, 132)
    ms = [min(128 * b, rows_max) for b in range(1, math.ceil(rows_max / 128) + 1)]
    assert cutlass.buckets(rows_max) == ms
    raw = bytes.fromhex(t["hex"])
    # the problem shape (M, N, K, L) after the mode word, at the largest rows
    assert struct.unpack_from("<4i", raw, 4) == (rows_max, n, k, 1)
    words = {off: vals for off, vals in t["words"]}
    assert words[4] == ms                                           # M, bucket by bucket
    tiles = [math.ceil(m / 128) * math.ceil(n / 128) for m in ms]   # the persistent scheduler's output tiles
    if len(ms) > 1:
        assert any(v == tiles for v in words.values())
    grids = [[min(x, 132), 1, 1] for x in tiles]
    assert [sorted(g, reverse=True) for g in t["grids"]] == grids   # (along x or y by the raster order)
    assert t["block"] == [384, 1, 1] and t["smem"] > 100_000
    # the four descriptors: A [rows_max, K] and W [N, K] bf16 K-major, C and D [rows_max, N] float32
    dims = {tm["operand"]: tm["dims"] for tm in t["tmaps"]}
    assert dims == {"A": [k, rows_max, 1], "W": [k, n, 1], "C": [n, rows_max, 1], "D": [n, rows_max, 1]}
    strides = {tm["operand"]: tm["strides"][0] for tm in t["tmaps"]}
    assert strides == {"A": 2 * k, "W": 2 * k, "C": 4 * n, "D": 4 * n}
    # each bucket's Params, probed at its own rows, are the table's bytes with its words written in (outside the
    # descriptors, which the runtime encodes itself at the largest rows)
    desc = {i for tm in t["tmaps"] for i in range(tm["offset"], tm["offset"] + 128)}
    for b, m in enumerate(ms[:3]):
        got = bytearray(raw)
        for off, vals in t["words"]:
            got[off:off + 4] = struct.pack("<I", vals[b])
        want = bytes.fromhex(cutlass._probe("bf16", [(m, n, k, 1.0, float(beta), 132)], 0)[0]["hex"])
        assert all(got[i] == want[i] for i in range(len(raw)) if i not in desc)


def test_params_table_is_reproducible(cutlass):
    a = cutlass.params_table("bf16", 6144, 4096, 0.0, 512, 132)
    b = cutlass.params_table("bf16", 6144, 4096, 0.0, 512, 132)
    assert a == b


def test_program(cutlass, checkpoints, tmp_path):
    """A tiny bf16 llama compiled with --prefill-gemm cutlass: the large prefill phase's plain and residual GEMMs on
    the CUTLASS kernel (gate_up too, into its float32 rows and the gated activation after it), the smaller phases and
    decode on imp's; the program validates; one descriptor past its buffer does not."""
    from impc.compile import CompileOptions, compile_model
    from impc.launches import ProgramOptions
    from imp_runtime.bundle import load_bundle
    from imp_runtime.program import ProgramError, loads, validate
    compile_model(CompileOptions(model=str(checkpoints("llama")), out=tmp_path / "b", quant="bf16", targets="sm_90a",
                                 max_context=512, vram_gib=2, program=ProgramOptions(prefill_gemm="cutlass")))
    b = load_bundle(tmp_path / "b")
    kern = b.manifest["kernels"]
    assert kern["cutlass_cubins"] == {"sm_90a": "kernels/sm_90a.cutlass.cubin"}
    assert "cutlass_gemm_bf16" in kern["functions"]["sm_90a"]
    prog = loads(b.file("program/sm_90a.json").read_text())
    big = max(prog.buckets("prefill"))
    assert big > 256
    for ph in prog.phases:
        names = [x.kernel for x in ph.launches]
        n_cut = names.count("cutlass_gemm_bf16")
        assert n_cut == (4 * b.spec.n_layers if (ph.phase, ph.tokens) == ("prefill", big) else 0), (ph.phase, ph.tokens)
    x = next(x for x in prog.phase("prefill", big).launches if x.kernel == "cutlass_gemm_bf16")
    assert "cutlass_gemm_f16s" in kern["functions"]["sm_90a"]
    (arg,), = [x.args]
    assert arg["cutlass"]["rows"] == {"sym": "rows"} and not x.pdl
    validate(prog, set(kern["functions"]["sm_90a"]))
    bad = copy.deepcopy(prog)
    table = bad.constants["cutlass"][arg["cutlass"]["table"]]
    next(tm for tm in table["tmaps"] if tm["operand"] == "A")["dims"][1] *= 64
    with pytest.raises(ProgramError, match="CUTLASS descriptor of A"):
        validate(bad, None)


def test_missing_headers_are_one_clear_error(monkeypatch, tmp_path):
    from impc import cutlass
    monkeypatch.setenv("CUTLASS_PATH", str(tmp_path))
    monkeypatch.setattr(cutlass, "CUTLASS_VERSION", "0.0.0")
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CompileError, match="--prefill-gemm cutlass needs CUTLASS's headers: pip install"):
        cutlass.cutlass_root()


def test_runtime_params_for_each_step(cutlass, monkeypatch):
    """runtime/cuda_program.py CutlassParams without a GPU (the descriptor encoder stubbed to record its operand):
    the bytes a launch passes at r rows are the probe's own Params at r rounded up to whole 128-row tiles, outside the
    descriptors, which hold each operand's encoding at the arena address of the buffer the argument names."""
    import ctypes

    from imp_runtime import cuda_driver, cuda_program
    t = cutlass.params_table("bf16", 6144, 4096, 1.0, 700, 132)
    addr = {"ab": 0x1000, "layers.0.o": 0x2000, "x": 0x3000}
    encoded = []

    def fake_encode(ptr, tm):
        encoded.append((tm["operand"], ptr))
        return ptr.to_bytes(8, "little") * 16

    class Arena:
        def ptr(self, name):
            return addr[name]

    monkeypatch.setattr(cuda_driver, "tensor_map_bytes", fake_encode)
    arg = {"table": "t", "rows": {"sym": "rows"}, "A": "ab", "W": "layers.0.o", "C": "x", "D": "x"}
    p = cuda_program.CutlassParams(t, arg, Arena())
    assert sorted(encoded) == [("A", 0x1000), ("C", 0x3000), ("D", 0x3000), ("W", 0x2000)]
    desc = {}
    for tm in t["tmaps"]:
        desc.update({i: tm["operand"] for i in range(tm["offset"], tm["offset"] + 128)})
    for rows in (1, 128, 129, 700, 300, 5):
        grid = p.for_rows(rows)
        m = min(-(-rows // 128) * 128, 700)
        want = cutlass._probe("bf16", [(m, 6144, 4096, 1.0, 1.0, 132)], 0)[0]
        assert grid == want["grid"]
        got = bytes((ctypes.c_ubyte * len(p.buf)).from_buffer(p.buf))
        ref = bytes.fromhex(want["hex"])
        assert all(got[i] == ref[i] for i in range(len(ref)) if i not in desc), rows
        for i, op in list(desc.items())[::128]:
            assert got[i:i + 8] == {"A": 0x1000, "W": 0x2000, "C": 0x3000, "D": 0x3000}[op].to_bytes(8, "little")


def test_program_nvfp4(cutlass, checkpoints, tmp_path):
    """The NVFP4 tiny llama: qkv, o and down of the large phase on the scaled kernel over their fp16 copies and tensor
    scales, gate_up on imp's gated GEMM; the program validates."""
    from impc.compile import CompileOptions, compile_model
    from impc.launches import ProgramOptions
    from imp_runtime.bundle import load_bundle
    from imp_runtime.program import loads, validate
    compile_model(CompileOptions(model=str(checkpoints("llama")), out=tmp_path / "b", targets="sm_90a",
                                 max_context=512, vram_gib=2, program=ProgramOptions(prefill_gemm="cutlass"),
                                 calibrate=False))
    b = load_bundle(tmp_path / "b")
    prog = loads(b.file("program/sm_90a.json").read_text())
    big = max(prog.buckets("prefill"))
    cut = [x for x in prog.phase("prefill", big).launches if x.kernel == "cutlass_gemm_f16s"]
    assert len(cut) == 3 * b.spec.n_layers
    names = sorted({x.args[0]["cutlass"]["scale"].rsplit(".", 2)[-2] for x in cut})
    assert names == ["down", "o", "qkv"]
    assert all(x.args[0]["cutlass"]["scale"] == x.args[0]["cutlass"]["W"].replace(".f16", ".tscale") for x in cut)
    validate(prog, set(b.manifest["kernels"]["functions"]["sm_90a"]))
