#!/usr/bin/env python
"""Count a kernel's inner-loop SASS without a GPU, and tell which functions of two cubins differ.

Kernel work here is measured on a lent GPU with little device time; what can be known before a device call should be.
Two questions come up at every kernel change (BENCHMARKS.md, thirteenth to nineteenth sessions):
- how many instructions, and which, does one iteration of the hot loop issue? (`loop`: the innermost loop whose
  back branch encloses every instruction of an opcode, HMMA for the mma.sync GEMVs, HGMMA for the wgmma GEMMs;
  static counts: one per instruction of the loop body, so a stage's work when the loop runs a stage an iteration)
- does a refactoring change any kernel's code? (`diff`: the functions whose SASS differs once addresses and
  encodings are stripped; a change that leaves every function identical needs no new device run)
- are the loads meant to be in flight before the grid-dependency wait still ahead of it? (`early`: a kernel's global
  loads before and after its first ACQBULK, griddepcontrol.wait's SASS; ptxas moves read-only loads past it, so the
  kernels load what they need early with strong relaxed loads, templates/prelude.cuh.j2 ld_early_*; BENCHMARKS.md,
  twenty-eighth session)

Needs `cuobjdump` and `nvdisasm` (CUDA's binary utilities; on PATH, or from `pip install nvidia-cuda-cuobjdump
nvidia-cuda-nvdisasm`).

Usage: python scripts/sass_loop.py loop CUBIN KERNEL [--op HMMA]
       python scripts/sass_loop.py diff CUBIN_A CUBIN_B
       python scripts/sass_loop.py diff DIR_A DIR_B        (every cubin under DIR_A against the same path under DIR_B,
                                                            e.g. two trees' scripts/build_gpu_bundles.py outputs)
       python scripts/sass_loop.py early CUBIN KERNEL [KERNEL ...]"""
from __future__ import annotations

import argparse
import collections
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
FUNC = re.compile(r"^\s*Function : (\S+)")
TARGET = re.compile(r"\b0x([0-9a-f]+)\b")


def cuobjdump() -> str:
    """The cuobjdump binary: on PATH, or the one the nvidia-cuda-cuobjdump wheel installs."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia
        for base in nvidia.__path__:
            for cand in sorted(Path(base).glob("cu*/bin/cuobjdump")):
                return str(cand)
    except ImportError:
        pass
    sys.exit("sass_loop: cuobjdump not found (put it on PATH or `pip install nvidia-cuda-cuobjdump`)")


def sass(cubin: str, kernel: str | None = None) -> str:
    tool = cuobjdump()
    cmd = [tool, "-sass", cubin] + (["-fun", kernel] if kernel else [])
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(tool).parent), os.environ.get("PATH", "")]))  # its nvdisasm
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode != 0:
        sys.exit(f"sass_loop: {' '.join(cmd)} failed: {run.stderr.strip()}")
    return run.stdout


def instructions(text: str) -> list[tuple[int, str]]:
    """(address, instruction text without its encoding) for each SASS line of one function."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(INSTR.match, text.splitlines()) if m]


def opcode(instr: str) -> str:
    """The opcode without its modifiers or predicate: '@!P0 LDS.128 R4, [R2]' -> 'LDS'."""
    words = instr.split()
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return op.split(".")[0]


def inner_loop(ins: list[tuple[int, str]], op: str) -> list[tuple[int, str]]:
    """The shortest span [branch target, backward branch] that encloses every instruction of opcode `op`."""
    at = [i for i, (_, t) in enumerate(ins) if opcode(t) == op]
    if not at:
        raise ValueError(f"no {op} instruction")
    first, last = ins[at[0]][0], ins[at[-1]][0]
    index = {a: i for i, (a, _) in enumerate(ins)}
    best = None
    for j, (a, t) in enumerate(ins):
        m = TARGET.search(t) if opcode(t) == "BRA" else None
        if m and a >= last:
            tgt = int(m.group(1), 16)
            if tgt <= first and tgt in index and (best is None or j - index[tgt] < best[1] - best[0]):
                best = (index[tgt], j)
    if best is None:
        raise ValueError(f"no backward branch encloses the {op} instructions")
    return ins[best[0]:best[1] + 1]


def wait_split(ins: list[tuple[int, str]]) -> tuple[list[str], list[str]]:
    """A kernel's global loads (LDG) before its first grid-dependency wait (ACQBULK) and after it; no wait: all
    after."""
    ops = [opcode(t) for _, t in ins]
    at = ops.index("ACQBULK") if "ACQBULK" in ops else -1
    loads = [(i, t) for i, (_, t) in enumerate(ins) if ops[i] == "LDG"]
    return [t for i, t in loads if i < at], [t for i, t in loads if i > at]


def first_positions(ins: list[tuple[int, str]]) -> dict[str, int | None]:
    """Where a kernel's first strong global load, first weight copy (cp.async: LDGSTS, or a bulk copy: UBLKCP /
    UTMALDG) and first grid-dependency wait (ACQBULK) stand (instruction indices; None: absent). A load meant to be
    in flight before the block's copies (the streamed GEMVs' tensor scale, templates/gemv_ring.cu.j2) stands before
    the first copy, not merely before the wait."""
    ops = [opcode(t) for _, t in ins]
    def first(pred):
        return next((i for i, (o, (_, t)) in enumerate(zip(ops, ins)) if pred(o, t)), None)
    return {"strong": first(lambda o, t: o == "LDG" and strong(t)),
            "copy": first(lambda o, t: o in ("LDGSTS", "UBLKCP", "UTMALDG")),
            "wait": first(lambda o, t: o == "ACQBULK")}


def strong(instr: str) -> bool:
    """A strong load (ld.relaxed / ld.volatile: LDG.E...STRONG.GPU / .SYS), which ptxas keeps where it stands."""
    return ".STRONG." in instr


def functions(text: str) -> dict[str, str]:
    """A digest of each function's SASS with addresses and encodings stripped."""
    out, cur, body = {}, None, []
    for line in text.splitlines():
        m = FUNC.match(line)
        if m:
            if cur:
                out[cur] = hashlib.sha256("\n".join(body).encode()).hexdigest()
            cur, body = m.group(1), []
        elif cur:
            i = INSTR.match(line)
            if i:
                body.append(i.group(2))
    if cur:
        out[cur] = hashlib.sha256("\n".join(body).encode()).hexdigest()
    return out


def cubin_pairs(a: Path, b: Path) -> tuple[list[str], list[str]]:
    """The cubins' paths relative to directories a and b: those under both, and those under one only (sorted)."""
    ra = {str(c.relative_to(a)) for c in a.rglob("*.cubin")}
    rb = {str(c.relative_to(b)) for c in b.rglob("*.cubin")}
    return sorted(ra & rb), sorted(ra ^ rb)


def diff_cubins(a: str, b: str, quiet: bool = False) -> bool:
    """Print which functions of cubins a and b differ (quiet: nothing where none does); whether any does."""
    fa, fb = functions(sass(a)), functions(sass(b))
    differ = sorted(k for k in fa.keys() & fb.keys() if fa[k] != fb[k])
    only = sorted(fa.keys() ^ fb.keys())
    if quiet and not (differ or only):
        return False
    print(f"{len(fa.keys() & fb.keys())} functions in both, {len(differ)} differ, {len(only)} in one only")
    for k in differ:
        print(f"  differs: {k}")
    for k in only:
        print(f"  only in {'A' if k in fa else 'B'}: {k}")
    return bool(differ or only)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    lp = sub.add_parser("loop", help="the opcode counts of a kernel's inner loop")
    lp.add_argument("cubin")
    lp.add_argument("kernel")
    lp.add_argument("--op", default="HMMA", help="an opcode the loop must enclose (HMMA, HGMMA, ...)")
    dp = sub.add_parser("diff", help="the functions whose SASS differs between two cubins")
    dp.add_argument("a")
    dp.add_argument("b")
    ep = sub.add_parser("early", help="each kernel's global loads before and after its grid-dependency wait")
    ep.add_argument("cubin")
    ep.add_argument("kernels", nargs="+")
    a = ap.parse_args()
    if a.cmd == "early":
        for k in a.kernels:
            ins = instructions(sass(a.cubin, k))
            before, after = wait_split(ins)
            f = first_positions(ins)
            ahead = ("" if f["strong"] is None or f["copy"] is None else
                     f"; its first strong load {'before' if f['strong'] < f['copy'] else 'after'} its first copy")
            print(f"{k}: before the wait {len(before)} loads ({sum(map(strong, before))} strong), "
                  f"after it {len(after)} ({sum(map(strong, after))} strong){ahead}")
        return 0
    if a.cmd == "loop":
        try:
            body = inner_loop(instructions(sass(a.cubin, a.kernel)), a.op)
        except ValueError as e:
            sys.exit(f"sass_loop: {a.kernel}: {e}")
        counts = collections.Counter(opcode(t) for _, t in body)
        print(f"{a.kernel}: inner loop of {len(body)} instructions, {counts[a.op]} {a.op}")
        for op, n in counts.most_common():
            print(f"  {op:10s} {n:5d}")
        return 0
    da, db = Path(a.a), Path(a.b)
    if da.is_dir() != db.is_dir():
        sys.exit("sass_loop: diff takes two cubins or two directories")
    if not da.is_dir():
        return 1 if diff_cubins(a.a, a.b) else 0
    both, one = cubin_pairs(da, db)
    changed = 0
    for rel in both:
        print(f"{rel}: ", end="", flush=True)
        if diff_cubins(str(da / rel), str(db / rel), quiet=True):
            changed += 1
        else:
            print("identical")
    for rel in one:
        print(f"{rel}: only under {'A' if (da / rel).exists() else 'B'}")
    print(f"{len(both)} cubins under both, {changed} with functions that differ, {len(one)} under one only")
    return 1 if changed or one else 0


if __name__ == "__main__":
    sys.exit(main())
