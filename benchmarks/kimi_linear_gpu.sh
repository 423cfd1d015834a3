#!/usr/bin/env bash
# Issue 54's engine rows for Kimi Linear 48B-A3B on one lent GPU, in one device call:
#   source benchmarks/device_env.sh; bash benchmarks/kimi_linear_gpu.sh [SECONDS] [diag]
# Each row is `k3batch bench engine --flavor kimi-linear` (random weights made on the GPU) with
# its JSON appended to $OUT/engine_kimi_linear.jsonl and its output to $OUT/engine_kimi_linear.txt;
# rows run in order while SECONDS (default 540) last. bf16 experts (98 GB, the public checkpoint's
# dtype) first where the GPU holds them (an H200), then MXFP4 experts (packed, 29 GB). Decode rows run 64 new tokens
# (a few steps would time the overlap's fill and drain, not the step); the 1 x 8,192 prefill
# runs with and without the prefix cache (with it the prompt is also cut at 8,176: a second
# forward of 16 tokens), the first under the profiler. With diag, first benchmarks/prefill_host_gpu.py:
# one 8K forward's host enqueue time against its GPU time, and its synchronizing calls.
set -u
budget=${1:-540}
t0=$SECONDS
gib=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)")
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
[ "${2:-}" = diag ] && timeout 120 python3 benchmarks/prefill_host_gpu.py --flavor kimi-linear --experts mxfp4 \
  --tokens 8192 2>&1 | grep -v Warning | tee "$OUT/prefill_host_gpu.txt"
rows=()
for experts in bf16 mxfp4; do
  [ $experts = bf16 ] && [ "$gib" -lt 120 ] && continue
  rows+=("$experts 1 8192 64 --no-prefix-cache --profile" "$experts 16 1024 64"
         "$experts 64 1024 64" "$experts 256 1024 64" "$experts 1 8192 64")
done
for row in "${rows[@]}"; do
  read -r experts batch len new extra <<<"$row"
  left=$((budget - (SECONDS - t0)))
  [ "$left" -lt 60 ] && { echo "skipped (time): $row"; continue; }
  echo "=== $row ($left s left)"
  timeout "$left" python3 -m k3batch.cli bench engine --flavor kimi-linear --device cuda \
    --expert-dtype "$experts" --batch "$batch" --prompt-len "$len" --new-tokens "$new" \
    --chunk-size 8192 $extra --json "$OUT/engine_kimi_linear.jsonl" 2>&1 | grep -v Warning
done 2>&1 | tee -a "$OUT/engine_kimi_linear.txt"
