"""Progress on long steps: one line per stage, a counter redrawn in place when stderr is a terminal."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self._last = 0.0

    def stage(self, text: str) -> None:
        if not self.quiet:
            print(f"[{time.perf_counter() - self.t0:6.1f}s] {text}", file=sys.stderr, flush=True)

    def count(self, what: str, i: int, n: int) -> None:
        """Redraw 'what i/n' at most 10 times a second on a terminal; once at the end otherwise."""
        if self.quiet:
            return
        now = time.perf_counter()
        if self.tty and (now - self._last > 0.1 or i == n):
            self._last = now
            print(f"\r         {what} {i}/{n}", end="\n" if i == n else "", file=sys.stderr, flush=True)

    def info(self, text: str) -> None:
        if not self.quiet:
            print(f"         {text}", file=sys.stderr, flush=True)
