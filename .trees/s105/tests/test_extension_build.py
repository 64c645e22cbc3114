"""Building the native extension as a new user meets it: a killed build, no
ninja on PATH, several toolchains and checkouts sharing one cache, builds
running at once, no compiler at all.

Most tests build a one-function C++ library through the same loader
(extension.compile_library) as the real extension, in about a second; one
builds the real extension end to end."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lumenbridge import extension
from lumenbridge.config import KERNEL_SIZES
from lumenbridge.dispatch import DEFAULTS, visible_device_types

pytestmark = pytest.mark.skipif(shutil.which(extension._cxx_compiler()) is None, reason="needs a C++ compiler")

TINY_SOURCE = 'extern "C" int lumenbridge_test_answer() { return %d; }\n'

# Builds the tiny library in a fresh process and prints its answer and whether it compiled.
BUILD_TINY = """
import ctypes, sys
from pathlib import Path
from lumenbridge import extension
source_dir = Path(sys.argv[1])
library = extension.Library(name="lumenbridge_tiny", source_dir=source_dir, sources=(source_dir / "tiny.cpp",))
path, compiled = extension.compile_library(library)
print(ctypes.CDLL(str(path)).lumenbridge_test_answer(), compiled)
"""

# A C++ compiler that stands in for a slow build: when compiling (-c), it
# records its pid in $LB_TEST_STARTED and then sleeps, or first waits
# $LB_TEST_DELAY seconds; otherwise (--version, linking) it is plain c++.
SLOW_COMPILER = """#!/bin/sh
case " $* " in
  *" -c "*)
    if [ -n "$LB_TEST_STARTED" ]; then echo $$ > "$LB_TEST_STARTED"; exec sleep 600; fi
    sleep "${LB_TEST_DELAY:-0}" ;;
esac
exec c++ "$@"
"""


def tiny_source(folder: Path, answer: int = 42) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiny.cpp").write_text(TINY_SOURCE % answer)
    return folder


def tiny_library(source_dir: Path) -> extension.Library:
    return extension.Library(name="lumenbridge_tiny", source_dir=source_dir, sources=(source_dir / "tiny.cpp",))


def slow_compiler(tmp_path: Path) -> str:
    path = tmp_path / "slow-c++"
    path.write_text(SLOW_COMPILER)
    path.chmod(0o755)
    return str(path)


def path_without_ninja(tmp_path: Path) -> str:
    """PATH with every folder that holds a ninja replaced by a copy of it (as
    symlinks) that lacks ninja, so compilers and other tools stay reachable."""
    folders = []
    for index, folder in enumerate(os.environ.get("PATH", "").split(os.pathsep)):
        if not os.path.exists(os.path.join(folder, "ninja")):
            folders.append(folder)
            continue
        shadow = tmp_path / f"path{index}"
        shadow.mkdir()
        for entry in os.scandir(folder):
            if entry.name != "ninja":
                (shadow / entry.name).symlink_to(entry.path)
        folders.append(str(shadow))
    path = os.pathsep.join(folders)
    assert shutil.which("ninja", path=path) is None
    return path


def environment(cache: Path, **overrides: str) -> dict[str, str]:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache), "PYTHONUNBUFFERED": "1", **overrides}
    env.pop("LUMENBRIDGE_BACKEND", None)
    return env


def default_signals():
    """Runs in a child before exec: a test run started in the background or
    under nohup ignores SIGINT or SIGHUP, and children would inherit that."""
    for number in (signal.SIGINT, signal.SIGHUP):
        signal.signal(number, signal.SIG_DFL)


def start_job(command: list[str], env: dict[str, str], **options) -> subprocess.Popen:
    # A session of its own, so that a test can kill it like a terminal kills a job.
    return subprocess.Popen(
        command,
        env=env,
        start_new_session=True,
        preexec_fn=default_signals,  # noqa: PLW1509 - no threads here
        **options,
    )


def start_tiny_build(source_dir: Path, env: dict[str, str]) -> subprocess.Popen:
    return start_job(
        [sys.executable, "-c", BUILD_TINY, str(source_dir)],
        env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_tiny_build(source_dir: Path, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BUILD_TINY, str(source_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def wait_for(condition, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(folder))
    return folder


# --- item 1: a killed build ---------------------------------------------------------------


@pytest.mark.parametrize("signal_number", [signal.SIGKILL, signal.SIGHUP])
def test_a_killed_build_neither_blocks_nor_breaks_the_next_one(tmp_path, cache, signal_number):
    source_dir = tiny_source(tmp_path / "src")
    started = tmp_path / "compiler-started"
    env = environment(cache, CXX=slow_compiler(tmp_path))
    first = start_tiny_build(source_dir, {**env, "LB_TEST_STARTED": str(started)})
    wait_for(started.exists, first)
    # What the killed build leaves: cpp_extension's own lock file and build.ninja.
    (staging,) = cache.glob("*" + extension.STAGING_SUFFIX + "*")
    assert (staging / "lock").exists() and (staging / "build.ninja").exists()
    os.killpg(first.pid, signal_number)
    first.communicate()
    # Ninja runs compilers in process groups of their own; after SIGKILL, end this one too.
    with contextlib.suppress(ProcessLookupError):
        os.kill(int(started.read_text()), signal.SIGKILL)

    second = run_tiny_build(source_dir, env, timeout=120)

    assert second.returncode == 0, second.stderr
    assert second.stdout.split() == ["42", "True"]
    assert "discarding an unfinished earlier build" in second.stderr
    assert not list(cache.glob("*" + extension.STAGING_SUFFIX + "*"))


def test_builds_started_together_both_succeed_and_compile_once(tmp_path, cache):
    source_dir = tiny_source(tmp_path / "src")
    env = environment(cache, CXX=slow_compiler(tmp_path), LB_TEST_DELAY="8")
    processes = [start_tiny_build(source_dir, env) for _ in range(2)]
    results = [process.communicate(timeout=180) for process in processes]

    assert [process.returncode for process in processes] == [0, 0], results
    assert sorted(out.split()[1] for out, _ in results) == ["False", "True"]
    assert all(out.split()[0] == "42" for out, _ in results)
    waiting = [err for out, err in results if out.split()[1] == "False"]
    assert "waiting for process" in waiting[0]


# --- item 2: the ninja that LumenBridge depends on ----------------------------------------


def test_the_ninja_dependency_is_used_when_path_has_no_ninja(tmp_path, cache):
    source_dir = tiny_source(tmp_path / "src")
    built = run_tiny_build(source_dir, environment(cache, PATH=path_without_ninja(tmp_path)))
    assert built.returncode == 0, built.stderr
    assert built.stdout.split() == ["42", "True"]


# --- item 3: one build per distinct source and toolchain, loaded without ninja ------------


def test_a_finished_build_is_loaded_without_running_ninja(tmp_path, cache, caplog):
    library = tiny_library(tiny_source(tmp_path / "src"))
    path, compiled = extension.compile_library(library)
    assert compiled
    ninja_log = path.parent / ".ninja_log"
    before = ninja_log.stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lumenbridge"):
        assert extension.compile_library(library) == (path, False)
    assert ninja_log.stat().st_mtime_ns == before
    assert caplog.records == []


def test_another_checkout_with_the_same_sources_shares_the_build(tmp_path, cache):
    first, compiled = extension.compile_library(tiny_library(tiny_source(tmp_path / "checkout1")))
    second, compiled_again = extension.compile_library(tiny_library(tiny_source(tmp_path / "checkout2")))
    assert compiled and not compiled_again
    assert first == second


def test_changed_sources_or_compiler_build_side_by_side_with_a_notice_each_time(tmp_path, cache, monkeypatch, caplog):
    source_dir = tiny_source(tmp_path / "src")
    with caplog.at_level(logging.WARNING, logger="lumenbridge"):
        original, _ = extension.compile_library(tiny_library(source_dir))
        tiny_source(source_dir, answer=7)
        changed, compiled_changed = extension.compile_library(tiny_library(source_dir))
        # The environment's own CXX (if any) comes back afterwards, so the last build uses the first's compiler.
        with monkeypatch.context() as patch:
            patch.setenv("CXX", slow_compiler(tmp_path))
            other_compiler, compiled_other = extension.compile_library(tiny_library(source_dir))
        tiny_source(source_dir, answer=42)
        back, compiled_back = extension.compile_library(tiny_library(source_dir))

    assert compiled_changed and compiled_other and not compiled_back
    assert len({original.parent, changed.parent, other_compiler.parent}) == 3
    assert back == original and original.exists() and changed.exists()
    notices = [record.getMessage() for record in caplog.records]
    assert len(notices) == 3 and all("compiling the native extension" in notice for notice in notices)


def test_a_build_folder_that_lost_its_library_is_rebuilt(tmp_path, cache):
    library = tiny_library(tiny_source(tmp_path / "src"))
    path, _ = extension.compile_library(library)
    path.unlink()
    assert extension.compile_library(library) == (path, True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the check reads ELF headers")
@pytest.mark.parametrize("damage", ["truncated", "empty", "not a library"])
def test_a_damaged_library_is_rebuilt_not_loaded(tmp_path, cache, damage):
    """Loading a library cut short can kill the process (SIGBUS) instead of
    raising, so a build whose library is not whole counts as unfinished."""
    library = tiny_library(tiny_source(tmp_path / "src"))
    path, _ = extension.compile_library(library)
    data = path.read_bytes()
    path.unlink()  # a new file: this process has the built one mapped, and cutting that short would kill it
    path.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "not a library": b"x" * len(data)}[damage])
    assert extension.compile_library(library) == (path, True)
    assert extension._whole_library(path) and path.stat().st_size > len(data) // 2


def test_a_cache_that_cannot_be_written_is_a_build_error(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "a-file" / "cache"))
    with pytest.raises(extension.BuildError, match="cannot build in"):
        extension.compile_library(tiny_library(tiny_source(tmp_path / "src")))


def test_the_build_folder_records_what_it_was_built_from(tmp_path, cache):
    path, _ = extension.compile_library(tiny_library(tiny_source(tmp_path / "src")))
    record = json.loads((path.parent / extension.COMPLETE_MARKER).read_text())
    assert record["toolchain"]["cxx"]["path"] == os.path.realpath(shutil.which(extension._cxx_compiler()))
    assert record["toolchain"]["torch"][0] == __import__("torch").__version__


def test_a_finished_build_is_readable_by_every_user_the_umask_allows(tmp_path, cache):
    """The staging folder is created owner-only; the build it becomes is not
    (root builds in an image, another user runs)."""
    previous = os.umask(0o022)
    try:
        path, _ = extension.compile_library(tiny_library(tiny_source(tmp_path / "src")))
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o755


# A C++ compiler whose compiles (-c) fail while $LB_TEST_FAIL names a file
# that exists; otherwise (and for --version, linking) it is plain c++.
FAILING_COMPILER = """#!/bin/sh
case " $* " in
  *" -c "*) if [ -e "$LB_TEST_FAIL" ]; then echo "error: the test compiler refuses" >&2; exit 1; fi ;;
esac
exec c++ "$@"
"""


def test_a_failed_compile_is_recorded_and_not_repeated_until_a_retry(tmp_path, cache, monkeypatch):
    compiler = tmp_path / "failing-c++"
    compiler.write_text(FAILING_COMPILER)
    compiler.chmod(0o755)
    failing = tmp_path / "fail"
    failing.write_text("")
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("LB_TEST_FAIL", str(failing))
    library = tiny_library(tiny_source(tmp_path / "src"))
    with pytest.raises(extension.BuildError, match="the test compiler refuses"):
        extension.compile_library(library)
    failing.unlink()  # the compiler would work now, but the failure stands for processes that just load
    with pytest.raises(extension.BuildError, match="an earlier build failed: .*`lumenbridge build` tries again"):
        extension.compile_library(library)
    assert not list(cache.glob(f"*{extension.STAGING_SUFFIX}*"))  # nothing was compiled
    path, compiled = extension.compile_library(library, retry_failed=True)
    assert compiled and path.exists()
    assert not list(cache.glob(f"*{extension.FAILED_SUFFIX}"))  # the record goes with the success


@pytest.mark.parametrize("script", ["#!/no/such/interpreter\n", ""], ids=["bad-interpreter", "not-a-program"])
def test_a_compiler_that_does_not_run_counts_as_none(tmp_path, cache, monkeypatch, script):
    compiler = tmp_path / "broken-c++"
    compiler.write_text(script)
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    with pytest.raises(extension.BuildError, match=r"the C\+\+ compiler .*broken-c\+\+ does not run"):
        extension.compile_library(tiny_library(tiny_source(tmp_path / "src")))


# --- item 5: the C++ standard comes from torch ---------------------------------------------


def test_the_cxx_standard_is_the_one_torch_chooses(native_ops):
    report = extension.build(verbose=False)
    # One standard per compiler: the C++ compiler's flags, and nvcc's in a CUDA build.
    lines = (Path(report.library).parent / "build.ninja").read_text().splitlines()
    flags = {words[0]: words[2:] for words in map(str.split, lines) if words[1:2] == ["="]}
    compilers = ["cflags", "cuda_cflags"] if report.with_cuda else ["cflags"]
    for compiler in compilers:
        assert len([flag for flag in flags[compiler] if flag.startswith("-std=")]) == 1, compiler
    # None of them ours: torch adds nvcc's only where the flags hold none.
    library = extension._lumenbridge_library(True)
    assert not any(flag.startswith("-std") for flag in (*library.cflags, *library.cuda_cflags))


def test_both_compilers_get_the_kernel_sizes_from_config():
    """As a bit mask, so the flag holds no comma (nvcc splits -D values at commas)."""
    library = extension._lumenbridge_library(True)
    for flags in (library.cflags, library.cuda_cflags):
        (define,) = [flag for flag in flags if flag.startswith("-DLUMENBRIDGE_KERNEL_SIZE_MASK=")]
        mask = int(define.split("=", 1)[1])
        assert [k for k in range(64) if mask >> k & 1] == sorted(KERNEL_SIZES)


def test_phase_clocks_are_a_development_build_of_their_own(monkeypatch):
    """LUMENBRIDGE_PHASE_CLOCKS=1 adds the kernels' phase clocks to nvcc's
    flags only (a digest of its own, so a user's cached build is untouched)."""
    define = f"-D{extension.PHASE_CLOCKS_VARIABLE}"
    monkeypatch.delenv(extension.PHASE_CLOCKS_VARIABLE, raising=False)
    plain = extension._lumenbridge_library(True)
    monkeypatch.setenv(extension.PHASE_CLOCKS_VARIABLE, "1")
    clocked = extension._lumenbridge_library(True)
    assert define not in plain.cuda_cflags and define in clocked.cuda_cflags
    assert clocked.cflags == plain.cflags
    toolchain = {"compiler": "same"}
    assert extension._digest(plain, toolchain) != extension._digest(clocked, toolchain)


# --- item 13: no compiler, one line -------------------------------------------------------


def test_without_a_compiler_the_fallback_is_one_line_per_device(tmp_path):
    """`info` chooses a backend for each visible device type; each whose
    default is native falls back to the reference with one line (cpu and cuda
    on a CUDA machine; MPS's default is the reference)."""
    run = subprocess.run(
        [sys.executable, "-m", "lumenbridge", "info"],
        env=environment(tmp_path / "cache", CXX="no-such-compiler"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    native_by_default = [
        d for d in visible_device_types() if "native" in (DEFAULTS.get((d, False)), DEFAULTS.get((d, True)))
    ]
    for line, device in zip(run.stderr.splitlines(), native_by_default, strict=True):
        assert line.startswith(
            f"LumenBridge: using the PyTorch reference on {device}: the native extension is not built"
        )
        assert "no C++ compiler found (looked for 'no-such-compiler'" in line
    assert "native     unavailable" in run.stdout


# --- the real extension, end to end -------------------------------------------------------


def test_a_killed_first_build_without_ninja_on_path_recovers_and_is_then_cached(tmp_path):
    """The new user's path: a first `lumenbridge build` killed a few seconds
    in, with no ninja on PATH; `lumenbridge info` then says the extension is
    not built (without compiling), a second `build` recovers, and `info`
    loads that build without compiling and reports the native backend."""
    cache = tmp_path / "cache"
    # No GPU visible, so that on a CUDA machine too the build is the CPU one of
    # seconds, not the CUDA kernels' minutes.
    env = environment(cache, PATH=path_without_ninja(tmp_path), CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-m", "lumenbridge"]
    first = start_job([*command, "build"], env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for(lambda: any(cache.glob(f"*{extension.STAGING_SUFFIX}*/build.ninja")), first)
    time.sleep(2)
    os.killpg(first.pid, signal.SIGHUP)  # what closing the terminal does; ninja stops its compilers
    first.communicate()

    def run(subcommand):
        return subprocess.run([*command, subcommand], env=env, capture_output=True, text=True, timeout=600, check=False)

    unbuilt, recovered, cached = run("info"), run("build"), run("info")
    for each in (unbuilt, recovered, cached):
        assert each.returncode == 0, each.stderr
    assert "native     not built yet" in unbuilt.stdout and unbuilt.stderr == ""  # info never compiles
    assert "compiling the native extension" in recovered.stderr
    assert "discarding an unfinished earlier build" in recovered.stderr
    assert "native     available on cpu" in cached.stdout and cached.stderr == ""
