#!/usr/bin/env bash
# Per-kernel times of several commits on one machine, for a change whose
# effect is smaller than the spread between machines: each commit's src/ is
# extracted and built (in parallel, each with its own extension cache), then
# scripts/profile_tokenize.py (this checkout's) runs against each build in
# turn, twice, and the fused kernels' lines are printed side by side. Logs go
# to $OUT (default: compare_out/).
#   bash scripts/compare_trees.sh REV [REV...]
#   PROFILE_ARGS goes to profile_tokenize.py (e.g. "--batch 8" or "--train").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-compare_out}
mkdir -p "$OUT"
[ $# -ge 1 ] || { echo "usage: $0 REV [REV...]" >&2; exit 2; }
root=$(mktemp -d)
for rev in "$@"; do
  tree="$root/$rev"
  mkdir -p "$tree"
  git archive "$rev" src | tar -x -C "$tree" || exit 1
  (TORCH_EXTENSIONS_DIR="$tree/ext" PYTHONPATH="$tree/src" python3 -m lumenbridge build \
    >"$OUT/build-$rev.log" 2>&1; echo "build $rev rc=$?" >>"$OUT/build-$rev.log") &
done
wait
status=0
for rev in "$@"; do
  tail -n 1 "$OUT/build-$rev.log"
  grep -q "rc=0" "$OUT/build-$rev.log" || status=1
done
[ $status -eq 0 ] || exit 1
for round in 1 2; do
  for rev in "$@"; do
    # shellcheck disable=SC2086
    TORCH_EXTENSIONS_DIR="$root/$rev/ext" PYTHONPATH="$root/$rev/src" \
      python3 scripts/profile_tokenize.py ${PROFILE_ARGS:-} >"$OUT/profile-$rev-$round.log" 2>&1 || status=1
  done
done
for rev in "$@"; do
  for round in 1 2; do
    echo "== $rev, round $round"
    grep -E "^== |lumenbridge::cuda" "$OUT/profile-$rev-$round.log"
  done
done
exit $status
