"""Shared fixtures: device lists and the native-extension gate."""

from __future__ import annotations

import shutil

import pytest
import torch

from lumenbridge import extension, native

HAS_CUDA = torch.cuda.is_available()


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
