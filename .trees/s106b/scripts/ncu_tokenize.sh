#!/usr/bin/env bash
# One ncu profile of each kernel a tokenize call runs (B=256, bf16): speed of
# light, occupancy, warp stalls, memory and tensor-pipe use. By default the
# fused forward's kernels, from uint8 input; KERNELS (an ncu name regex)
# picks others, and TRAIN=1 profiles a training step (float input) instead,
# e.g. KERNELS=depthwise_backward_both TRAIN=1 for the backward's depthwise
# gradients of the later stages (three launches a step, one per stage).
# Usage: [KERNELS=REGEX] [TRAIN=1] bash scripts/ncu_tokenize.sh OUTDIR
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?output folder}
kernels=${KERNELS:-fused_}
mode=()
[ -n "${TRAIN:-}" ] && mode=(--train)
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
ncu --clock-control none -k "regex:$kernels" --launch-skip 3 --launch-count 3 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
  --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SchedulerStats \
  python3 scripts/profile_tokenize.py --batch 256 --no-profiler "${mode[@]}" > "$out/ncu.txt" 2>&1
grep -E "$kernels|Duration|Memory Throughput|DRAM Throughput|L2 Cache Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Stall" "$out/ncu.txt" | head -80
