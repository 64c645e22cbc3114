#!/usr/bin/env bash
# The whole CUDA check in one call, for a machine with an NVIDIA GPU:
# build the extension, run the test suite (CUDA tests included), run
# compute-sanitizer's four tools on every kernel variant, run the depthwise
# and whole-tokenizer benchmarks, and print a short summary last. Logs go to
# $OUT (default: gpu_check_out/).
#   bash scripts/gpu_check.sh [PARTS...]   PARTS: tests sanitize bench (default: all
#   three), and probe (on request only): racecheck on scripts/racecheck_probe.cu,
#   which hands a shared buffer between warp roles in four ways, to tell which
#   hand-overs the tool understands before a warp-specialized kernel relies on one
#   (a variant's step fails with rc 9 where racecheck reports hazards, rc 1
#   where its sums are wrong)
#   PYTEST_ARGS selects tests (default: the whole suite); SANITIZE_PARTS picks
#   sanitize_kernels.py's parts (default: depthwise fused backward kernels-backward crop), and
#   RACECHECK_PARTS those of the slow racecheck (default: the same, less the
#   backward, which racecheck cannot run: see below); BENCHES
#   picks benchmarks (default: depthwise tokenizer fused; also profile, the
#   per-kernel times of a forward and of a training step, pipeline, the
#   tokenize command end to end, trace, a torch.profiler timeline of one
#   tokenize run of every thread, $OUT/trace.json.gz, and clock,
#   scripts/phase_clock.py at each batch of CLOCK_BATCHES, default "1 8",
#   which builds the clocked extension first); FUSED_BENCH_ARGS goes to
#   bench_fused.py (--quick, --cases), PIPELINE_BENCH_ARGS to bench_pipeline.py
#   (--runs), TRACE_ARGS to scripts/trace_pipeline.py as tokenize's arguments
#   (required: the images and --out; the step fails without them).
#   PYTEST_ARGS is read with the shell's quoting, so a -k expression may hold
#   spaces. STEP_TIMEOUT caps each step in seconds (default: 540, under the
#   device's 10 minutes a call). Each step's line is added to $OUT/summary.txt
#   as it ends, so a call cut short keeps what ran. PACK=1 leaves
#   $OUT holding one archive, logs.tar.gz, of everything it wrote (for a
#   machine that returns only a few files per call).
# Exits 0 only if every step passed; otherwise 1, after running the rest.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
: >"$OUT/summary.txt"
status=0
step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, record pass/fail in summary.txt
  local name=$1; shift
  local started=$SECONDS
  timeout "${STEP_TIMEOUT:-540}" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  printf '%-22s %s (%ds)\n' "$name" "$([ $rc -eq 0 ] && echo ok || echo "FAILED rc=$rc")" $((SECONDS - started)) \
    >>"$OUT/summary.txt"
  [ $rc -eq 0 ] || status=1
  tail -n 5 "$OUT/$name.log"
  return $rc
}

step gpu nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
step torch python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda); assert torch.cuda.is_available(), "torch sees no CUDA GPU"'
cat "$OUT/gpu.log" "$OUT/torch.log" >"$OUT/gpu.txt"
parts=" ${*:-tests sanitize bench} "
step build python3 -m lumenbridge build || { cat "$OUT/summary.txt"; exit 1; }
if [[ $parts == *" tests "* ]]; then
  eval "pytest_args=(${PYTEST_ARGS:-tests})"
  # With a GPU required, the CUDA tests fail rather than skip where torch sees none.
  LUMENBRIDGE_REQUIRE_CUDA=1 step tests python3 -m pytest "${pytest_args[@]}" -q -p no:cacheprovider -rs
fi
if [[ $parts == *" sanitize "* ]]; then
  # Only LumenBridge kernels are instrumented, which keeps the run short.
  sanitize_parts=${SANITIZE_PARTS:-depthwise fused backward kernels-backward crop}
  # racecheck stops at the backward's first cuBLAS GEMM on the H200 ("failed
  # to handle a hardware exception"), even with only one LumenBridge kernel
  # instrumented (benchmarks/NOTES.md, twelfth session), so by default it
  # leaves the backward out (kernels-backward, with no cuBLAS GEMM, stays).
  without_backward() {
    local part
    for part in $sanitize_parts; do [ "$part" = backward ] || printf '%s ' "$part"; done
  }
  racecheck_parts=${RACECHECK_PARTS:-$(without_backward)}
  for tool in memcheck racecheck synccheck; do
    tool_parts=$sanitize_parts
    [ "$tool" = racecheck ] && tool_parts=$racecheck_parts
    [ -n "${tool_parts// /}" ] || continue
    # shellcheck disable=SC2086
    step "sanitizer-$tool" compute-sanitizer --tool "$tool" --error-exitcode 9 \
      --kernel-name kns=lumenbridge python3 scripts/sanitize_kernels.py --parts $tool_parts
  done
  # initcheck instruments everything, since it must see PyTorch's kernels
  # initialize the inputs (filtered, it reports their writes as missing). It
  # cannot see what cuBLAS's sm_90 kernels write (every element of a plain
  # `a @ b` output is reported unread-before-written), so the backward, which
  # composes cuBLAS matmuls, is left to the other three tools.
  initcheck_parts=$(without_backward)
  # shellcheck disable=SC2086
  [ -n "${initcheck_parts// /}" ] && step sanitizer-initcheck compute-sanitizer --tool initcheck --error-exitcode 9 \
    python3 scripts/sanitize_kernels.py --parts $initcheck_parts
fi
if [[ $parts == *" probe "* ]]; then
  step probe-build nvcc -arch=sm_90 -O2 -o "$OUT/racecheck_probe" scripts/racecheck_probe.cu
  for variant in syncthreads named arrive mbarrier; do
    step "probe-$variant" compute-sanitizer --tool racecheck --error-exitcode 9 "$OUT/racecheck_probe" "$variant"
  done
  rm -f "$OUT/racecheck_probe"
fi
if [[ $parts == *" bench "* ]]; then
  benches=" ${BENCHES:-depthwise tokenizer fused} "
  [[ $benches == *" depthwise "* ]] && step benchmark python3 benchmarks/bench_depthwise.py --out "$OUT"
  [[ $benches == *" tokenizer "* ]] && step tokenizer-benchmark python3 benchmarks/bench_tokenizer.py --out "$OUT"
  # shellcheck disable=SC2086
  [[ $benches == *" fused "* ]] && step fused-benchmark python3 benchmarks/bench_fused.py --out "$OUT" ${FUSED_BENCH_ARGS:-}
  [[ $benches == *" profile "* ]] && step profile python3 scripts/profile_tokenize.py
  [[ $benches == *" profile "* ]] && step profile-train python3 scripts/profile_tokenize.py --train
  # shellcheck disable=SC2086
  [[ $benches == *" pipeline "* ]] && step pipeline-benchmark python3 benchmarks/bench_pipeline.py --out "$OUT" \
    ${PIPELINE_BENCH_ARGS:-}
  # The phase clocks' development build (its own extension cache) at each batch of CLOCK_BATCHES.
  if [[ $benches == *" clock "* ]]; then
    for batch in ${CLOCK_BATCHES:-1 8}; do
      step "phase-clock-b$batch" python3 scripts/phase_clock.py --batch "$batch" && cat "$OUT/phase-clock-b$batch.log"
    done
  fi
  # shellcheck disable=SC2086
  [[ $benches == *" trace "* ]] && step pipeline-trace python3 scripts/trace_pipeline.py --trace "$OUT/trace.json.gz" -- \
    ${TRACE_ARGS:-}
  cat "$OUT"/depthwise.md "$OUT"/tokenizer.md "$OUT"/fused.md 2>/dev/null
fi
echo "== summary"
cat "$OUT/summary.txt"
if [ -n "${PACK:-}" ]; then
  archive=$(mktemp)
  tar -czf "$archive" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$archive" "$OUT/logs.tar.gz"
fi
exit $status
