#!/usr/bin/env python
"""The prefill peer of issue 9: a plain PyTorch model of a checkpoint's shape in bf16 (transformers, cuBLAS GEMMs,
SDPA attention, eager), random weights, prefilling T tokens in one forward with the logits of the last token only
(as an inference engine computes them). Prints tok/s per prompt length, medians of --runs timed forwards after a
warm-up: run it in the same device call as `impc bench BUNDLE --pp ...` of the same shape, so both see one GPU.

Usage: scripts/prefill_peer.py examples/qwen3-8b.json [--pp 128,512,4096] [--runs 5]"""
from __future__ import annotations

import argparse
import json
import statistics
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="a config.json of the shape (examples/*.json)")
    ap.add_argument("--pp", default="128,512,4096", help="prompt lengths (comma-separated)")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:
        print(f"prefill_peer: needs torch and transformers ({e})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("prefill_peer: no CUDA device", file=sys.stderr)
        return 2
    cfg = json.loads(open(args.config).read())
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    print(f"peer: {type(model).__name__} bf16, {params / 1e9:.2f} B parameters, SDPA attention, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for t in (int(x) for x in args.pp.split(",")):
        ids = torch.randint(0, config.vocab_size, (1, t), device="cuda")

        def forward():
            try:
                return model(input_ids=ids, use_cache=False, logits_to_keep=1)
            except TypeError:                       # transformers before logits_to_keep
                return model(input_ids=ids, use_cache=False)
        with torch.inference_mode():
            for _ in range(2):
                forward()
            torch.cuda.synchronize()
            ms = []
            for _ in range(args.runs):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                forward()
                e1.record()
                torch.cuda.synchronize()
                ms.append(e0.elapsed_time(e1))
        med = statistics.median(ms)
        print(f"  peer prefill pp{t:<6d} {t / med * 1e3:10.0f} tok/s  ({med:.1f} ms, median of {args.runs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
