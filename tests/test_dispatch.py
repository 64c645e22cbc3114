"""Backend choice (argument, environment, defaults), the report, and the
model on the native backend against the reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import device_params

import lumenbridge
from lumenbridge import BACKEND_ENV, TokenizerConfig, VisualTokenizer, dispatch, ops
from lumenbridge.testing import TokenizeCase, compare_gradients_to_float64, compare_to_float64

SMALL = dataclasses.replace(TokenizerConfig(), embed_dim=32, stage_widths=(8, 16, 16, 32))


def test_defaults_per_device_and_layout(native_ops, monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    # The measured choices of benchmarks/RESULTS.md.
    assert lumenbridge.select_backend("cpu").name == "native"
    assert lumenbridge.select_backend("cpu", channels_last=True).name == "reference"
    assert lumenbridge.select_backend("meta").name == "reference"  # no native kernels there


def test_argument_overrides_environment(native_ops, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "native")
    assert lumenbridge.select_backend("cpu").name == "native"
    assert lumenbridge.select_backend("cpu", "reference").name == "reference"
    monkeypatch.setenv(BACKEND_ENV, "reference")
    assert lumenbridge.select_backend("cpu").name == "reference"


def test_unknown_backend_is_an_error(monkeypatch):
    with pytest.raises(ValueError, match="unknown backend 'triton'"):
        lumenbridge.select_backend("cpu", "triton")
    monkeypatch.setenv(BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match=f"unknown backend 'fast' \\(from {BACKEND_ENV}=fast\\)"):
        lumenbridge.select_backend("cpu")
    with pytest.raises(ValueError, match="unknown backend 'Native'"):
        VisualTokenizer(SMALL, backend="Native")  # when the model is built, not at its first forward


def test_explicit_backend_that_cannot_run_is_an_error():
    with pytest.raises(RuntimeError, match="backend 'native' cannot run on meta"):
        lumenbridge.select_backend("meta", "native")


def test_unbuildable_extension_falls_back_with_one_reason(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.setattr(dispatch, "_fallbacks_logged", set())
    monkeypatch.setattr(dispatch.native, "ready", lambda: False)
    monkeypatch.setattr(dispatch.extension, "load_error", lambda: "no compiler")
    assert lumenbridge.select_backend("cpu").name == "reference"
    assert dispatch.unavailable_reason("native", "cpu") == "the native extension is not built: no compiler"
    with pytest.raises(RuntimeError, match="no compiler"):
        lumenbridge.select_backend("cpu", "native")


def test_report_lists_implementations_and_choices(native_ops):
    report = lumenbridge.backends()
    assert report.implementations["reference"].startswith("available on cpu")
    assert report.implementations["native"].startswith("available on cpu")
    assert report.selection["cpu NCHW"] == "native" and report.selection["cpu NHWC"] == "reference"
    assert report.backward_paths["cpu"].startswith("native: lumenbridge::tokenize_backward")
    text = str(report)
    assert "reference" in text and "native" in text and "cpu NHWC" in text and "tokenizer backward" in text


def test_the_report_without_building_says_the_extension_is_not_built(monkeypatch):
    monkeypatch.setattr(dispatch.extension, "needs_compiling", lambda: True)
    monkeypatch.setattr(dispatch, "select_backend", lambda *a, **k: pytest.fail("the selection would build"))
    report = lumenbridge.backends(build_missing=False)
    assert report.implementations["native"].startswith("not built yet")
    assert "selection: shown once the native extension is built" in str(report)


def test_a_built_extension_needs_no_compiling(native_ops):
    assert not dispatch.extension.needs_compiling()
    assert lumenbridge.backends(build_missing=False) == lumenbridge.backends()


def test_state_dict_keys_do_not_depend_on_the_backend(native_ops):
    keys = [list(VisualTokenizer(SMALL, backend=name).state_dict()) for name in ("reference", "native")]
    assert keys[0] == keys[1]


def bad_call(change: str):
    """A functional op call with one argument broken, as `change` names it."""
    x, dw, dwb = torch.randn(2, 4, 9, 7), torch.randn(4, 1, 3, 3), torch.randn(4)
    pw, pwb = torch.randn(6, 4, 1, 1), torch.randn(6)
    calls = {
        "non-square kernel": lambda backend: ops.depthwise_conv2d(x, torch.randn(4, 1, 3, 5), dwb, backend=backend),
        "even kernel": lambda backend: ops.depthwise_conv2d(x, torch.randn(4, 1, 4, 4), dwb, backend=backend),
        "more weight channels": lambda backend: ops.depthwise_conv2d(x, torch.randn(8, 1, 3, 3), backend=backend),
        "uint8 tensors": lambda backend: ops.depthwise_conv2d(
            x.to(torch.uint8), dw.to(torch.uint8), dwb.to(torch.uint8), backend=backend
        ),
        "3-D input": lambda backend: ops.depthwise_conv2d(x[0], dw, dwb, backend=backend),
        "3x3 pointwise": lambda backend: ops.pointwise_conv2d(x, torch.randn(6, 4, 3, 3), pwb, backend=backend),
        "3x3 pw_weight": lambda backend: ops.separable_conv(
            x, dw, dwb, torch.randn(6, 4, 3, 3), pwb, 2, backend=backend
        ),
        "meta pw_weight": lambda backend: ops.separable_conv(x, dw, dwb, pw.to("meta"), pwb, 2, backend=backend),
        "meta weight": lambda backend: ops.depthwise_conv2d(x, dw.to("meta"), backend=backend),
        "numpy input": lambda backend: ops.depthwise_conv2d(x.numpy(), dw, dwb, backend=backend),
        "sparse weight": lambda backend: ops.pointwise_conv2d(x, pw.to_sparse(), pwb, backend=backend),
    }
    return calls[change]


@pytest.mark.parametrize("backend", ["reference", "native"])
@pytest.mark.parametrize(
    "change, error, message",
    [
        ("non-square kernel", (ValueError, RuntimeError), r"weight must have shape \[C, 1, K, K\].*got \[4, 1, 3, 5\]"),
        ("even kernel", (ValueError, RuntimeError), r"(weight must have shape|kernel_size must be one of)"),
        (
            "more weight channels",
            (ValueError, RuntimeError),
            r"weight (must have shape \[C, 1, K, K\].*got \[8, 1, 3, 3\]|has 8 channels but the input has 4)",
        ),
        ("uint8 tensors", (TypeError, RuntimeError), "input has dtype"),
        ("3-D input", (ValueError, RuntimeError), "input must be 4-D"),
        (
            "3x3 pointwise",
            ValueError,
            r"weight must have shape \[C_out, C_in, 1, 1\] with C_in = 4, got \[6, 4, 3, 3\]",
        ),
        ("3x3 pw_weight", ValueError, r"weight must have shape \[C_out, C_in, 1, 1\]"),
        ("meta pw_weight", ValueError, "weight is on meta but input is on cpu"),
        ("meta weight", (ValueError, RuntimeError), "weight is on meta but input is on cpu"),
        ("numpy input", TypeError, "input must be a dense torch.Tensor, got ndarray"),
        ("sparse weight", TypeError, "weight must be a dense torch.Tensor, got a torch.sparse_coo tensor"),
    ],
)
def test_both_backends_refuse_what_the_ops_do_not_take(native_ops, backend, change, error, message):
    """The reference keeps the native gateway's contract: F.conv2d alone would
    run another convolution, wrap integers, or return uninitialized memory."""
    with pytest.raises(error, match=message):
        bad_call(change)(backend)


def test_autocast_leaves_integer_input_alone(native_ops):
    x = torch.randint(0, 255, (1, 4, 8, 8), dtype=torch.uint8)
    with torch.autocast("cpu", torch.bfloat16), pytest.raises(RuntimeError, match="input has dtype"):
        ops.depthwise_conv2d(x, torch.randn(4, 1, 3, 3), backend="native")


def test_separable_conv_matches_two_plain_convolutions(native_ops):
    x = torch.randn(2, 8, 15, 12)
    dw, dwb = torch.randn(8, 1, 3, 3), torch.randn(8)
    pw, pwb = torch.randn(16, 8, 1, 1), torch.randn(16)
    expected = F.conv2d(F.conv2d(x, dw, dwb, stride=2, padding=1, groups=8), pw, pwb)
    for name in ("reference", "native"):
        torch.testing.assert_close(ops.separable_conv(x, dw, dwb, pw, pwb, 2, backend=name), expected)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_native_tokens_and_gradients_match_the_reference(native_ops, device, channels_last, monkeypatch):
    """The native backend in float32 against float64: tokens and every
    gradient within the tolerance rule, which the reference backend's own
    float32 error on the same inputs sets. A fixed 1e-5 of each gradient's
    largest magnitude is not a bound PyTorch keeps: a bias gradient sums
    thousands of terms that cancel, and CI once measured the reference's
    stage-0 depthwise bias gradient at 1.7x it. TF32 convolutions (on by
    default on CUDA, 1e-3 relative) are switched off, so both sides compute
    in full float32, as matmuls do by default."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    case = TokenizeCase("dispatch", SMALL, batch=2, size=(48, 64), channels_last=channels_last)
    model = case.model().to(device)
    model.backend = "native"
    images = case.images().to(device)
    with torch.no_grad():
        tokens = model(images)
    reports = {"tokens": compare_to_float64(model, images, tokens, torch.float32)}
    reports.update(compare_gradients_to_float64(model, images, lambda m, x: m(x), torch.float32, device))
    failed = {name: report for name, report in reports.items() if not report.ok}
    assert not failed, failed


@pytest.mark.parametrize("device", device_params())
def test_model_compiles_with_fullgraph_on_the_native_backend(native_ops, device, monkeypatch):
    # cuDNN runs eager convolutions in TF32 by default and the compiled graph
    # may not; float32 on both sides makes the comparison meaningful.
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = VisualTokenizer(SMALL, backend="native", seed=0).to(device).eval()
    images = torch.randn(2, 3, 32, 48, device=device)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(images), model(images), rtol=1e-5, atol=1e-5)
