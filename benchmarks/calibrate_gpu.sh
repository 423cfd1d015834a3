#!/usr/bin/env bash
# Issue 55's calibration shards on one lent GPU, in one device call (after
# `source benchmarks/device_env.sh`): bash benchmarks/calibrate_gpu.sh [SECONDS] [TPS]
# For each tp of TPS (default 16,8,2, in that order, the earlier given more of the time: the K3 layout that fits an H200 node, the
# seed's TP8, the 2-GPU validation) `k3batch bench calibrate --flavor k3 --tp T --dcp T`: the
# probe's parts and MXFP4 experts at that shard, and MLA decode at DCP 1 and T; appended to this
# GPU's table (benchmarks/calibration_<gpu>.jsonl, copied to $OUT first so the run extends it).
set -u
budget=${1:-560}
tps=${2:-16,8,2}
t0=$SECONDS
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
table=calibration_${gpu}.jsonl
[ -f "benchmarks/$table" ] && cp "benchmarks/$table" "$OUT/$table"
IFS=, read -ra degrees <<<"$tps"
for i in "${!degrees[@]}"; do
  tp=${degrees[$i]}
  left=$((budget - (SECONDS - t0)))
  rest=$(( ${#degrees[@]} - i ))
  share=$(( left * (rest + 2) / ((rest + 2) * (rest + 3) / 2 - 3) ))  # weights n+2, ..., 4, 3
  [ "$share" -lt 30 ] && { echo "skipped (time): tp $tp"; continue; }
  echo "=== tp $tp, dcp 1 and $tp ($left s left, budget $share s)"
  timeout $((share + 60)) python3 -m k3batch.cli bench calibrate --flavor k3 --device cuda \
    --tp "$tp" --dcp "$tp" --experts mxfp4 --budget-s "$share" --out "$OUT/$table" 2>&1 |
    grep -v Warning | tail -4
done 2>&1 | tee "$OUT/calibrate_gpu.txt"
