#!/usr/bin/env bash
# One ncu profile of each fused tokenize kernel (B=256, bf16, uint8 input):
# speed of light, occupancy, warp stalls, memory and tensor-pipe use.
# Usage: bash scripts/ncu_tokenize.sh OUTDIR
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?output folder}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
ncu --clock-control none -k regex:fused_ --launch-skip 3 --launch-count 3 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
  --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SchedulerStats \
  python3 scripts/profile_tokenize.py --batch 256 --no-profiler > "$out/ncu.txt" 2>&1
grep -E "fused_|Duration|Memory Throughput|DRAM Throughput|L2 Cache Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Issue Slots Busy|Warp Cycles Per Issued|No Eligible|Stall" "$out/ncu.txt" | head -80
