"""scripts/ab_bench.py: `impc bench` output parsed, and two bundles' alternating rounds summarised by hand-computed
medians and spreads."""
from __future__ import annotations

import pytest

BENCH = """qwen3-8b: synthetic
  decode  batch   1  tg128       383.7 tok/s  (2.61 ms/step)
  decode  batch   2  tg128       720.4 tok/s  (2.78 ms/step)
  prefill pp512               36299 tok/s  (14.1 ms)
  time to first token (128-token prompt)  6.6 ms
  decode batch 1 weight bandwidth 1.98 TB/s = 47% of the measured copy bandwidth 4.22 TB/s
"""


def test_parse_bench():
    from scripts.ab_bench import parse_bench
    assert parse_bench(BENCH) == {"decode batch 1": 383.7, "decode batch 2": 720.4, "prefill pp512": 36299.0,
                                  "b1 weights TB/s": 1.98, "copy TB/s": 4.22}


def test_parse_bench_reads_the_ahead_and_host_serial_figures_of_format_table():
    from impc.cli_bench import format_table
    from scripts.ab_bench import parse_bench
    r = {"bundle": "b", "gpu": "g", "target": "t", "runs": 3, "tg": 64, "load_s": 1.0, "prefill": {},
         "peak_gpu_memory_bytes": 2**30, "memory": {"weights_bytes": 0, "kv_bytes": 0, "scratch_bytes": 0},
         "decode": {"8": {"tok_s": 3001.5, "step_ms": 8 / 3.0015, "serial_tok_s": 2819.25, "ahead": True},
                    "1": {"tok_s": 445.0, "step_ms": 1 / 0.445, "serial_tok_s": 445.0, "ahead": False}}}
    text = format_table(r)
    assert "tg64" in text
    assert parse_bench(text) == {"decode batch 8": 3001.5, "decode batch 8 host-serial": 2819.2, "decode batch 1": 445.0}


def test_summarize_medians_and_spreads():
    from scripts.ab_bench import summarize
    a = [{"decode batch 1": v, "prefill pp512": 100.0} for v in (380.0, 390.0, 370.0)]
    b = [{"decode batch 1": v} for v in (400.0, 396.0, 404.0)]
    rows = summarize({"A": a, "B": b})
    assert [r[0] for r in rows] == ["decode batch 1"]          # pp512 is not in B's rounds
    name, ma, mb, d, sa, sb = rows[0]
    assert (ma, mb) == (380.0, 400.0)
    assert d == pytest.approx(400 / 380 - 1)
    assert sa == pytest.approx(20 / 380) and sb == pytest.approx(8 / 400)


def test_summarize_a_third_bundle_against_a():
    """A third bundle's rows (ab_bench A B C) compare it with A, not with B."""
    from scripts.ab_bench import summarize
    rounds = {"A": [{"decode batch 1": v} for v in (500.0, 510.0, 505.0)],
              "B": [{"decode batch 1": v} for v in (520.0, 530.0, 525.0)],
              "C": [{"decode batch 1": v} for v in (450.0, 459.0, 454.5)]}
    (name, ma, mc, d, sa, sc), = summarize(rounds, "C")
    assert (ma, mc) == (505.0, 454.5)
    assert d == pytest.approx(454.5 / 505 - 1)
    assert sa == pytest.approx(10 / 505) and sc == pytest.approx(9 / 454.5)


@pytest.mark.parametrize("args,msg", [(["--batches", "1,x"], "--batches 1,x: give whole numbers"),
                                      (["--batches", "0,8"], "at least 1"), (["--pp", "-5"], "--pp -5"),
                                      (["--tg", "0"], "--tg 0: must be at least 1"),
                                      (["--runs", "0"], "--runs 0: must be at least 1")])
def test_bench_refuses_bad_counts_before_touching_a_gpu(tmp_path, capsys, args, msg):
    """`impc bench` with a malformed count: exit 2 and a one-line reason, no traceback, no GPU needed."""
    import argparse

    from impc.cli_bench import add_parser, cmd_bench
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    a = p.parse_args(["bench", str(tmp_path), *args])
    assert cmd_bench(a) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err
