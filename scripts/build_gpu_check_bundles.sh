#!/usr/bin/env bash
# Build every bundle scripts/gpu_check.sh carries to the GPU machine, with the current templates, on a
# machine with the compiler wheels. SmolLM2's bundle (~111 MiB) is over the 64 MiB we can send to the GPU
# machine at a time, so it is split in two: build/smol-a (manifest, tokenizer, cubin, the first 54,000,000 bytes of
# weights) for phase a and build/smol-b (the rest) for phase b, which reassembles it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
rm -rf build/gpu-bundles build/syn-qwen3-8b build/syn-qwen3-8b-qh build/syn-llama-8b
$PY scripts/build_gpu_bundles.py 2>&1 | tail -3
$PY -m impc.cli compile --synthetic examples/qwen3-8b.json -o build/syn-qwen3-8b --target sm_90a --max-context 8192 -q
$PY -m impc.cli compile --synthetic examples/qwen3-8b.json -o build/syn-qwen3-8b-qh --quant-head --target sm_90a --max-context 8192 -q
$PY -m impc.cli compile --synthetic examples/llama-3.1-8b.json -o build/syn-llama-8b --target sm_90a --max-context 8192 -q
rm -rf build/smollm2 build/smol-a build/smol-b
$PY -m impc.cli compile smollm2 -o build/smollm2 --target sm_90a -q
mkdir -p build/smol-a/kernels build/smol-b
cp build/smollm2/manifest.json build/smollm2/tokenizer.json build/smollm2/chat_template.jinja build/smol-a/
cp build/smollm2/kernels/sm_90a.cubin build/smol-a/kernels/
head -c 54000000 build/smollm2/weights.safetensors > build/smol-a/weights.part-a
tail -c +54000001 build/smollm2/weights.safetensors > build/smol-b/weights.part-b
cmp <(cat build/smol-a/weights.part-a build/smol-b/weights.part-b) build/smollm2/weights.safetensors
echo "bundles built; split OK"
