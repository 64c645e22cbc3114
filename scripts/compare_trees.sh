#!/usr/bin/env bash
# Per-kernel times of several trees on one machine, for a change whose
# effect is smaller than the spread between machines: each tree's src/ (a
# commit's, or that of a directory holding src/, for a machine whose copy of
# the checkout has no git history) is copied and built (in parallel, each
# with its own extension cache), then scripts/profile_tokenize.py (this
# checkout's) runs against each build in turn, PROFILE_ROUNDS times, and a
# row a tree and round is printed: the LumenBridge kernels' times in launch
# order and the step's; then a row of its plain host times. Logs go to $OUT (default: compare_out/).
#   bash scripts/compare_trees.sh TREE [TREE...]   TREE: a commit or a directory
#   PROFILE_ARGS goes to profile_tokenize.py (e.g. "--batch 8" or "--train");
#   ROOT is where the trees and their builds go (default: a new temporary
#   folder), for a later command to use a build: ROOT/NAME/src and ROOT/NAME/ext.
#   TEST_ARGS, if set, runs pytest with them (this checkout's tests, each
#   tree's package) on each build before the profiles, quoted as in a shell
#   (e.g. "tests/test_tokenize.py -m cuda -k 'many_tiles and float16'");
#   NCU_KERNELS, if set, runs scripts/ncu_sources.sh on each build after them
#   with that kernel regex (a forward at B = 256 unless TRAIN or BATCH says
#   otherwise, as ncu_sources.sh reads them; logs in $OUT/ncu-NAME).
#   BENCH_ARGS, if set, runs benchmarks/bench_fused.py with them (e.g.
#   "--cases bf16:1:224 bf16:64:224 --providers lumenbridge") on each build,
#   the trees taking turns for BENCH_ROUNDS rounds (default 4), and prints
#   each run's LumenBridge rows: end-to-end times vary between runs on one
#   machine by more than a small change, so one run a tree cannot rank them.
#   GRAPH_ARGS, if set (e.g. "--batches 1 8", or "" for the defaults, as
#   GRAPH_ARGS= ), does the same with scripts/graph_time.py: the GPU time of
#   a forward replayed from a CUDA graph, steady to about 1% where the
#   benchmark's eager calls at small batches are not.
#   PROFILE_ROUNDS: rounds of profile_tokenize.py (default 2; 0 runs none).
#   CLOCK_ARGS, if set (e.g. "--batch 1"), runs scripts/phase_clock.py with
#   them on each tree after the timings above, first building every tree's
#   phase-clock extension (LUMENBRIDGE_PHASE_CLOCKS=1, in its own cache) side
#   by side; if one does not build, no clocks run and the script fails.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-compare_out}
mkdir -p "$OUT"
[ $# -ge 1 ] || { echo "usage: $0 TREE [TREE...]" >&2; exit 2; }
root=${ROOT:-$(mktemp -d)}
names=()
for tree in "$@"; do
  name=$(basename "$tree")
  # Each tree's copy, build and rows go by this name: two trees under one would overwrite each other.
  [[ " ${names[*]} " != *" $name "* ]] || { echo "two trees are named $name: give them distinct names" >&2; exit 2; }
  names+=("$name")
done
# build_trees LABEL [VAR=VALUE...]: every tree's extension built side by
# side, with those variables set (a clocked build keeps a cache of its own);
# each log, $OUT/LABEL-NAME.log, ends with its rc, and that line is printed.
# Fails if any build did.
build_trees() {
  local label=$1 failed=0
  shift
  for name in "${names[@]}"; do
    (env "$@" TORCH_EXTENSIONS_DIR="$root/$name/ext" PYTHONPATH="$root/$name/src" python3 -m lumenbridge build \
      >"$OUT/$label-$name.log" 2>&1; echo "$label $name rc=$?" >>"$OUT/$label-$name.log") &
  done
  wait
  for name in "${names[@]}"; do
    tail -n 1 "$OUT/$label-$name.log"
    grep -q "rc=0" "$OUT/$label-$name.log" || failed=1
  done
  return $failed
}
for tree in "$@"; do
  name=$(basename "$tree")
  # A ROOT used before may hold this name's tree: start it afresh.
  rm -rf "${root:?}/$name/src"
  mkdir -p "$root/$name"
  if [ -d "$tree/src" ]; then
    cp -r "$tree/src" "$root/$name/" || exit 1
  else
    git archive "$tree" src | tar -x -C "$root/$name" || exit 1
  fi
done
build_trees build || exit 1
status=0
if [ -n "${TEST_ARGS:-}" ]; then
  eval "test_args=($TEST_ARGS)"  # the shell's quoting, so a -k expression may hold spaces
  for name in "${names[@]}"; do
    TORCH_EXTENSIONS_DIR="$root/$name/ext" PYTHONPATH="$root/$name/src" \
      python3 -m pytest -q -p no:cacheprovider "${test_args[@]}" >"$OUT/test-$name.log" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || status=1
    # The exit status, and pytest's count line where it printed one (a -q in
    # TEST_ARGS makes it -qq, which prints none).
    counts=$(grep -E '^=* ?[0-9]+ (passed|failed|errors?|skipped|deselected)' "$OUT/test-$name.log" | tail -n 1)
    echo "tests $name: rc=$rc; ${counts:-no count line}"
  done
fi
profile_rounds=$(seq "${PROFILE_ROUNDS:-2}")
for round in $profile_rounds; do
  for name in "${names[@]}"; do
    # shellcheck disable=SC2086
    TORCH_EXTENSIONS_DIR="$root/$name/ext" PYTHONPATH="$root/$name/src" \
      python3 scripts/profile_tokenize.py ${PROFILE_ARGS:-} >"$OUT/profile-$name-$round.log" 2>&1 || status=1
  done
done
# A row a tree and round, short enough for many trees to fit a call's
# printed tail (the logs keep the whole lists): the times of the LumenBridge
# kernels of 10 us or more in the log's launch-order list (`kernels`, an awk
# pattern: the list ends at the step line), then its step line.
kernels='/in launch order/ {on = 1; next} /^step:/ {on = 0} on && /^ *[0-9.]+  void lumenbridge/ && $1 >= 10'
launch_row() {
  awk "$kernels"' {row = row sprintf(" %7.1f", $1)} /^step:/ {sub(/^step: /, ""); print row "  | " $0; exit}' "$1"
}
# The names of those kernels, numbered in the order of launch_row's columns.
kernel_names() {
  awk "$kernels"' && match($0, /[A-Za-z_0-9]+_kernel<[^(]*/) {printf "  %d %s\n", ++n, substr($0, RSTART, RLENGTH)}' "$1"
}
# The log's first list of plain host times (us), a column each: a change of
# a few us in the op shows only between runs whose bare allocation and bare
# launch columns agree (the host's state differs between processes).
host_section='/^host time \(us/ {if (on) exit; on = 1; next} on && !/^ *[0-9.]+  / {exit} on'
host_row() {
  awk "$host_section"' {row = row sprintf(" %7.1f", $1)} END {print row}' "$1"
}
host_names() {
  awk "$host_section"' {sub(/^ *[0-9.]+  /, ""); printf "  %d %s\n", ++n, $0}' "$1"
}
# print_rows ROW: a row a tree and round, ROW (a function) of its profile log.
print_rows() {
  for name in "${names[@]}"; do
    for round in $profile_rounds; do
      printf '%-14s %s\n' "$name r$round" "$("$1" "$OUT/profile-$name-$round.log")"
    done
  done
}
if [ -n "$profile_rounds" ]; then
  echo "== LumenBridge kernels of 10 us or more, in launch order (us), named from ${names[0]}'s first log:"
  kernel_names "$OUT/profile-${names[0]}-1.log"
  print_rows launch_row
  echo "== host times (us), named from ${names[0]}'s first log:"
  host_names "$OUT/profile-${names[0]}-1.log"
  print_rows host_row
fi
# in_turns KIND PATTERN COMMAND...: COMMAND on each build, the trees taking
# turns for BENCH_ROUNDS rounds; prints the lines of each run's log that
# match PATTERN ({} in COMMAND is the run's own output folder).
in_turns() {
  local kind=$1 pattern=$2; shift 2
  for round in $(seq "${BENCH_ROUNDS:-4}"); do
    for name in "${names[@]}"; do
      local log="$OUT/$kind-$name-$round.log"
      TORCH_EXTENSIONS_DIR="$root/$name/ext" PYTHONPATH="$root/$name/src" \
        "${@//\{\}/$OUT/$kind-$name-$round}" >"$log" 2>&1 || status=1
      echo "== $kind $name, round $round"
      grep -E "$pattern" "$log"
    done
  done
}
if [ -n "${BENCH_ARGS:-}" ]; then
  eval "bench_args=($BENCH_ARGS)"
  in_turns bench "^\| [a-z0-9]+ \| [0-9]+ \| [0-9]+ \| lumenbridge" \
    python3 benchmarks/bench_fused.py --out {} "${bench_args[@]}"
fi
if [ -n "${GRAPH_ARGS+set}" ]; then
  eval "graph_args=($GRAPH_ARGS)"
  in_turns graph "^B=" python3 scripts/graph_time.py "${graph_args[@]}"
fi
if [ -n "${CLOCK_ARGS+set}" ]; then
  eval "clock_args=($CLOCK_ARGS)"
  if build_trees clock-build LUMENBRIDGE_PHASE_CLOCKS=1; then
    for name in "${names[@]}"; do
      TORCH_EXTENSIONS_DIR="$root/$name/ext" PYTHONPATH="$root/$name/src" \
        python3 scripts/phase_clock.py "${clock_args[@]}" >"$OUT/clock-$name.log" 2>&1 || status=1
      echo "== clock $name"
      cat "$OUT/clock-$name.log"
    done
  else
    status=1
  fi
fi
if [ -n "${NCU_KERNELS:-}" ]; then
  for name in "${names[@]}"; do
    TORCH_EXTENSIONS_DIR="$root/$name/ext" SRC="$root/$name/src" KERNELS="$NCU_KERNELS" \
      bash scripts/ncu_sources.sh "$OUT/ncu-$name" >"$OUT/ncu-$name.log" 2>&1 || status=1
    echo "== ncu $name"
    cat "$OUT/ncu-$name/phases.md" 2>/dev/null
  done
fi
exit $status
