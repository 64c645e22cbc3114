"""Builds and loads the native extension (the C++ gateway, CPU kernels and,
where a CUDA GPU and toolkit exist, the CUDA kernels).

The extension is compiled on first use with torch.utils.cpp_extension and
cached on disk (under TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions),
so later processes load it in well under a second. `lumenbridge build` builds
it explicitly. Where it cannot be built (no compiler, no ninja, a compile
error), one warning line is logged and LumenBridge uses the PyTorch reference.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("lumenbridge")

CSRC = Path(__file__).parent / "csrc"
# at::parallel_for runs serially unless the extension itself is built with
# OpenMP (as libtorch is on Linux); elsewhere the CPU kernels run on one thread.
OPENMP_FLAGS = ["-fopenmp"] if sys.platform.startswith("linux") else []


class BuildError(RuntimeError):
    """The native extension could not be built or loaded."""

    @property
    def summary(self) -> str:
        """The first line of the cause, for a one-line log message."""
        return str(self).strip().splitlines()[0] if str(self).strip() else "unknown error"


@dataclass(frozen=True)
class BuildReport:
    library: str
    with_cuda: bool
    cuda_archs: tuple[str, ...]
    seconds: float

    def __str__(self) -> str:
        kind = (
            f"CPU + CUDA kernels for {', '.join(self.cuda_archs)}" if self.with_cuda else "CPU kernels only (no CUDA)"
        )
        return f"built {kind} in {self.seconds:.1f} s\n  library: {self.library}"


def _cuda_toolkit_usable() -> bool:
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.version.cuda is not None and torch.cuda.is_available() and CUDA_HOME is not None


def _cuda_archs() -> tuple[str, ...]:
    """The archs cpp_extension compiles for: TORCH_CUDA_ARCH_LIST, else each visible GPU's."""
    requested = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if requested:
        return tuple(re.split(r"[ ;]+", requested.strip()))
    capabilities = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return tuple(f"{major}.{minor}" for major, minor in sorted(capabilities))


def _sources(with_cuda: bool) -> list[str]:
    sources = [*sorted(CSRC.glob("*.cpp")), *sorted((CSRC / "cpu").glob("*.cpp"))]
    if with_cuda:
        sources += sorted((CSRC / "cuda").glob("*.cu"))
    return [str(s) for s in sources]


def _is_cached(name: str) -> bool:
    """Whether a library of this name is already built (sources may still have changed)."""
    from torch.utils import cpp_extension

    # A private helper of cpp_extension; if a future torch drops it, only the
    # first-build notice is affected.
    locate = getattr(cpp_extension, "_get_build_directory", None)
    return locate is not None and (Path(locate(name, verbose=False)) / f"{name}.so").exists()


def _build(verbose: bool) -> BuildReport:
    from torch.utils import cpp_extension

    with_cuda = _cuda_toolkit_usable()
    # The torch version is part of the name: a cached library built against
    # another torch must never be loaded.
    flavour = "cuda" if with_cuda else "cpu"
    name = "lumenbridge_" + re.sub(r"\W", "_", f"{torch.__version__}_{flavour}")
    if not _is_cached(name):
        log.warning("LumenBridge: compiling the native extension (first use only; cached afterwards)")
    started = time.perf_counter()
    try:
        library = cpp_extension.load(
            name=name,
            sources=_sources(with_cuda),
            extra_include_paths=[str(CSRC)],
            extra_cflags=["-O3", "-std=c++17", *OPENMP_FLAGS] + (["-DLUMENBRIDGE_WITH_CUDA"] if with_cuda else []),
            extra_ldflags=OPENMP_FLAGS,
            extra_cuda_cflags=["-O3", "-lineinfo", "--expt-relaxed-constexpr", "-DLUMENBRIDGE_WITH_CUDA"],
            with_cuda=with_cuda,
            is_python_module=False,
            verbose=verbose,
        )
    except Exception as error:  # any compiler or loader failure means "no native kernels"
        raise BuildError(f"{type(error).__name__}: {error}") from error
    return BuildReport(
        library=str(library) if library else name,
        with_cuda=with_cuda,
        cuda_archs=_cuda_archs() if with_cuda else (),
        seconds=time.perf_counter() - started,
    )


# None until the first load or build; then the report, or the error that stopped it.
_state: BuildReport | BuildError | None = None


def build(verbose: bool = True) -> BuildReport:
    """Build (or load from the cache) the extension now; raise BuildError on failure."""
    global _state
    if not isinstance(_state, BuildReport):
        _state = _build(verbose=verbose)
    return _state


def load() -> bool:
    """Load the extension, building it if needed; False if that fails. The
    failure is remembered, not retried; dispatch logs it once when it falls
    back to the reference, and `lumenbridge build` shows it in full."""
    global _state
    if _state is None:
        try:
            _state = _build(verbose=False)
        except BuildError as error:
            _state = error
    return isinstance(_state, BuildReport)


def has_cuda_kernels() -> bool:
    return load() and _state.with_cuda


def load_error() -> str | None:
    """Why the extension is unavailable (the first line of the cause), or None if it loaded."""
    return None if load() else _state.summary
