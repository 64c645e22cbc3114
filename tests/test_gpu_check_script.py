"""scripts/gpu_check.sh reports failure through its exit code, and what it
and the quick start write stays out of git; the other device scripts refuse
arguments that would waste a call."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HAS_CUDA, REQUIRE_CUDA

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

# Stand-ins for the tools the script runs: each exits with the code named by
# an environment variable (default 0), so a test picks which steps fail.
STUB = """#!/bin/sh
[ -n "${{ARGV_LOG:-}}" ] && printf '%s\\n' "$*" >>"$ARGV_LOG"
case "$*" in
  *"-m pytest"*) [ -n "${{PYTEST_ARGV:-}}" ] && printf '%s\\n' "$@" >"$PYTEST_ARGV"
    [ -n "${{PYTEST_LOG:-}}" ] && cat "$PYTEST_LOG"; exit "${{RC_TESTS:-0}}" ;;
  *bench_*) exit "${{RC_BENCH:-0}}" ;;
  *profile_tokenize*) [ -n "${{PROFILE_LOG:-}}" ] && cat "$PROFILE_LOG"; exit 0 ;;
esac
exit "${{RC_{name}:-0}}"
"""


def stub_tools(tmp_path: Path) -> Path:
    """A folder of the stand-ins, to put first on PATH."""
    stubs = tmp_path / "bin"
    stubs.mkdir(parents=True)
    for program in ("python3", "nvidia-smi", "compute-sanitizer", "nvcc"):
        (stubs / program).write_text(STUB.format(name=program.replace("-", "_").upper()))
        (stubs / program).chmod(0o755)
    return stubs


def run_script(tmp_path: Path, *parts: str, **exit_codes: str) -> subprocess.CompletedProcess:
    stubs = stub_tools(tmp_path)
    if exit_codes.pop("no_sanitizer", None):
        (stubs / "compute-sanitizer").unlink()
    env = {
        **os.environ,
        **exit_codes,
        "PATH": f"{stubs}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "OUT": str(tmp_path / "out"),
    }
    return subprocess.run(
        ["bash", str(SCRIPT), *parts], env=env, capture_output=True, text=True, timeout=60, check=False
    )


pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def test_every_step_passing_exits_0(tmp_path):
    run = run_script(tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "FAILED" not in run.stdout


@pytest.mark.parametrize(
    "failure",
    [{"RC_TESTS": "1"}, {"no_sanitizer": "1"}, {"RC_BENCH": "1"}, {"RC_NVIDIA_SMI": "9"}],
    ids=["tests", "sanitizer missing", "benchmarks", "no gpu"],
)
def test_any_failing_step_exits_non_zero_after_running_the_rest(tmp_path, failure):
    run = run_script(tmp_path, **failure)
    assert run.returncode != 0
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "FAILED" in summary
    assert "tokenizer-benchmark" in summary  # the last step still ran


def test_the_trace_follows_the_pipeline_benchmark_with_its_arguments(tmp_path):
    log = tmp_path / "argv.log"
    arguments = "gpu_check_out/pipe/images-20000.txt --out /dev/shm/t --decode gpu"
    run = run_script(tmp_path, "bench", BENCHES="pipeline trace", TRACE_ARGS=arguments, ARGV_LOG=str(log))
    assert run.returncode == 0, run.stdout + run.stderr
    calls = [line for line in log.read_text().splitlines() if "benchmarks/" in line or "scripts/" in line]
    assert calls == [
        f"benchmarks/bench_pipeline.py --out {tmp_path / 'out'}",
        f"scripts/trace_pipeline.py --trace {tmp_path / 'out' / 'trace.json.gz'} -- {arguments}",
    ]


def test_a_failed_build_leaves_the_summary_of_what_ran(tmp_path):
    run = run_script(tmp_path, RC_PYTHON3="1")
    assert run.returncode == 1
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert [line.split()[0] for line in summary] == ["gpu", "torch", "build"]
    assert "FAILED rc=1" in summary[-1]


def test_pytest_args_keep_the_shells_quoting(tmp_path):
    argv = tmp_path / "argv"
    run = run_script(tmp_path, "tests", PYTEST_ARGS="tests -k 'many_tiles and float16'", PYTEST_ARGV=str(argv))
    assert run.returncode == 0, run.stdout + run.stderr
    assert argv.read_text().splitlines()[:5] == ["-m", "pytest", "tests", "-k", "many_tiles and float16"]


def test_racecheck_and_initcheck_leave_out_only_the_backward_that_calls_cublas(tmp_path):
    log = tmp_path / "argv.log"
    run = run_script(tmp_path, "sanitize", ARGV_LOG=str(log))
    assert run.returncode == 0, run.stdout + run.stderr
    parts = {
        line.split("--tool ")[1].split()[0]: line.split("--parts ")[1].split()
        for line in log.read_text().splitlines()
        if line.startswith("--tool ")
    }
    everything = ["depthwise", "fused", "backward", "kernels-backward", "crop"]
    without_cublas = ["depthwise", "fused", "kernels-backward", "crop"]
    assert parts == {
        "memcheck": everything,
        "racecheck": without_cublas,
        "synccheck": everything,
        "initcheck": without_cublas,
    }


def test_the_racecheck_probe_runs_only_on_request_and_reports_each_variant(tmp_path):
    default = run_script(tmp_path / "default")
    assert "probe" not in (tmp_path / "default" / "out" / "summary.txt").read_text(), default.stdout
    run = run_script(tmp_path / "probe", "probe", RC_COMPUTE_SANITIZER="9")
    assert run.returncode != 0
    summary = (tmp_path / "probe" / "out" / "summary.txt").read_text().splitlines()
    probe_rows = [line.split()[0] for line in summary if line.startswith("probe-")]
    assert probe_rows == ["probe-build", "probe-syncthreads", "probe-named", "probe-arrive", "probe-mbarrier"]
    assert all("FAILED rc=9" in line for line in summary if line.startswith("probe-") and "build" not in line)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
@pytest.mark.parametrize("path", ["gpu_check_out/summary.txt", "tokens.safetensors"])
def test_generated_files_are_ignored_by_git(path):
    run = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, check=False)
    assert run.returncode == 0, f"{path} is not in .gitignore"


def test_pack_leaves_one_archive_of_every_log(tmp_path):
    run = run_script(tmp_path, PACK="1")
    assert run.returncode == 0, run.stdout + run.stderr
    out = tmp_path / "out"
    assert [p.name for p in out.iterdir()] == ["logs.tar.gz"]
    listing = subprocess.run(["tar", "-tzf", str(out / "logs.tar.gz")], capture_output=True, text=True, check=True)
    assert "./summary.txt" in listing.stdout.split() and "./build.log" in listing.stdout.split()


@pytest.mark.skipif(HAS_CUDA, reason="checks a machine without a CUDA GPU")
def test_a_required_gpu_that_torch_cannot_see_fails_the_tests(tmp_path):
    """What gpu_check.sh sets for its tests: without it, every CUDA test skips and the step passes."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_config.py")],
        env={**os.environ, REQUIRE_CUDA: "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )
    assert run.returncode != 0 and "sees no CUDA GPU" in run.stdout + run.stderr


def test_compare_trees_refuses_two_trees_of_one_name_before_building(tmp_path):
    for tree in ("one/main", "two/main"):
        (tmp_path / tree / "src").mkdir(parents=True)
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "compare_trees.sh"), str(tmp_path / "one/main"), str(tmp_path / "two/main")],
        env={**os.environ, "OUT": str(tmp_path / "out"), "ROOT": str(tmp_path / "root")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 2 and "two trees are named main" in run.stderr
    assert not (tmp_path / "root").exists()  # nothing copied or built


def run_compare_trees(tmp_path: Path, **settings: str) -> subprocess.CompletedProcess:
    """compare_trees.sh on two trees, main and step, with the stand-ins
    first on PATH and `settings` in its environment."""
    for tree in ("main", "step"):
        (tmp_path / tree / "src").mkdir(parents=True)
    env = {
        **os.environ,
        "PATH": f"{stub_tools(tmp_path)}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "OUT": str(tmp_path / "out"),
        "ROOT": str(tmp_path / "root"),
        **settings,
    }
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "compare_trees.sh"), str(tmp_path / "main"), str(tmp_path / "step")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_compare_trees_runs_the_phase_clocks_and_skips_the_profiles_on_request(tmp_path):
    argv_log = tmp_path / "argv.log"
    run = run_compare_trees(tmp_path, ARGV_LOG=str(argv_log), PROFILE_ROUNDS="0", CLOCK_ARGS="--batch 1 --forwards 5")
    assert run.returncode == 0, run.stdout + run.stderr
    calls = argv_log.read_text().splitlines()
    assert calls.count("-m lumenbridge build") == 4  # each tree's extension, then its clocked one
    assert calls.count("scripts/phase_clock.py --batch 1 --forwards 5") == 2
    assert not any("profile_tokenize" in call for call in calls)
    assert run.stdout.index("== clock main") < run.stdout.index("== clock step")


# The end of a pytest -q log: the count line follows the warnings' summary.
PYTEST_TAIL = """tests/test_dispatch.py: 14 warnings
-- Docs: https://docs.pytest.org/en/stable/how-to/capture-warnings.html
593 passed, 1541 deselected, 18 warnings in 413.09s (0:06:53)
"""


@pytest.mark.parametrize(
    ("rc", "log", "reported"),
    [
        ("0", PYTEST_TAIL, "rc=0; 593 passed, 1541 deselected, 18 warnings in 413.09s (0:06:53)"),
        ("1", "", "rc=1; no count line"),
    ],
    ids=["passed", "failed, no count line"],
)
def test_compare_trees_reports_each_trees_test_status(tmp_path, rc, log, reported):
    (tmp_path / "pytest.log").write_text(log)
    run = run_compare_trees(
        tmp_path,
        TEST_ARGS="tests -k backward",
        PROFILE_ROUNDS="0",
        RC_TESTS=rc,
        PYTEST_LOG=str(tmp_path / "pytest.log"),
    )
    assert (run.returncode == 0) == (rc == "0"), run.stdout + run.stderr
    assert [line for line in run.stdout.splitlines() if line.startswith("tests ")] == [
        f"tests {tree}: {reported}" for tree in ("main", "step")
    ]


# A profile's launch-order list as profile_tokenize.py prints it (names cut short).
PROFILE_LIST = """== one training step's kernels, in launch order (us), B=256
   751.1  void lumenbridge::cuda::fused::(anonymous namespace)::fused_first_kernel<c10::BFloat16, 3, false>(lumenbridge:
    78.8  nvjet_sm90_tst_192x192_64x3_1x2_h_bz_coopB_NNN
     2.6  void lumenbridge::cuda::sum_partials_kernel<c10::BFloat16>(float const*, long, long, int, lumenbridge::cuda::S
   414.2  void lumenbridge::cuda::(anonymous namespace)::depthwise_backward_both_s2_nhwc_kernel<c10::BFloat16, 3, false,
step: best 3.905 ms, median 3.925 ms (5 runs of 20); GPU time 3.837 ms; peak 1463 MB
     2.5  before void lumenbridge::cuda::sum_partials_kernel<c10::BFloat16>(float const*, long, long, int, lumenbridg
host time (us, median of 50, GPU idle at each start):
      5.9  one stage output allocated alone
    111.5  the op alone
   1682.3  the training step
host time (us, median of 50, GPU idle at each start):
      9.9  a second section, which the row leaves out
"""


def test_compare_trees_prints_a_short_row_a_tree_and_round(tmp_path):
    (tmp_path / "profile.log").write_text(PROFILE_LIST)
    run = run_compare_trees(tmp_path, PROFILE_LOG=str(tmp_path / "profile.log"), PROFILE_ROUNDS="2")
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    names = lines.index("== LumenBridge kernels of 10 us or more, in launch order (us), named from main's first log:")
    assert lines[names + 1 : names + 3] == [
        "  1 fused_first_kernel<c10::BFloat16, 3, false>",
        "  2 depthwise_backward_both_s2_nhwc_kernel<c10::BFloat16, 3, false,",
    ]
    row = "   751.1   414.2  | best 3.905 ms, median 3.925 ms (5 runs of 20); GPU time 3.837 ms; peak 1463 MB"
    host = lines.index("== host times (us), named from main's first log:")
    assert lines[names + 3 : host] == [
        f"{tree} r{r}".ljust(14) + " " + row for tree in ("main", "step") for r in (1, 2)
    ]
    assert lines[host + 1 : host + 4] == [
        "  1 one stage output allocated alone",
        "  2 the op alone",
        "  3 the training step",
    ]
    host_row = "     5.9   111.5  1682.3"
    assert lines[host + 4 :] == [f"{tree} r{r}".ljust(14) + " " + host_row for tree in ("main", "step") for r in (1, 2)]


def test_bench_fused_refuses_a_provider_it_does_not_have():
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_fused.py"), "--out", "x", "--providers", "lumenbrige"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 2 and "invalid choice: 'lumenbrige'" in run.stderr
