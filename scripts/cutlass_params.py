#!/usr/bin/env python
"""A CUTLASS GEMM's Params built without a GPU, as `--prefill-gemm cutlass` builds them (impc/cutlass.py: the probe
that templates/cutlass_gemm.cuh.j2 compiles into with IMP_CUTLASS_PROBE): per "M N K beta", one JSON line with the
Params bytes, each TMA descriptor's offset and encode arguments, the raw pointers in them and the launch geometry;
with --table, the program's table for rows up to M instead (the words that change by 128-row bucket, and the grids).

Usage: scripts/cutlass_params.py [--fmt bf16|f16] [--table] "M N K beta" ...     (default "4096 6144 4096 0")"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from impc.cutlass import SCALED, _probe, params_table  # noqa: E402
from impc.errors import CompileError  # noqa: E402
from impc.launch_linear import F16_NVFP4_UNSCALE  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shapes", nargs="*", default=["4096 6144 4096 0"])
    ap.add_argument("--fmt", default="bf16", choices=["bf16", "f16"],
                    help="bf16 weights, or NVFP4's fp16 copies (the scaled kernel)")
    ap.add_argument("--table", action="store_true", help="the program's table for rows up to M")
    ap.add_argument("--sms", type=int, default=132, help="the GPU's SMs (default the H200's)")
    args = ap.parse_args()
    alpha = F16_NVFP4_UNSCALE if args.fmt in SCALED else 1.0
    try:
        for text in args.shapes:
            m, n, k, beta = (int(x) for x in text.split())
            out = params_table(args.fmt, n, k, float(beta), m, args.sms, alpha) if args.table else \
                _probe(args.fmt, [(m, n, k, alpha, float(beta), args.sms)], 0)[0]
            print(json.dumps(out))
    except CompileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
