"""GPU targets: one folder under targets/ each, holding target.json (arch flags, VRAM, SM count,
shared memory and the tile choices the templates read)."""
from __future__ import annotations

import json
from pathlib import Path

from impc.errors import CompileError, data_dir

TARGETS_DIR = data_dir("targets")
DEFAULT_TARGETS = ("sm_90a", "sm_120a")


def available_targets() -> list[str]:
    return sorted(p.parent.name for p in TARGETS_DIR.glob("*/target.json"))


def load_target(name: str) -> dict:
    path = TARGETS_DIR / name / "target.json"
    if not path.is_file():
        raise CompileError(f"unknown target '{name}'; available: {', '.join(available_targets())}")
    return json.loads(path.read_text())


def parse_targets(arg: str | None) -> list[dict]:
    """'sm_90a,sm_120a' -> target dicts; 'none' -> [] (a bundle for the cpu executor only)."""
    if arg is None:
        names = list(DEFAULT_TARGETS)
    elif arg.strip().lower() in ("", "none"):
        names = []
    else:
        names = [t.strip() for t in arg.split(",") if t.strip()]
    return [load_target(n) for n in dict.fromkeys(names)]
