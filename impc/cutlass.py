"""Prefill GEMMs from CUTLASS 3.x (`impc compile --prefill-gemm cutlass`, sm_90a): templates/cutlass_gemm.cuh.j2
rendered, compiled with the wheel nvcc over the nvidia-cutlass wheel's headers into a second cubin, and the
kernel's Params built at compile time by the same template compiled as a host program (the probe), since imp's
runtime has no CUTLASS host code.

A launch program carries, per GEMM shape (N, K, beta), a table in `constants["cutlass"]`: the Params bytes at the
phase's largest row count, where each TMA descriptor sits in them with the arguments the runtime encodes it with
over the arena (runtime/cuda_program.py), and, per 128-row bucket of rows, the 32-bit words that differ from those
bytes (the problem shape's M, the persistent tile scheduler's tile counts, their FastDivmod shifts, its raster order:
BENCHMARKS.md, twenty-sixth session) and the grid. A step of r rows runs bucket ceil(r / 128): M rounded up to whole
128-row tiles, whose rows past r land in the buffers' spare rows as the other prefill GEMMs' do. Bytes that differ
between two runs of the probe (padding holding stack bytes, not fields) are zeroed, so a bundle rebuilds the same.
Everything is cached by content hash beside the kernel cubins (impc/emit.py cache_dir).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path

from impc.errors import CompileError

TILE_M = 128                     # the kernel's row tile (templates/cutlass_gemm.cuh.j2 TileShape)
# operand format -> the kernel's name in the cubin: bf16 weights (D = A W^T + beta C), and NVFP4 weights' fp16 copies
# (D = 2^20 tscale A W^T + beta C, tscale read from the device: templates/cutlass_gemm.cuh.j2 `scaled`)
KERNELS = {"bf16": "cutlass_gemm_bf16", "f16": "cutlass_gemm_f16s"}
SCALED = {"f16"}
ELEMENTS = {"bf16": "bfloat16_t", "f16": "half_t"}
CUTLASS_VERSION = "4.2.0.0"
HINT = f"pip install --no-deps nvidia-cutlass=={CUTLASS_VERSION} (headers only)"


def cutlass_root() -> Path:
    """The CUTLASS source tree of the nvidia-cutlass wheel (include/ and tools/util/include/), or $CUTLASS_PATH."""
    env = os.environ.get("CUTLASS_PATH")
    candidates = [Path(env)] if env else []
    try:
        import importlib.util
        spec = importlib.util.find_spec("cutlass_library")
        if spec and spec.origin:
            candidates.append(Path(spec.origin).parent / "source")
    except (ImportError, ValueError):
        pass
    repo = Path(__file__).resolve().parent.parent
    candidates.append(repo / ".cache" / f"nvidia-cutlass-{CUTLASS_VERSION}" / "cutlass_library" / "source")
    for c in candidates:
        if (c / "include" / "cutlass" / "cutlass.h").is_file():
            return c
    raise CompileError(f"--prefill-gemm cutlass needs CUTLASS's headers: {HINT}, or set CUTLASS_PATH to a CUTLASS "
                       "source tree")


def render(fmt: str) -> str:
    from impc.emit import template_env
    return template_env().get_template("cutlass_gemm.cuh.j2").render(element=ELEMENTS[fmt], kernel=KERNELS[fmt],
                                                          ns=f"imp_cutlass_{fmt}", scaled=fmt in SCALED)


def _includes(root: Path) -> list[str]:
    return [f"-I{root / 'include'}", f"-I{root / 'tools' / 'util' / 'include'}"]


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _run_nvcc(args: list[str], cwd: str, what: str) -> None:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise CompileError(f"nvcc failed for {what}:\n{proc.stderr[-4000:]}")


def compile_kernels(fmts: list[str]) -> tuple[bytes, bool]:
    """The CUTLASS kernels for these operand formats, one cubin for sm_90a, cached as the other cubins are
    (impc/emit.py compile_cubin; the headers' version is in the source hashed): (cubin, cached)."""
    from impc.emit import compile_cubin, nvcc_path, nvcc_version
    from impc.targets import load_target
    root, nvcc = cutlass_root(), nvcc_path()
    version_h = (root / "include" / "cutlass" / "version.h").read_text()
    source = f"// CUTLASS {_key(version_h)[:16]}\n" + "\n".join(render(f) for f in sorted(set(fmts)))
    return compile_cubin(source, load_target("sm_90a"), nvcc, nvcc_version(nvcc), ["-DNDEBUG", *_includes(root)],
                         "the CUTLASS kernels")


def probe_binary(fmt: str) -> Path:
    """The host program that prints the kernel's Params (cached by content hash)."""
    from impc.emit import cache_dir, nvcc_path, nvcc_version
    root, nvcc = cutlass_root(), nvcc_path()
    source = render(fmt)
    lib = nvcc.parent.parent / "lib"          # the wheel's libcudart_static.a (not on nvcc's own path)
    flags = ["-O1", "-std=c++17", "--expt-relaxed-constexpr", "-DNDEBUG", "-arch=sm_90a",
             "-DCUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL", "-DIMP_CUTLASS_PROBE"]
    key = _key(source, " ".join(flags), nvcc_version(nvcc), (root / "include" / "cutlass" / "version.h").read_text())
    exe = cache_dir() / f"cutlass-probe-{key}"
    if exe.is_file():
        return exe
    with tempfile.TemporaryDirectory(prefix="impc-cutlass-") as tmp:
        (Path(tmp) / "probe.cu").write_text(source)
        _run_nvcc([str(nvcc), *flags, *_includes(root), f"-L{lib}", "-o", "probe", "probe.cu"], tmp,
                  "the CUTLASS Params probe")
        tmp_path = exe.with_name(exe.name + f".{os.getpid()}.tmp")
        tmp_path.write_bytes((Path(tmp) / "probe").read_bytes())
    tmp_path.chmod(0o755)
    tmp_path.replace(exe)
    return exe


def _probe(fmt: str, shapes: list[tuple[int, int, int, float, float, int]], pad: int) -> list[dict]:
    exe = probe_binary(fmt)
    text = "".join(f"{m} {n} {k} {a!r} {b!r} {s}\n" for m, n, k, a, b, s in shapes)
    # pad: environment bytes that move the probe's stack, so a second run shows which bytes are stack leftovers
    proc = subprocess.run([str(exe)], input=text, capture_output=True, text=True,
                          env={**os.environ, "IMP_PROBE_PAD": "x" * pad})
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    for r in rows:
        if "error" in r:
            raise CompileError(f"CUTLASS GEMM: {r['error']}")
    if proc.returncode != 0 or len(rows) != len(shapes):
        raise CompileError(f"the CUTLASS Params probe failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return rows


def buckets(rows_max: int) -> list[int]:
    """The row counts a phase of up to rows_max rows runs the kernel at: whole 128-row tiles, the last rows_max."""
    return [min(TILE_M * b, rows_max) for b in range(1, -(-rows_max // TILE_M) + 1)]


def params_table(fmt: str, n: int, k: int, beta: float, rows_max: int, sm_count: int, alpha: float = 1.0) -> dict:
    """The program's table of one GEMM shape (module docstring). A scaled kernel's tensor-scale pointer sits in the
    Params as a raw address: "pointers" says where, the runtime writes it."""
    ms = buckets(rows_max)
    shapes = [(m, n, k, float(alpha), float(beta), sm_count) for m in ms]
    runs = [_probe(fmt, shapes, pad) for pad in (0, 1000)]
    blobs = []
    for r0, r1 in zip(*runs):
        a, b = bytearray.fromhex(r0["hex"]), bytes.fromhex(r1["hex"])
        for i in range(len(a)):
            if a[i] != b[i]:
                a[i] = 0                     # a stack leftover, not a field
        blobs.append(bytes(a))
    top = runs[0][-1]
    desc: set[int] = set()          # bytes the runtime writes itself: descriptors and pointers
    want = [{"operand": "scale"}] if fmt in SCALED else []
    if [{"operand": q["operand"]} for q in top["pointers"]] != want:
        raise CompileError(f"CUTLASS GEMM Params hold raw pointers {top['pointers']}, expected {want}")
    for q in top["pointers"]:
        desc.update(range(q["offset"], q["offset"] + 8))
    if sorted(t["operand"] for t in top["tmaps"]) != ["A", "C", "D", "W"]:
        raise CompileError(f"CUTLASS GEMM: unexpected TMA descriptors {[t['operand'] for t in top['tmaps']]}")
    for t in top["tmaps"]:
        desc.update(range(t["offset"], t["offset"] + 128))
    base = blobs[-1]
    words = []
    for off in range(0, len(base) - 3, 4):
        if desc & set(range(off, off + 4)):
            continue
        vals = [int.from_bytes(bl[off:off + 4], "little") for bl in blobs]
        if len(set(vals)) > 1:
            words.append([off, vals])
    return {"kernel": KERNELS[fmt], "fmt": fmt, "n": n, "k": k, "beta": beta, "rows_max": rows_max,
            "tile_m": TILE_M, "hex": base.hex(), "align": top["params_align"], "block": top["block"],
            "smem": top["smem"], "tmaps": [{key: t[key] for key in ("offset", "operand", "dtype", "rank", "dims",
                                                                    "strides", "box", "elem_strides", "interleave",
                                                                    "swizzle", "l2", "oob")} for t in top["tmaps"]],
            "pointers": [{"offset": q["offset"], "operand": q["operand"]} for q in top["pointers"]], "alpha": alpha,
            "words": words, "grids": [r["grid"] for r in runs[0]]}


def table_key(fmt: str, n: int, k: int, beta: float, rows_max: int) -> str:
    return f"{fmt}_n{n}_k{k}_b{int(beta)}_m{rows_max}"


def add_cutlass(emitted: list, prefill_gemm: str, progress=None) -> list:
    """With --prefill-gemm cutlass, sm_90a's Emitted gains the CUTLASS cubin and its kernels (impc/emit.py)."""
    import dataclasses
    from impc.cubin import kernel_symbols
    if prefill_gemm != "cutlass":
        return emitted
    out = []
    for e in emitted:
        if e.target == "sm_90a":
            cubin, cached = compile_kernels(list(KERNELS))
            if progress is not None:
                progress.info(f"{e.target}: CUTLASS kernels, {len(cubin) / 1024:.0f} KiB{' (cached)' if cached else ''}")
            e = dataclasses.replace(e, cutlass=cubin, kernels=sorted({*e.kernels, *kernel_symbols(cubin)}))
        out.append(e)
    return out
