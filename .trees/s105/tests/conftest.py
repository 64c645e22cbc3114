"""Shared fixtures: device lists and the native-extension gate."""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest
import torch
from PIL import Image

from lumenbridge import extension, native, planning
from lumenbridge.distributed import Group
from lumenbridge.plan import Plan
from lumenbridge.sources import expand_inputs

HAS_CUDA = torch.cuda.is_available()
# Set by scripts/gpu_check.sh: there, a torch that sees no GPU would turn every
# CUDA test into a skip and the run into a pass.
REQUIRE_CUDA = "LUMENBRIDGE_REQUIRE_CUDA"


# PyTorch's compile cache keys a graph on the names of the ops it calls, not
# on what they return (the README's "Compiled models"): a cache shared with
# another checkout of LumenBridge could replay that version's graphs here. A
# run without TORCHINDUCTOR_CACHE_DIR set gets a fresh one of its own, which
# the subprocesses it starts inherit and which goes when it ends.
INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"
OWN_INDUCTOR_CACHE = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(REQUIRE_CUDA) == "1" and not HAS_CUDA:
        raise pytest.UsageError(f"{REQUIRE_CUDA}=1, but torch {torch.__version__} sees no CUDA GPU")
    if INDUCTOR_CACHE not in os.environ:
        folder = tempfile.mkdtemp(prefix="lumenbridge-tests-inductor-")
        config.stash[OWN_INDUCTOR_CACHE] = os.environ[INDUCTOR_CACHE] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(OWN_INDUCTOR_CACHE, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(INDUCTOR_CACHE, None)


def import_or_skip(name: str) -> ModuleType:
    """An optional package, or a skip that says why it cannot be used: not
    installed (ImportError), or installed for another torch (torchvision then
    raises RuntimeError at import, on operators it cannot register)."""
    try:
        return importlib.import_module(name)
    except (ImportError, RuntimeError) as error:
        pytest.skip(f"{name} cannot be imported here: {error}", allow_module_level=True)


def save_image(path: Path, size=(20, 16), color=(200, 100, 50), mode="RGB") -> str:
    """A small one-colour image at path (its folders made), as a str."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, color).save(path)
    return str(path)


def plan_of(folder: Path, *paths) -> Plan:
    """The plan of the paths, as a run of one process writes it in a new folder below `folder`."""
    staging = tempfile.mkdtemp(dir=folder)
    planned = planning.write_inputs(staging, expand_inputs([str(path) for path in paths]))
    plan, _, _ = planning.make_plan(str(folder), planned, Group())
    return plan


def load_script(name: str, folder: str = "scripts") -> ModuleType:
    """<folder>/<name>.py as a module (the scripts and benchmarks are not
    packages), kept in sys.modules, where dataclasses look their module up;
    the folder goes on sys.path, where the file imports its siblings from."""
    folder_path = Path(__file__).resolve().parents[1] / folder
    if str(folder_path) not in sys.path:
        sys.path.append(str(folder_path))
    spec = importlib.util.spec_from_file_location(name, folder_path / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def native_ops():
    """torch.ops.lumenbridge, built and registered. Skips only where no C++
    compiler exists; a failed build on a machine with one is a test failure."""
    if not native.ready():
        if shutil.which("c++") is None and shutil.which("g++") is None:
            pytest.skip("no C++ compiler: the native extension cannot be built here")
        pytest.fail(f"the native extension failed to build: {extension.load_error()}")
    return torch.ops.lumenbridge


def device_params():
    """cpu always; cuda as a parameter that skips cleanly without a GPU."""
    return [
        "cpu",
        pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]),
    ]


@pytest.fixture
def cuda_kernels(native_ops):
    if not extension.has_cuda_kernels():
        pytest.fail("a CUDA GPU is visible but the extension was built without CUDA kernels")
    return native_ops


@pytest.fixture
def poisoned(native_ops):
    """The ops' outputs filled with NaN before the kernels write them, so an
    element a kernel misses shows."""
    native_ops._set_poison_outputs(True)
    yield native_ops
    native_ops._set_poison_outputs(False)
