"""Builds and loads the native extension (the C++ gateway, CPU kernels and,
where a CUDA GPU and toolkit exist, the CUDA kernels).

The extension is compiled on first use with torch.utils.cpp_extension and
cached on disk (under TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions).
`lumenbridge build` builds it explicitly. Where it cannot be built (no
compiler, no ninja, a compile error), one warning line is logged and
LumenBridge uses the PyTorch reference.

Each build gets its own folder, named by a digest of everything that shapes
the library: the source files' contents, the flags, the compiler, torch and
Python. A finished build is marked complete and from then on loaded directly,
without running ninja, so another ninja, checkout or activated venv never
triggers a rebuild, and distinct toolchains keep their builds side by side.
A build runs under an flock() lock that the operating system releases when
its process dies, in a staging folder that is renamed into place only once
the build succeeded, so a killed build never blocks or corrupts later runs:
the next process takes the lock, discards the unfinished folder and builds
again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .atomic import current_umask
from .config import KERNEL_SIZES

try:
    import fcntl
except ImportError:  # Windows: builds run unlocked
    fcntl = None

log = logging.getLogger("lumenbridge")

CSRC = Path(__file__).parent / "csrc"
# at::parallel_for runs serially unless the extension itself is built with
# OpenMP (as libtorch is on Linux); elsewhere the CPU kernels run on one thread.
OPENMP_FLAGS = ["-fopenmp"] if sys.platform.startswith("linux") else []
# The kernel sizes the C++ and CUDA code instantiate and accept
# (csrc/kernel_sizes.h), as a bit mask: a list would need commas, which nvcc
# splits -D values at.
KERNEL_SIZES_DEFINE = f"-DLUMENBRIDGE_KERNEL_SIZE_MASK={sum(1 << k for k in KERNEL_SIZES)}"
# A development build: with LUMENBRIDGE_PHASE_CLOCKS=1 in the environment the
# fused kernels stamp their phases (scripts/phase_clock.py reads them). The
# flag is part of the build digest, so such a build has a cache of its own.
PHASE_CLOCKS_VARIABLE = "LUMENBRIDGE_PHASE_CLOCKS"
# Written into a finished build before it is moved into place; records what it was built from.
COMPLETE_MARKER = "complete.json"
# A build runs in <folder>.building-XXXX and is renamed to <folder> when it succeeds.
STAGING_SUFFIX = ".building-"
# Next to a build folder: the summary of a compile of it that failed.
FAILED_SUFFIX = ".failed"


class BuildError(RuntimeError):
    """The native extension could not be built or loaded."""

    @property
    def summary(self) -> str:
        """One line for a log message: the compiler's first error line when
        there is one (a compile failure's first line is a ninja command line),
        else the first line of the cause."""
        lines = [line.strip() for line in str(self).strip().splitlines() if line.strip()]
        if not lines:
            return "unknown error"
        errors = [line for line in lines[1:] if re.search(r"\berror\b", line, re.IGNORECASE)]
        if errors:
            return f"{lines[0].split(': [')[0]}: {errors[0]} (`lumenbridge build` shows the whole output)"
        return lines[0]


@dataclass(frozen=True)
class Library:
    """One shared library to compile: its sources live under source_dir, and
    every file there (headers included) counts towards its build digest."""

    name: str
    source_dir: Path
    sources: tuple[Path, ...]
    cflags: tuple[str, ...] = ()
    cuda_cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    with_cuda: bool = False


@dataclass(frozen=True)
class BuildReport:
    library: str
    with_cuda: bool
    cuda_archs: tuple[str, ...]
    seconds: float
    compiled: bool  # False when a finished build was loaded from the cache

    def __str__(self) -> str:
        kind = (
            f"CPU + CUDA kernels for {', '.join(self.cuda_archs)}" if self.with_cuda else "CPU kernels only (no CUDA)"
        )
        how = "built" if self.compiled else "loaded the cached build of"
        return f"{how} {kind} in {self.seconds:.1f} s\n  library: {self.library}"


def _cpp_extension():
    """torch.utils.cpp_extension. On a machine with a CUDA toolkit but no GPU,
    importing it warns that no CUDA runtime is found; LumenBridge builds no
    CUDA kernels there, so the warning would only be noise on every run."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    if not torch.cuda.is_available():
        logger.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        logger.setLevel(level)
    return cpp_extension


def _cuda_toolkit_usable() -> bool:
    return torch.version.cuda is not None and torch.cuda.is_available() and _cpp_extension().CUDA_HOME is not None


def _cuda_archs() -> tuple[str, ...]:
    """The archs cpp_extension compiles for: TORCH_CUDA_ARCH_LIST, else each visible GPU's."""
    requested = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if requested:
        return tuple(re.split(r"[ ;]+", requested.strip()))
    capabilities = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return tuple(f"{major}.{minor}" for major, minor in sorted(capabilities))


def _tool_identity(program: str) -> dict[str, str]:
    """Where a compiler resolves to and what it says its version is; empty if
    it is missing, and with "error" if it does not run (a wrapper with a bad
    interpreter line, a binary for another machine, one that hangs)."""
    path = shutil.which(program) if program else None
    if path is None:
        return {}
    identity = {"path": os.path.realpath(path)}
    try:
        run = subprocess.run([path, "--version"], capture_output=True, text=True, check=False, timeout=60)
    except (OSError, subprocess.SubprocessError) as error:
        return {**identity, "error": f"{type(error).__name__}: {error}"}
    return {**identity, "version": run.stdout.strip()}


def _cxx_compiler() -> str:
    return _cpp_extension().get_cxx_compiler()


def _nvcc() -> str:
    return os.path.join(_cpp_extension().CUDA_HOME, "bin", "nvcc")


def _toolchain(library: Library) -> dict:
    """Everything outside the sources and flags that the compiled library depends on."""
    toolchain = {
        "torch": [torch.__version__, torch.version.git_version, torch.version.cuda],
        "python": [sys.implementation.cache_tag, sys.platform, platform.machine()],
        "cxx": _tool_identity(_cxx_compiler()),
    }
    if library.with_cuda:
        toolchain["nvcc"] = _tool_identity(_nvcc())
        toolchain["cuda_archs"] = _cuda_archs()
    return toolchain


def _digest(library: Library, toolchain: dict) -> str:
    """A digest of the sources (by path relative to source_dir, so identical
    checkouts share a build), the flags and the toolchain."""
    digest = hashlib.sha256()
    for path in sorted(p for p in library.source_dir.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(library.source_dir)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    settings = [
        [str(p.relative_to(library.source_dir)) for p in library.sources],
        library.cflags,
        library.cuda_cflags,
        library.ldflags,
        library.with_cuda,
        toolchain,
    ]
    digest.update(json.dumps(settings, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def _build_root() -> Path:
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or _cpp_extension().get_default_build_root())


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive flock() on lock_path. The kernel drops it when the
    holder exits, however it exits, so a lock can never outlive its owner."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    # Opened without truncation: the file is never removed or replaced, so all
    # processes lock the same inode; it only carries the holder's pid, for messages.
    with open(lock_path, "a+") as file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            owner = file.read().strip() or "unknown"
            log.warning(
                "LumenBridge: waiting for process %s, which is building the native extension (%s)", owner, lock_path
            )
            fcntl.flock(file, fcntl.LOCK_EX)
        file.truncate(0)
        file.write(str(os.getpid()))
        file.flush()
        yield


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """PATH with the ninja that LumenBridge depends on in front: run as
    .venv/bin/lumenbridge, the venv's bin/ is not on PATH, and cpp_extension
    only looks there."""
    try:
        import ninja
    except ImportError:  # installed without its dependencies: PATH may still have one
        yield
        return
    saved = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join(filter(None, [ninja.BIN_DIR, saved]))
    try:
        yield
    finally:
        if saved is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = saved


def _whole_library(path: Path) -> bool:
    """False for a library that is not a whole ELF file (on Linux; elsewhere
    True): one cut short no longer reaches the section headers that end it,
    and dlopen of it can kill the process with SIGBUS instead of raising.
    Reads 64 bytes."""
    if not sys.platform.startswith("linux"):
        return True
    with open(path, "rb") as file:
        header = file.read(64)
    if len(header) < 64 or header[:4] != b"\x7fELF":
        return False
    if header[4] != 2:  # not ELF64: no check
        return True
    order = "<" if header[5] == 1 else ">"
    (section_offset,) = struct.unpack_from(order + "Q", header, 0x28)
    entry_size, entries = struct.unpack_from(order + "HH", header, 0x3A)
    return path.stat().st_size >= section_offset + entry_size * entries


def _discard_unfinished(folder: Path) -> bool:
    """Remove what earlier builds of folder left: their staging folders, and
    folder itself, which is incomplete if this runs. The caller holds the build
    lock, so the processes that made them are gone. True if there was any."""
    leftovers = list(folder.parent.glob(folder.name + STAGING_SUFFIX + "*"))
    if folder.exists():
        leftovers.append(folder)
    for leftover in leftovers:
        # Compilers orphaned by a killed build may still be writing there.
        shutil.rmtree(leftover, ignore_errors=True)
    return bool(leftovers)


def _missing_tool(toolchain: dict) -> str | None:
    """Why the toolchain cannot build at all, found without compiling anything; None if it can try."""
    cxx = toolchain["cxx"]
    if not cxx:
        return f"no C++ compiler found (looked for {_cxx_compiler()!r}; set CXX to choose one)"
    if "error" in cxx:
        return f"the C++ compiler {cxx['path']} does not run ({cxx['error']}; set CXX to choose another)"
    with _ninja_on_path():
        if shutil.which("ninja") is None:
            return "ninja not found (pip install ninja)"
    return None


def _compile(library: Library, folder: Path, toolchain: dict, verbose: bool) -> None:
    """Compile and load library, staged in a folder of its own that becomes
    `folder`, marked complete, only once the build has succeeded."""
    discarded = _discard_unfinished(folder)
    log.warning(
        "LumenBridge: compiling the native extension into %s%s",
        folder,
        " (discarding an unfinished earlier build)" if discarded else "",
    )
    staging = Path(tempfile.mkdtemp(prefix=folder.name + STAGING_SUFFIX, dir=folder.parent))
    try:
        # Loads the library too, from the staging path; the mapping survives the renames.
        built = _cpp_extension().load(
            name=library.name,
            sources=[str(s) for s in library.sources],
            extra_include_paths=[str(library.source_dir)],
            extra_cflags=list(library.cflags),
            extra_cuda_cflags=list(library.cuda_cflags),
            extra_ldflags=list(library.ldflags),
            build_directory=str(staging),
            with_cuda=library.with_cuda,
            is_python_module=False,
            verbose=verbose,
        )
        # cpp_extension appends _v1, _v2... when one process builds a name again.
        os.rename(built, staging / f"{library.name}.so")
        description = {"sources": [str(s) for s in library.sources], "toolchain": toolchain}
        (staging / COMPLETE_MARKER).write_text(json.dumps(description, indent=1))
        # mkdtemp's 0700 would hide the build from every other user of the cache.
        os.chmod(staging, 0o777 & ~current_umask())
        os.rename(staging, folder)
    except Exception as error:  # any compiler or loader failure means "no native kernels"
        shutil.rmtree(staging, ignore_errors=True)
        raise BuildError(f"{type(error).__name__}: {error}") from error


def _build_folder(library: Library, toolchain: dict) -> Path:
    return _build_root() / f"{library.name}_{_digest(library, toolchain)}"


def _failure_record(folder: Path) -> Path:
    """Where a failed compile of `folder` is recorded, so that later
    processes fall back at once instead of compiling for minutes again."""
    return folder.with_name(folder.name + FAILED_SUFFIX)


def _earlier_failure(folder: Path) -> str | None:
    try:
        return _failure_record(folder).read_text(encoding="utf-8").strip() or "unknown error"
    except OSError:  # none recorded
        return None


def compile_library(
    library: Library, verbose: bool = False, build_missing: bool = True, retry_failed: bool = False
) -> tuple[Path, bool] | None:
    """Load library from its cached build, compiling it first if there is
    none (or returning None, without `build_missing`); return the shared
    library's path and whether it was compiled now. Raises BuildError if it
    cannot be built or loaded. A compile that failed before, with the same
    sources and toolchain, is not tried again unless `retry_failed`."""
    toolchain = _toolchain(library)
    folder = _build_folder(library, toolchain)
    path = folder / f"{library.name}.so"

    def complete() -> bool:
        """A finished build whose library is still whole: one cut short since
        (a full disk, a partial copy of the cache) would crash the process in
        dlopen (SIGBUS), so it counts as unfinished and is built again."""
        try:
            return (folder / COMPLETE_MARKER).exists() and _whole_library(path)
        except OSError:  # the library is gone
            return False

    if not complete() and not build_missing:
        return None
    if not complete():
        missing = _missing_tool(toolchain)
        if missing is not None:
            raise BuildError(missing)
        try:
            with _exclusive(folder.with_name(folder.name + ".lock")):
                # Another process may have finished it while this one waited.
                if not complete():
                    _compile_recording_failure(library, folder, toolchain, verbose, retry_failed)
                    return path, True
        except OSError as error:  # e.g. a read-only cache
            raise BuildError(f"cannot build in {folder.parent}: {error}") from error
    try:
        torch.ops.load_library(str(path))
    except OSError as error:
        cause = f" ({error.__cause__})" if error.__cause__ else ""
        raise BuildError(
            f"cannot load {path}: {error}{cause}; remove {folder} and run `lumenbridge build` to build it again"
        ) from error
    return path, False


def _compile_recording_failure(library: Library, folder: Path, toolchain: dict, verbose: bool, retry: bool) -> None:
    """_compile, unless an earlier one failed (and not `retry`); a failure is recorded for later processes."""
    failed = _earlier_failure(folder)
    if failed is not None and not retry:
        raise BuildError(f"an earlier build failed: {failed}; `lumenbridge build` tries again")
    try:
        with _ninja_on_path():
            _compile(library, folder, toolchain, verbose)
    except BuildError as error:
        with contextlib.suppress(OSError):
            _failure_record(folder).write_text(error.summary + "\n", encoding="utf-8")
        raise
    _failure_record(folder).unlink(missing_ok=True)


def _lumenbridge_library(with_cuda: bool) -> Library:
    sources = [*CSRC.glob("*.cpp"), *(CSRC / "cpu").glob("*.cpp")]
    if with_cuda:
        sources += (CSRC / "cuda").glob("*.cu")
    # Largest first: ninja starts its jobs in this order, as many as the cores
    # allow, and the largest file (the fused kernels, the longest compile) would
    # otherwise wait for a free core at the end of the list.
    sources.sort(key=lambda path: (-path.stat().st_size, path.name))
    # No -std flag: cpp_extension passes the C++ standard that this torch's headers need.
    return Library(
        name="lumenbridge_" + ("cuda" if with_cuda else "cpu"),
        source_dir=CSRC,
        sources=tuple(sources),
        cflags=("-O3", *OPENMP_FLAGS, KERNEL_SIZES_DEFINE, *(["-DLUMENBRIDGE_WITH_CUDA"] if with_cuda else [])),
        cuda_cflags=(
            "-O3",
            "-lineinfo",
            "--expt-relaxed-constexpr",
            KERNEL_SIZES_DEFINE,
            "-DLUMENBRIDGE_WITH_CUDA",
            *([f"-D{PHASE_CLOCKS_VARIABLE}"] if os.environ.get(PHASE_CLOCKS_VARIABLE) == "1" else []),
        ),
        ldflags=tuple(OPENMP_FLAGS),
        with_cuda=with_cuda,
    )


def _build(verbose: bool, build_missing: bool = True, retry_failed: bool = False) -> BuildReport | None:
    with_cuda = _cuda_toolkit_usable()
    started = time.perf_counter()
    result = compile_library(
        _lumenbridge_library(with_cuda), verbose=verbose, build_missing=build_missing, retry_failed=retry_failed
    )
    if result is None:
        return None
    path, compiled = result
    # The ops' Python halves (fakes, autograd) belong to the library: register
    # them as soon as it is loaded, so torch.ops.lumenbridge is complete.
    from . import native

    native.register_python_kernels()
    return BuildReport(
        library=str(path),
        with_cuda=with_cuda,
        cuda_archs=_cuda_archs() if with_cuda else (),
        seconds=time.perf_counter() - started,
        compiled=compiled,
    )


# None until the first load or build; then the report, or the error that stopped it.
_state: BuildReport | BuildError | None = None


def build(verbose: bool = True) -> BuildReport:
    """Build (or load from the cache) the extension now; raise BuildError on failure."""
    global _state
    if not isinstance(_state, BuildReport):
        _state = _build(verbose=verbose, retry_failed=True)
    return _state


def load(build_missing: bool = True) -> bool:
    """Load the extension, building it if needed (only if already built,
    without `build_missing`); False if that fails. A failure is remembered,
    not retried; dispatch logs it once when it falls back to the reference,
    and `lumenbridge build` shows it in full."""
    global _state
    if _state is None:
        try:
            _state = _build(verbose=False, build_missing=build_missing)
        except BuildError as error:
            _state = error
    return isinstance(_state, BuildReport)


def needs_compiling() -> bool:
    """Whether loading the extension now would compile it (minutes): it is
    not built, the tools to build it are there, and no build of it failed."""
    if _state is not None or load(build_missing=False):
        return False
    library = _lumenbridge_library(_cuda_toolkit_usable())
    toolchain = _toolchain(library)
    return _missing_tool(toolchain) is None and _earlier_failure(_build_folder(library, toolchain)) is None


def has_cuda_kernels() -> bool:
    return load() and _state.with_cuda


def load_error() -> str | None:
    """Why the extension is unavailable (the first line of the cause), or None if it loaded."""
    return None if load() else _state.summary
