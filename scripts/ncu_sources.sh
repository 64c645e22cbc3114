#!/usr/bin/env bash
# Where the fused tokenize kernels stall: one ncu profile per kernel (B=256,
# bf16, uint8 input) with warp-state statistics and the per-instruction stall
# samples as CSV, for reading against the SASS, split into the phases between
# barriers by scripts/ncu_phases.py (phases.md).
# Usage: bash scripts/ncu_sources.sh OUTDIR
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?output folder}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
ncu --clock-control none -k regex:fused_ --launch-skip 3 --launch-count 3 --import-source yes \
  --section WarpStateStats --section SourceCounters --section SpeedOfLight --section Occupancy \
  -o "$out/stalls" -f python3 scripts/profile_tokenize.py --batch 256 --no-profiler > "$out/ncu-run.txt" 2>&1
ncu --import "$out/stalls.ncu-rep" --print-details all > "$out/stalls.txt" 2>&1 || true
ncu --import "$out/stalls.ncu-rep" --page source --csv --print-source sass > "$out/stalls-sass.csv" 2>&1 || true
python3 scripts/ncu_phases.py "$out/stalls-sass.csv" > "$out/phases.md" || true
grep -E "fused_|Duration|Stall|Warp Cycles Per Issued|Issue Slots|Achieved Occupancy" "$out/stalls.txt" | head -60
cat "$out/phases.md"
