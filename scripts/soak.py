#!/usr/bin/env python
"""Soak a server: start `impc serve BUNDLE`, keep N streaming clients busy for M minutes with
scripts/bench_serve.py rounds, and record the server's resident memory (VmRSS from /proc) every minute.
Prints requests, failures, and the RSS after the first minute against the last, as a fraction.

Usage: python scripts/soak.py BUNDLE [--minutes 30] [--clients 8] [--device cpu] [--port 8787]"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--port", type=int, default=8787)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    a = ap.parse_args()
    import httpx

    server = subprocess.Popen([sys.executable, "-m", "impc.cli", "serve", a.bundle, "--port", str(a.port),
                               "--device", a.device, "--max-running", str(a.clients), "--log-level", "warning"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{a.port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise SystemExit("server did not come up")
        rss_start = round(rss_mib(server.pid), 1)          # loaded, before any request
        print(f"server up: RSS {rss_start} MiB", flush=True)
        t0, samples, totals, rnd = time.time(), [], {"requests": 0, "failures": 0, "output_tokens": 0}, 0
        next_sample = t0 + 60
        while time.time() - t0 < a.minutes * 60:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_serve.py"), url, "--clients",
                                str(a.clients), "--requests", str(2 * a.clients), "--prompt-len", str(a.prompt_len),
                                "--output-len", str(a.output_len), "--prompt-jitter", "0.5", "--seed", str(rnd),
                                "--json", f.name], capture_output=True, text=True, timeout=3600)
                try:
                    r = json.loads(Path(f.name).read_text())
                except (OSError, json.JSONDecodeError):
                    r = {"requests": 2 * a.clients, "failures": 2 * a.clients, "output_tokens": 0}
            rnd += 1
            for k in totals:
                totals[k] += int(r.get(k) or 0)
            if time.time() >= next_sample:
                samples.append((round((time.time() - t0) / 60, 1), round(rss_mib(server.pid), 1)))
                print(f"minute {samples[-1][0]}: RSS {samples[-1][1]} MiB, {totals}", flush=True)
                next_sample += 60
        health = httpx.get(url + "/health", timeout=5).status_code
        first, last = samples[0][1], samples[-1][1]
        print(json.dumps({"minutes": a.minutes, "clients": a.clients, **totals, "health": health,
                          "rss_at_start_mib": rss_start, "rss_first_minute_mib": first, "rss_last_mib": last,
                          "rss_growth": round(last / first - 1, 4), "samples": samples}))
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
