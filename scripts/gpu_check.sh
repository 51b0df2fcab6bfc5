#!/usr/bin/env bash
# The whole GPU check of issues 12 and 13 in one go (well under 10 minutes on an H100), from a checkout:
#   1. environment: GPU, driver, torch / triton / transformers versions
#   2. the kernel benchmark (`radixserve bench kernels`): correctness vs fp32 references, eager and
#      CUDA-graph timings, SDPA comparison, fused-kernel timings
#   3. `radixserve bench step` on random-weight Llama-3.2-1B and Llama-3.1-8B shapes, graphs on/off,
#      overlap on/off, greedy and top-p side by side, with the roofline fraction, device time and the
#      host time the device waited for
#   4. greedy equality on the GPU (tests/engine/test_gpu.py): fp32 vs transformers, bf16 Triton vs torch backend
#   5. an end-to-end `radixserve bench` on the 1B shape (random bf16 weights written here) against
#      transformers
#   6. speculative decoding on the 1B shape: the regenerate and edit workloads with speculation on and
#      off (`radixserve-nospec`) and transformers' prompt lookup; verification steps run eager (the
#      CUDA graphs cover one-token decodes), tests/engine/test_gpu.py checks their equality
#   7. the FP8 KV cache (issue 30): the 8B shape's decode step at batch 64 x 4k context with the cache
#      in bf16 and in FP8 (`--kv-cache-dtype fp8`); tests/engine/test_gpu.py checks the FP8 kernels' bytes
#   8. sliding windows (issue 45): a Gemma-3-1B-shaped decode step at 32k context, as published (5 sliding
#      layers of 512 to 1 full) and with every layer full, at batch 1 and 16; and (issue 46) the published
#      layout with the sliding layers in window blocks (`--sliding-window-kv window-blocks`, eager)
#   9. mixture-of-experts (issue 45): the fused Triton MoE at batch 1 and 64 against the active experts'
#      bytes (`radixserve bench check moe`), and a Qwen3-30B-A3B-shaped decode step (layers cut to fit)
#  10. quantized weights (issue 47): the FP8 and int4 dequantize-GEMM kernels against their references on
#      CUDA, and their decode GEMMs of the 8B shapes at batch 1 and 64 against the roofline of their weight
#      bytes, beside torch's bf16 linear (scripts/quant_gemm_check.py, well under a minute)
#  11. hybrid models (issue 46): the recurrent scans' chunked prefill against token by token, correctness
#      and speed at Qwen3.5's and Nemotron-H's layer shapes (scripts/recurrent_check.py); a Qwen3.5-shaped
#      random checkpoint (~2B, its Gated DeltaNet layers on the Triton recurrent kernels) through
#      `radixserve bench` multi-turn and random, cache on vs off, and its decode step with CUDA graphs on and off
#      (tests/engine/test_gpu.py checks the kernels' models against transformers)
# Results go to $OUT (default ./gpu-results); docs/gpu-results.md shows them (copied into docs/gpu/,
# `radixserve bench gpu-results docs/gpu > docs/gpu-results.md` renders that page).
#
# Works on a machine with torch, triton and transformers preinstalled and no network: radixserve and
# its benchmark (radixserve_bench) run from the checkout (PYTHONPATH), missing pure-Python packages
# come as wheels in .whl/, and the Llama shapes borrow the embedded model's tokenizer files from $RADIXSERVE_TOKENIZER
# (default .gpu/tokenizer; `make gpu-bundle` fills .whl/ and .gpu/ on a machine with the network).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
LOG="$OUT/gpu-check.log"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/rs-site .whl/*.whl
  export PYTHONPATH=/tmp/rs-site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
TOKENIZER=${RADIXSERVE_TOKENIZER:-.gpu/tokenizer}
RS="python3 -m radixserve"
PARTS=${PARTS:-"kernels step equality e2e spec fp8 window moe quant hybrid"}  # a subset runs only those parts
want() { [[ " $PARTS " == *" $1 "* ]]; }
status=0
step() { echo; echo "=== $* ==="; }
run() { "$@" || { echo "FAILED ($?): $*"; status=1; }; }
{
  step environment
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| triton', triton.__version__, '| transformers', transformers.__version__)"

  if want kernels; then
    step "kernel benchmark"
    run timeout 150 $RS bench kernels --batches 1 16 64 --contexts 512 4096 --json "$OUT/kernels.json"
  fi
  if want step; then
    for shape in llama-3.2-1b llama-3.1-8b; do
      step "bench step $shape"
      run timeout 240 $RS bench step --shape "$shape" --overlap on,off --steps 16 --json "$OUT/step-$shape.json"
    done
  fi
  if want equality; then
    step "greedy equality on the GPU"
    run timeout 180 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py
  fi
  if want e2e; then
    step "end-to-end bench, llama-3.2-1b shape, random bf16 weights, vs transformers"
    run timeout 60 $RS bench random-checkpoint --shape llama-3.2-1b --tokenizer "$TOKENIZER" --out /tmp/rs-1b
    run timeout 240 $RS bench --model /tmp/rs-1b --device cuda --workload shared-prefix,multi-turn --repeats 1 \
        --systems radixserve,radixserve-nocache,hf-generate-batch --no-micro --no-progress --no-charts --out /tmp/rs-e2e
    cp /tmp/rs-e2e/results.json "$OUT/e2e-results.json" 2>/dev/null
    cp /tmp/rs-e2e/table.md "$OUT/e2e-table.md" 2>/dev/null
  fi
  if want spec; then
    step "speculative decoding, llama-3.2-1b shape, random bf16 weights: regenerate and edit, on / off"
    [ -d /tmp/rs-1b ] || run timeout 60 $RS bench random-checkpoint --shape llama-3.2-1b --tokenizer "$TOKENIZER" --out /tmp/rs-1b
    run timeout 240 $RS bench --model /tmp/rs-1b --device cuda --workload regenerate,edit,edit-prediction --repeats 1 \
        --systems radixserve,radixserve-nospec,hf-prompt-lookup --no-micro --no-progress --no-charts --out /tmp/rs-spec
    cp /tmp/rs-spec/results.json "$OUT/spec-results.json" 2>/dev/null
    cp /tmp/rs-spec/table.md "$OUT/spec-table.md" 2>/dev/null
  fi
  if want fp8; then
    step "FP8 KV cache: llama-3.1-8b shape, batch 64 x 4096 context, bf16 cache then FP8"
    for kv in auto fp8; do
      run timeout 240 $RS bench step --shape llama-3.1-8b --batch 64 --context 4096 --sampling greedy --steps 16 \
          --kv-cache-dtype "$kv" --json "$OUT/step-8b-kv-$kv.json"
    done
  fi
  if want window; then
    step "sliding windows: gemma-3-1b shape at 32k context: window blocks (auto), every token's K/V paged, every layer full"
    run timeout 120 $RS bench random-checkpoint --family gemma3 --size real --tokenizer "$TOKENIZER" --out /tmp/rs-gemma3
    mkdir -p /tmp/rs-gemma3-full && cp /tmp/rs-gemma3/*.json /tmp/rs-gemma3-full/ 2>/dev/null
    python3 -c "import json, sys; p = sys.argv[1]; c = json.load(open(p)); c['layer_types'] = ['full_attention'] * len(c['layer_types']); json.dump(c, open(p, 'w'))" /tmp/rs-gemma3-full/config.json
    for variant in gemma3 gemma3-full; do
      run timeout 240 $RS bench step --model "/tmp/rs-$variant" --load-format dummy --batch 1,16 --context 32768 \
          --sampling greedy --steps 16 --graphs on --json "$OUT/step-window-$variant.json"
    done
    run timeout 240 $RS bench step --model /tmp/rs-gemma3 --load-format dummy --batch 1,16 --context 32768 \
        --sampling greedy --steps 16 --graphs on --sliding-window-kv all \
        --json "$OUT/step-window-gemma3-all.json"
  fi
  if want moe; then
    step "mixture-of-experts: fused Triton MoE against the active bytes, and a qwen3-moe shaped decode step"
    run timeout 180 $RS bench moe --experts 128 --top-k 8 --batches 1 64 --dtypes bfloat16 --json "$OUT/moe-kernel.json"
    run timeout 120 $RS bench random-checkpoint --family qwen3-moe --size real --max-gb 20 --tokenizer "$TOKENIZER" \
        --out /tmp/rs-qwen3-moe
    run timeout 240 $RS bench step --model /tmp/rs-qwen3-moe --load-format dummy --batch 1,64 --context 2048 \
        --sampling greedy --steps 16 --graphs on --json "$OUT/step-moe.json"
  fi
  if want quant; then
    step "quantized weights: FP8 / int4 dequantize-GEMM correctness, 8B decode GEMMs vs the weight-bytes roofline"
    run timeout 120 python3 scripts/quant_gemm_check.py --json "$OUT/quant-gemm.json"
  fi
  if want hybrid; then
    step "hybrid: the scans' chunked prefill vs token by token; qwen3.5 shape (~2B, random bf16), cache on vs off"
    run timeout 120 python3 scripts/recurrent_check.py --json "$OUT/recurrent-scans.json"
    run timeout 120 $RS bench random-checkpoint --family qwen3.5 --size real --max-gb 4 --tokenizer "$TOKENIZER" \
        --out /tmp/rs-qwen35
    run timeout 300 $RS bench --model /tmp/rs-qwen35 --device cuda --workload multi-turn,random --repeats 1 \
        --systems radixserve,radixserve-nocache --no-micro --no-progress --no-charts --out /tmp/rs-hybrid
    cp /tmp/rs-hybrid/results.json "$OUT/hybrid-results.json" 2>/dev/null
    cp /tmp/rs-hybrid/table.md "$OUT/hybrid-table.md" 2>/dev/null
    # its decode step replayed from CUDA graphs (the recurrent kernels' items in static buffers) and eager
    run timeout 240 $RS bench step --model /tmp/rs-qwen35 --load-format dummy --batch 1,16 --context 2048 \
        --sampling greedy --steps 16 --graphs on,off --json "$OUT/step-hybrid-qwen35.json"
  fi
  echo; echo "gpu_check: exit $status"
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
