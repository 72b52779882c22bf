"""`impc eval`: KL, top-1 agreement and perplexities against torch's own functions on the cpu
executor's logits, its machine-readable last line, and one-line errors."""
from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from imp_runtime.bundle import load_bundle
from imp_runtime.executor_cpu import CpuExecutor
from imp_runtime.kv_blocks import SoloSequence
from tests.conftest import VOCAB

LAST_LINE = re.compile(r"^kl=(\S+) top1=(\S+) ppl=(\S+) ref_ppl=(\S+)$")


def impc_eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "impc.cli", "eval", *map(str, args)], capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    rng = np.random.default_rng(11)
    f = tmp_path_factory.mktemp("eval") / "words.txt"
    f.write_text(" ".join(f"w{i}" for i in rng.integers(4, VOCAB, 150)))
    return f


def logits(bundle, ids: list[int]) -> np.ndarray:
    return SoloSequence(CpuExecutor(load_bundle(bundle))).prefill(ids, all_logits=True)


def oracle(bundle, ref, ids: list[int], chunk: int) -> tuple[float, float, float, float]:
    """The same figures from the cpu executor's logits and torch's functions: F.kl_div, argmax,
    F.cross_entropy over every predicted position."""
    import torch
    import torch.nn.functional as F

    kl, agree, nll, ref_nll, n = 0.0, 0, 0.0, 0.0, 0
    for i in range(0, len(ids), chunk):
        part = ids[i:i + chunk]
        c = torch.from_numpy(logits(bundle, part)).double()[:-1]
        r = torch.from_numpy(logits(ref, part)).double()[:-1]
        target = torch.tensor(part[1:])
        kl += float(F.kl_div(F.log_softmax(c, -1), F.log_softmax(r, -1), log_target=True, reduction="sum"))
        agree += int((c.argmax(-1) == r.argmax(-1)).sum())
        nll += float(F.cross_entropy(c, target, reduction="sum"))
        ref_nll += float(F.cross_entropy(r, target, reduction="sum"))
        n += len(target)
    return kl / n, agree / n, float(np.exp(nll / n)), float(np.exp(ref_nll / n))


def test_eval_figures_match_torch(bundles, text_file):
    cand, ref = bundles("llama", "nvfp4"), bundles("llama", "bf16")
    r = impc_eval(cand, "--ref", ref, "--text", text_file, "--chunk", "64")
    assert r.returncode == 0, r.stderr
    got = [float(v) for v in LAST_LINE.match(r.stdout.strip().splitlines()[-1]).groups()]
    ids = [int(w[1:]) for w in text_file.read_text().split()]
    want = oracle(cand, ref, ids, 64)
    assert want[0] > 1e-4 and want[1] < 1.0           # the two bundles really differ
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-4)


def test_eval_of_a_bundle_against_itself(bundles, text_file):
    b = bundles("llama", "bf16")
    r = impc_eval(b, "--ref", b, "--text", text_file, "--tokens", "100")
    kl, top1, ppl, ref_ppl = LAST_LINE.match(r.stdout.strip().splitlines()[-1]).groups()
    assert float(kl) == 0.0 and float(top1) == 1.0 and ppl == ref_ppl


def test_eval_errors_are_one_line(bundles, tmp_path):
    b = bundles("llama", "bf16")
    for args in [(b, "--ref", tmp_path), (b, "--ref", b, "--text", tmp_path / "missing.txt")]:
        r = impc_eval(*args)
        assert r.returncode == 1 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
