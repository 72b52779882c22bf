"""The phase timers' developer build (templates/prelude.cuh.j2 phase_mark, scripts/kernel_phases.py): compiled in
only with IMP_KERNEL_TIMERS=1, and the script's table from hand-made timer values."""
import numpy as np
import pytest

from tests.test_templates_compile import SHAPES, _nvcc


def test_phase_table_from_hand_made_timers():
    from scripts.kernel_phases import phase_table
    t = np.zeros((8, 4), np.uint64)
    # three blocks: entries at 1000, 1500, 3000 ns; block 2 does not reach phase 2; block 3 is not the launch's
    t[0, :3] = (1000, 2000, 9000)
    t[1, :3] = (1500, 2500, 4000)
    t[2, :3] = (3000, 3000, 700)      # phase 2 left by an earlier launch (older than the block's entry)
    t[3, :3] = (10, 20, 30)
    rows = phase_table(t, 3, ("entry", "waited", "done", "never"))
    assert [r[0] for r in rows] == ["entry", "waited", "done"]
    assert rows[0] == ("entry", 3, 0.0, 0.5, 2.0)
    assert rows[1] == ("waited", 3, 1.0, 1.5, 2.0)
    assert rows[2] == ("done", 2, 3.0, 5.5, 8.0)


def test_wait_share_from_hand_made_counts():
    from scripts.kernel_phases import wait_share
    c = np.zeros((6, 8), np.uint64)
    c[0, :3] = (300, 1000, 4)        # 30% waiting, 250 cycles a stage
    c[1, :3] = (500, 1000, 5)        # 50%, 200
    c[2, :3] = (100, 1000, 2)        # 10%, 500
    c[3, :3] = (0, 0, 0)             # a block without tiles: left out
    c[5, :3] = (999, 1000, 1)        # past the launch's blocks
    assert wait_share(c, 4) == (0.3, 0.1, 0.5, 250.0)
    assert wait_share(np.zeros((4, 8), np.uint64), 4) is None


def test_timers_only_in_the_developer_build(monkeypatch):
    from impc.emit import compile_cubin, render
    from impc.targets import load_target
    t = load_target("sm_90a")
    spec = SHAPES["qwen3-8b"]
    monkeypatch.delenv("IMP_KERNEL_TIMERS", raising=False)
    plain = render(spec, t, {})
    assert "__device__ unsigned long long imp_timers" not in plain and "phase_mark(TIMER_GEMV, 1)" in plain
    monkeypatch.setenv("IMP_KERNEL_TIMERS", "1")
    timed = render(spec, t, {})
    assert "__device__ unsigned long long imp_timers" in timed
    # the marked kernels compile with the timers (prelude, the GEMV's and the attention's families, what they use)
    parts = timed.split("// ==== ")
    keep = {"gemv.cu.j2", "rmsnorm.cu.j2", "act.cu.j2", "attn_decode.cu.j2"}
    src = "// ==== ".join([parts[0]] + [p for p in parts[1:] if p.split(" ")[0] in keep])
    nv, ver = _nvcc()
    cubin, _ = compile_cubin(src, t, nv, ver)
    assert b"imp_timers" in cubin and b"imp_counters" in cubin
