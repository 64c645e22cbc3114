"""Building the extension: a failed build degrades to the reference with one
log line and never raises from the automatic path."""

from __future__ import annotations

import logging

import pytest

import lumenbridge
from lumenbridge import dispatch, extension


def failing_load(**kwargs):
    raise RuntimeError("Error building extension 'lumenbridge': c++: command not found")


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A cache with no finished build, so that the (failing) build runs."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))


def test_failed_build_raises_build_error_naming_the_cause(monkeypatch, empty_cache):
    monkeypatch.setattr("torch.utils.cpp_extension.load", failing_load)
    with pytest.raises(extension.BuildError, match="c\\+\\+: command not found"):
        extension._build(verbose=False)


def test_failed_build_falls_back_with_a_notice_and_one_log_line(monkeypatch, caplog, empty_cache):
    monkeypatch.setattr("torch.utils.cpp_extension.load", failing_load)
    monkeypatch.setattr(extension, "_state", None)
    monkeypatch.setattr(dispatch, "_fallbacks_logged", set())
    monkeypatch.delenv(lumenbridge.BACKEND_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="lumenbridge"):
        assert extension.load() is False
        assert extension.load() is False  # remembered, not rebuilt
        assert lumenbridge.select_backend("cpu").name == "reference"
        assert lumenbridge.select_backend("cpu").name == "reference"
    notice, *fallbacks = [r.getMessage() for r in caplog.records]
    assert "compiling the native extension" in notice
    assert len(fallbacks) == 1
    assert "using the PyTorch reference on cpu" in fallbacks[0] and "command not found" in fallbacks[0]
    assert "command not found" in extension.load_error()
    assert extension.has_cuda_kernels() is False


def test_a_compile_error_is_summed_up_by_the_compilers_first_error_line():
    error = extension.BuildError(
        "Error building extension 'lumenbridge_cpu': [1/2] c++ -MMD -MF gateway.o.d -O3 -c gateway.cpp\n"
        "FAILED: gateway.o\n"
        "gateway.cpp:12:3: error: expected ';' before '}' token\n"
        "gateway.cpp:20:1: error: another one\n"
    )
    assert error.summary == (
        "Error building extension 'lumenbridge_cpu': gateway.cpp:12:3: error: expected ';' before '}' token "
        "(`lumenbridge build` shows the whole output)"
    )
    assert extension.BuildError("c++: command not found\nmore").summary == "c++: command not found"


def test_build_report_names_what_was_built(native_ops):
    report = extension.build(verbose=False)
    assert "CPU" in str(report) and report.library
    assert report.with_cuda == extension.has_cuda_kernels()
    if report.with_cuda:
        assert report.cuda_archs and all("." in arch for arch in report.cuda_archs)


@pytest.mark.parametrize("with_cuda", [False, True])
def test_sources_are_listed_largest_first_so_the_longest_compile_starts_first(with_cuda):
    sources = extension._lumenbridge_library(with_cuda).sources
    sizes = [path.stat().st_size for path in sources]
    assert sizes == sorted(sizes, reverse=True)
    assert any(path.suffix == ".cu" for path in sources) == with_cuda
    assert len(set(sources)) == len(sources) and all(path.is_file() for path in sources)
