#!/usr/bin/env bash
# Where LumenBridge's kernels stall: ncu profiles of three launches of the
# kernels KERNELS matches (bf16, B=256 unless BATCH says; the launches after the first three
# it matches) with their launch shapes (grid, block and cluster sizes: whether a
# tile split), warp-state statistics, memory traffic and the per-instruction stall
# samples as CSV, for reading against the SASS, split into the phases between
# barriers by scripts/ncu_phases.py (phases.md; scripts/ncu_lines.py, on any
# machine, splits the CSV by source line). By default the fused
# forward's kernels, from uint8 input; KERNELS (an ncu name regex) picks
# others, and TRAIN=1 profiles a training step (float input) instead, as in
# scripts/ncu_tokenize.sh. BATCH sets the batch (default 256). SRC profiles
# another tree's package (default: this checkout's src; e.g. a build of
# scripts/compare_trees.sh, ROOT/NAME/src with TORCH_EXTENSIONS_DIR=ROOT/NAME/ext).
# Usage: [KERNELS=REGEX] [TRAIN=1] [BATCH=B] [SRC=DIR] bash scripts/ncu_sources.sh OUTDIR
set -euo pipefail
src=$(realpath "${SRC:-$(dirname "$0")/../src}")  # before the cd: SRC may be relative to the caller
cd "$(dirname "$0")/.."
out=${1:?output folder}
mkdir -p "$out"
kernels=${KERNELS:-fused_}
mode=()
[ -n "${TRAIN:-}" ] && mode=(--train)
export PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}"
ncu --clock-control none -k "regex:$kernels" --launch-skip 3 --launch-count 3 --import-source yes \
  --section WarpStateStats --section SourceCounters --section SpeedOfLight --section Occupancy \
  --section MemoryWorkloadAnalysis --section LaunchStats \
  -o "$out/stalls" -f python3 scripts/profile_tokenize.py --batch "${BATCH:-256}" --no-profiler "${mode[@]}" \
  > "$out/ncu-run.txt" 2>&1
ncu --import "$out/stalls.ncu-rep" --print-details all > "$out/stalls.txt" 2>&1 || true
ncu --import "$out/stalls.ncu-rep" --page source --csv --print-source sass > "$out/stalls-sass.csv" 2>&1 || true
python3 scripts/ncu_phases.py "$out/stalls-sass.csv" > "$out/phases.md" || true
grep -E "$kernels|Duration|Grid Size|Cluster Size|Stall|Warp Cycles Per Issued|Issue Slots|Achieved Occupancy|DRAM Throughput|L2 Hit|L1/TEX Hit" \
  "$out/stalls.txt" | head -80 || true
cat "$out/phases.md"
