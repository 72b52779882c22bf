"""experiments/: kernel probes kept as patches against the templates (scripts/gpu_kit.sh `patch:NAME:FILE` builds the
bench bundles with one applied, for an A/B on the GPU). A probe that no longer applies to the tree would fail the
next GPU session's kit build, after its device time has started; this says so here instead: mend the patch or
delete it."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PATCHES = sorted((ROOT / "experiments").glob("*.patch"))


@pytest.mark.skipif(not (ROOT / ".git").exists() or shutil.which("git") is None, reason="not a git checkout")
@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_probe_patch_applies_to_the_tree(patch):
    run = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, f"{patch.name} no longer applies: {run.stderr.strip()}"
    touched = [line[len("+++ b/"):] for line in patch.read_text().splitlines() if line.startswith("+++ b/")]
    assert touched and all(t.startswith("templates/") for t in touched), f"{patch.name}: a probe patches templates only"
