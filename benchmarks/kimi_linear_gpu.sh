#!/usr/bin/env bash
# Issue 54's engine rows for Kimi Linear 48B-A3B on one lent GPU, in one device call:
#   source benchmarks/device_env.sh; bash benchmarks/kimi_linear_gpu.sh [SECONDS]
# Each row is `k3batch bench engine --flavor kimi-linear` (random weights made on the GPU) with
# its JSON appended to $OUT/engine_kimi_linear.jsonl and its output to $OUT/engine_kimi_linear.txt;
# rows run in order while SECONDS (default 540) last. MXFP4 experts (packed, 29 GB) on any card;
# bf16 experts (98 GB) only where the GPU holds them (an H200).
set -u
budget=${1:-540}
t0=$SECONDS
gib=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)")
rows=(
  "mxfp4 1 8192 4" "mxfp4 64 1024 4" "mxfp4 16 1024 8" "mxfp4 256 1024 4"
)
[ "$gib" -ge 120 ] && rows+=("bf16 1 8192 4" "bf16 64 1024 4" "bf16 16 1024 8")
for row in "${rows[@]}"; do
  read -r experts batch len new <<<"$row"
  left=$((budget - (SECONDS - t0)))
  [ "$left" -lt 60 ] && { echo "skipped (time): $row"; continue; }
  echo "=== $row ($left s left)"
  timeout "$left" python3 -m k3batch.cli bench engine --flavor kimi-linear --device cuda \
    --expert-dtype "$experts" --batch "$batch" --prompt-len "$len" --new-tokens "$new" \
    --chunk-size 8192 --json "$OUT/engine_kimi_linear.jsonl" 2>&1 | grep -v Warning
done 2>&1 | tee -a "$OUT/engine_kimi_linear.txt"
