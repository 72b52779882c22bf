"""Stage 5: emit. Render templates/*.cu.j2 with the model's dimensions and the target's choices as
compile-time constants, and compile them with nvcc (from PyPI wheels; no CUDA toolkit on the host)
into one cubin per target. Cubins are cached by the hash of (source, flags, nvcc version).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import jinja2

from impc.cubin import kernel_symbols
from impc.errors import CompileError, data_dir
from imp_runtime.spec import ModelSpec

TEMPLATES_DIR = data_dir("templates")
# SASS only, never PTX: a newer PTX may not JIT on an older driver.
NVCC_FLAGS = ["-cubin", "-O3", "-std=c++17", "--expt-relaxed-constexpr", "-Xptxas=-warn-spills"]



@dataclass
class Emitted:
    target: str
    cubin: bytes
    source: str
    kernels: list[str]
    cached: bool
    cutlass: bytes | None = None       # --prefill-gemm cutlass: the CUTLASS kernels' cubin (impc/cutlass.py)


def nvcc_path() -> Path:
    try:
        import nvidia
    except ImportError:
        nvidia = None
    for root in ([Path(p) for p in nvidia.__path__] if nvidia else []):
        for sub in ("cu13/bin/nvcc", "cuda_nvcc/bin/nvcc"):
            if (root / sub).is_file():
                return root / sub
    raise CompileError("nvcc not found: install the compiler wheels with `pip install -e '.[compile]'` "
                       "(or pass --target none for a cpu-only bundle)")


def nvcc_version(nvcc: Path) -> str:
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release [\d.]+, (V[\d.]+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1]


def cache_dir() -> Path:
    d = Path(os.environ.get("IMP_CACHE_DIR") or Path.home() / ".cache" / "imp" / "kernels")
    d.mkdir(parents=True, exist_ok=True)
    return d


def template_files() -> list[Path]:
    return sorted(TEMPLATES_DIR.glob("*.cu.j2"))


def template_hashes() -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(TEMPLATES_DIR.glob("*.j2"))}


def cfloat(x: float) -> str:
    """A C++ float literal that round-trips x (1.0 -> "1.0f", not the invalid "1f")."""
    text = repr(float(x))
    return text + "f" if any(c in text for c in ".eE") else text + ".0f"


def template_env() -> jinja2.Environment:
    """The Jinja environment every template of templates/ is rendered in."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES_DIR), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters["cfloat"] = cfloat
    return env


def render(spec: ModelSpec, target: dict, plan: dict, omit: frozenset[str] = frozenset()) -> str:
    """One translation unit: the common prelude, then every kernel family, each specialised; without the
    kernels named in omit that a template can leave out (those the program cannot launch: nvcc time)."""
    env = template_env()
    from impc.arena_layout import ATTN_MAX_SPLITS, FA_TILE_INTS, attn_partial_row
    from impc.launches import attn_decode_geometry, fa_wg_geometry
    from impc.launch_linear import (GR3_BLOCKS, GR3_SMEM, GR3_STAGES, GR_RESIDENT, GR_SMEM, GR_STAGES, GR_UR,
                                    SMALL_HEAD_K, gv_i8_tiles, WG_STAGES, WG_THREADS, WG_TILE_K, WG_TILE_M, WQ_K, WQ_RA, WQ_ROWS, WQ_RW, wq_shape,
                                    pair_gated_shape, pair_shape)
    ctx = {"spec": spec, "target": target, "plan": plan, "attn_max_splits": ATTN_MAX_SPLITS, "fa_tile_ints": FA_TILE_INTS,
           "attn_partial_row": attn_partial_row(spec.head_dim),
           "layer_kinds": [spec.kind(i) for i in range(spec.n_layers)],
           "wg": {"m": WG_TILE_M, "k": WG_TILE_K, "stages": WG_STAGES, "threads": WG_THREADS},
           "wq": {"k": WQ_K, "rows": WQ_ROWS, "rw": WQ_RW, "ra": WQ_RA, "emit": wq_shape(spec)},
           "fw": fa_wg_geometry(spec.head_dim, target) or {"emit": False},
           "ad": attn_decode_geometry(spec, target),
           "gr": {"stages": GR_STAGES, "ur": GR_UR, "resident": GR_RESIDENT, "smem": GR_SMEM,
                  "stages3": GR3_STAGES, "resident3": GR3_BLOCKS, "smem3": GR3_SMEM},
           "i8_tiles": gv_i8_tiles(spec.hidden), "bf16w": spec.hidden <= SMALL_HEAD_K,
           "pair": {"dq": pair_shape(spec), "og": pair_gated_shape(spec)},    # templates/gemv_ring_pair.cu.j2
           "omit": frozenset(omit),
           # a developer build with phase timers in the streamed decode GEMVs, the decode attention, rmsnorm_residual
           # and qkv_rope_cache_f16 (scripts/kernel_phases.py)
           "timers": os.environ.get("IMP_KERNEL_TIMERS") == "1"}
    parts = [env.get_template("prelude.cuh.j2").render(**ctx)]
    for path in template_files():
        parts.append(f"// ==== {path.name} ====\n" + env.get_template(path.name).render(**ctx))
    return "\n".join(parts)


def compile_cubin(source: str, target: dict, nvcc: Path, version: str, extra: list[str] = (),
                  what: str | None = None) -> tuple[bytes, bool]:
    """source -> cubin for target, cached by the hash of (source, flags, nvcc version): (cubin, cached). extra: more
    nvcc flags (impc/cutlass.py: its defines and include folders); what: the error's name for it."""
    flags = NVCC_FLAGS + [target["nvcc_arch"], *extra]
    key = hashlib.sha256("\0".join([source, " ".join(flags), version]).encode()).hexdigest()
    cached = cache_dir() / f"{key}.cubin"
    if cached.is_file():
        return cached.read_bytes(), True
    if shutil.which("gcc") is None and shutil.which("g++") is None:
        raise CompileError("nvcc needs a host C++ compiler on PATH (install gcc/g++)")
    with tempfile.TemporaryDirectory(prefix="impc-") as tmp:
        # A fixed file name keeps the cubin independent of the temporary folder.
        src = Path(tmp) / "kernels.cu"
        src.write_text(source)
        proc = subprocess.run([str(nvcc), *flags, "-o", "kernels.cubin", "kernels.cu"], cwd=tmp,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise CompileError(f"nvcc failed for {what or target['name']}:\n{proc.stderr[-4000:]}")
        data = (Path(tmp) / "kernels.cubin").read_bytes()
        if os.environ.get("IMPC_NVCC_LOG"):     # a developer's look at ptxas's notes (spills, serialized wgmma);
            # only where nvcc ran: a cached cubin has none (IMP_CACHE_DIR to an empty folder forces a compile)
            with open(os.environ["IMPC_NVCC_LOG"], "a") as f:
                f.write(f"== {target['name']}\n{proc.stderr}")
    tmp_path = cached.with_suffix(f".{os.getpid()}.tmp")
    tmp_path.write_bytes(data)
    tmp_path.replace(cached)            # atomic: parallel builds never see half a cubin
    return data, False


def emit(spec: ModelSpec, targets: list[dict], plan: dict, omit: dict[str, frozenset[str]] | None = None) -> list[Emitted]:
    """One cubin per target; omit: per target, kernels to leave out (impc/launches.py kernels_not_launched)."""
    if not targets:
        return []
    nvcc = nvcc_path()
    version = nvcc_version(nvcc)
    sources = {t["name"]: render(spec, t, plan, (omit or {}).get(t["name"], frozenset())) for t in targets}
    with ThreadPoolExecutor(max_workers=max(1, min(len(targets), os.cpu_count() or 1))) as pool:
        results = list(pool.map(lambda t: compile_cubin(sources[t["name"]], t, nvcc, version), targets))
    return [Emitted(t["name"], cubin, sources[t["name"]], sorted(kernel_symbols(cubin)), cached)
            for t, (cubin, cached) in zip(targets, results)]


def compiler_record() -> dict:
    nvcc = nvcc_path()
    return {"nvcc": nvcc_version(nvcc), "nvcc_flags": NVCC_FLAGS, "python": sys.version.split()[0]}
