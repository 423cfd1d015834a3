#!/usr/bin/env bash
# Issue 54 on one lent GPU, in one device call (after `source benchmarks/device_env.sh`):
#   bash benchmarks/kimi_linear_job_gpu.sh [SECONDS] [tests,diag,tune,job,job-warm] [TUNE_ROWS]
# diag: benchmarks/prefill_host_gpu.py on an 8K prefill (host enqueue vs GPU time, and syncs);
# tests: the GPU kernel tests at Kimi Linear's shapes against their fp32 references, and those
#   of the passes folded into other kernels (the GEMMs' gather and activation, the conv's q/k norm,
#   the combine's adds), and the routing;
# tune: `bench moe --sweep --save-tuned` at its bf16 prefill (8,192 tokens) and decode (16 and
#   256) expert shapes, MLA prefill/decode, KDA decode and our KDA prefill kernels (short conv,
#   chunk state) at its 32 heads, then MXFP4's, into
#   this GPU's tuned tables (the ones written, copied to $OUT/tuned_<op>_<GPU>.json: copy them
#   back to kernels/<op>/tuned/<GPU>.json); TUNE_ROWS, an extended regex, keeps the rows it
#   matches (`'bf16 8192|prefill'`: the bf16 prefill experts, MLA's and KDA's prefill kernels);
# job: `bench job --flavor kimi-linear --experts mxfp4` at 1,024 prompts of 1K in / 256 out
#   (cold: checkpoint written, Triton cache as carried; the bf16 checkpoint, 98 GB, does not fit
#   the lent machine's 64 GiB disk), then job-warm: the same job again with the checkpoint and
#   the compiled kernels in place (no engine-alone run).
# diag runs bf16 experts on a GPU of 120 GiB or more (an H200), else MXFP4.
set -u
budget=${1:-570}
parts=${2:-tests,diag,tune,job,job-warm}
tune_rows=${3:-.}
t0=$SECONDS
experts=mxfp4
[ "$(python3 -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)')" -ge 120 ] \
  && experts=bf16
left() { echo $((budget - (SECONDS - t0))); }
# a sweep's 12 fastest rows (fastest first; a bf16 prefill sweep has each tile with and without
# its folds, so both ways of the best tiles stay in the log), then the row the table took
best_rows() {
  local f; f=$(mktemp); cat > "$f"
  awk -F'|' '!/^tuned table/ && NF > 3 && $2 + 0 > 0' "$f" | sort -t'|' -k2,2g | head -12
  grep '^tuned table' "$f"; rm -f "$f"
}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
if [[ $parts == *tests* ]]; then
  echo "=== tests ($(left) s left)"
  TRITON_F32_DEFAULT=ieee timeout $(( $(left) < 200 ? $(left) : 200 )) python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/kernels/test_moe.py tests/kernels/test_mla_prefill.py tests/kernels/test_mla_decode.py \
    tests/kernels/test_kda_conv.py tests/kernels/test_kda_inplace.py tests/kernels/test_w4a16.py \
    tests/kernels/test_moe_route.py \
    -k "kimi or grouped_mm_triton_gpu or grouped_mm_mxfp4_gpu or conv_prefill or chunk_state_kernel or compiles_once or route_and_sort_gpu or act_combine" 2>&1 | tail -20 | tee "$OUT/kimi_kernel_tests.txt"
fi
if [[ $parts == *diag* ]]; then
  echo "=== diag ($(left) s left)"
  for args in "--tokens 8192" "--tokens 8192 --seqs 8"; do
    timeout 120 python3 benchmarks/prefill_host_gpu.py --flavor kimi-linear --experts $experts $args \
      2>&1 | grep -v Warning
  done 2>&1 | tee "$OUT/prefill_host_gpu.txt"
fi
if [[ $parts == *tune* ]]; then
  # bf16 experts' shapes, then attention's, then MXFP4's (the H100's format), while time lasts
  for row in "moe bf16 8192" "moe bf16 256" "moe bf16 16" \
             "mla-prefill --heads 32 --seq-lens 8192" \
             "mla-decode --heads 32 --page-size 16 --batch 1,16,64,256 --context-len 8192,1024,1024,1024" \
             "kda-decode --heads 32 --batch 1,16,64,256 --no-fla" \
             "kda-prefill --heads 32 --tokens 8192 --seqs 1,8" \
             "moe mxfp4 8192" "moe mxfp4 256" "moe mxfp4 16"; do
    [[ $row =~ $tune_rows ]] || continue
    [ "$(left)" -lt 60 ] && { echo "skipped (time): tune $row"; continue; }
    echo "=== tune $row ($(left) s left)"
    if [[ $row == moe* ]]; then
      read -r _ dtype tokens <<<"$row"
      timeout 120 python3 -m k3batch.cli bench moe --flavor kimi-linear --layers 2 \
        --tokens "$tokens" --expert-dtype "$dtype" --repeats 5 --rounds 2 --sweep --save-tuned \
        --json /tmp/moe_kimi_linear_sweep.jsonl 2>&1 | grep -v Warning | best_rows
    else
      timeout 110 python3 -m k3batch.cli bench $row --sweep --save-tuned \
        --json /tmp/kernel_sweeps_kimi_linear.jsonl 2>&1 | grep -v -e Warning -e '^{"'
    fi
  done 2>&1 | tee -a "$OUT/kimi_linear_tune.txt"
  # one file per op, only the tables this call wrote (the device returns a few files only;
  # the tables share the GPU's file name)
  for op in moe mla kda; do
    for f in $(find kernels/$op/tuned -name '*.json' -newer "$OUT/gpu.txt"); do
      cp "$f" "$OUT/tuned_${op}_$(basename "$f")"
    done
  done
fi
# (no file for parts not asked: the device returns a few files only; fla's tuning results, if
# wanted, by `save_autotune` after this script, at the top level where it is defined)
[[ $parts == *job* ]] || exit 0
for part in job job-warm; do
  [[ ",$parts," == *",$part,"* ]] || continue
  [ "$(left)" -lt 120 ] && { echo "skipped (time): $part"; continue; }
  extra=""; [ $part = job-warm ] && extra="--no-engine"
  echo "=== $part ($(left) s left)"
  timeout $(left) python3 -m k3batch.cli bench job --flavor kimi-linear --experts mxfp4 \
    --device cuda --work-dir /tmp/kl-job --num-prompts 1024 --input-len 1024 --output-len 256 \
    $extra --json "$OUT/job_kimi_linear.jsonl" 2>&1 | grep -v Warning | tail -12
done 2>&1 | tee -a "$OUT/job_kimi_linear.txt"
