"""torch.ops.lumenbridge.tokenize, the whole tokenizer as one op: against the
float64 reference over the shared sample cases, on the CPU (composed kernels)
and CUDA (fused kernels), plus opcheck, compile, export, CUDA graphs,
poisoned outputs, determinism, weight changes and the gateway's checks.
The backward is tested in test_tokenize_backward.py."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.autograd.forward_ad as fwad
from conftest import HAS_CUDA

from lumenbridge import TokenizerConfig, VisualTokenizer, native
from lumenbridge.config import KERNEL_SIZES
from lumenbridge.testing import (
    BASE,
    NARROW,
    TokenizeCase,
    compare_to_float64,
    float64_model,
    many_tile_cases,
    tokenize_cases,
)

CASES = tokenize_cases()
cuda_only = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]


def run_op(model: VisualTokenizer, images: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return native.tokenize(images, model)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_cpu_op_matches_float64_reference(case, poisoned):
    model = case.model().to(torch.float32)
    images = case.images()
    out = run_op(model, images)
    report = compare_to_float64(model, images, out, torch.float32)
    assert torch.isfinite(out).all()
    assert report.error <= report.floor, report  # 1e-5 of the largest reference value


# Batches the CPU op runs in chunks of images: at 224 x 224 the base widths'
# stage-1 output is 4.8 MB an image in float32 (a chunk of one image), at
# 160 x 160 2.5 MB (chunks of up to three: seven images run as 2 + 2 + 2 + 1
# across two threads, 3 + 3 + 1 in turn).
CHUNKED_CASES = [
    dataclasses.replace(case, batch=5, size=(224, 224))
    for case in CASES
    if case.name in ("base", "base-float-channels-last", "base-k5-stride-1-second")
] + [
    TokenizeCase("base-160-seven", BASE, batch=7, size=(160, 160)),
    TokenizeCase(
        "layernorm-silu-nhwc-out",
        dataclasses.replace(BASE, activation="silu", stage_norm="layernorm", output_fmt="NHWC"),
        batch=5,
        size=(221, 203),
        channels_last=True,
        dynamic_pad=True,
    ),
]


@pytest.mark.parametrize("threads", [2, 8], ids=["chunks-across-threads", "chunks-in-turn"])
@pytest.mark.parametrize("case", CHUNKED_CASES, ids=lambda c: c.name)
def test_cpu_op_runs_a_large_batch_in_chunks(case, threads, poisoned):
    """Every chunk's tokens land in its own rows: with 2 threads (at least
    as many chunks as threads: each thread takes whole chunks) and with 8
    (more threads than chunks: the chunks in turn, each op over every
    thread)."""
    model = case.model()
    images = case.images()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = run_op(model, images)
    finally:
        torch.set_num_threads(before)
    assert torch.isfinite(out).all()
    report = compare_to_float64(model, images, out, torch.float32)
    assert report.error <= report.floor, report  # 1e-5 of the largest reference value


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["base", "no-token-norm", "k7", "relu-nchw-out"])
def test_the_half_type_rule_rejects_the_tokens_of_other_images(name, dtype):
    """The sample cases' tokens carry their images: PyTorch's own tokens of
    other images, in the same dtype, fail the rule the CUDA kernels must pass."""
    case = next(c for c in CASES if c.name == name)
    model = case.model().to(dtype)
    images, others = case.images(seed=0), case.images(seed=1)
    if images.is_floating_point():
        images, others = images.to(dtype), others.to(dtype)
    with torch.no_grad():
        wrong = model.forward_layers(others, "reference")
    report = compare_to_float64(model, images, wrong, dtype)
    assert not report.ok and report.error > 10 * report.limit, report


def test_the_float64_oracle_normalizes_with_the_exact_statistics():
    """The model's float32 buffers round the pixel statistics (123.675 ->
    123.67500305...); the oracle's must not, since the op uses the config's."""
    model, images = CASES[0].model(), CASES[0].images()
    model64 = float64_model(model).eval()
    config = model.config
    exact = (images.double() - torch.tensor(config.pixel_mean, dtype=torch.float64).view(1, -1, 1, 1)) / torch.tensor(
        config.pixel_std, dtype=torch.float64
    ).view(1, -1, 1, 1)
    with torch.no_grad():
        torch.testing.assert_close(
            model64.forward_layers(images, "reference"), model64.forward_layers(exact, "reference"), rtol=0, atol=0
        )


def assert_within_twice_pytorch_error(case, dtype: torch.dtype, device: str) -> None:
    """The op on `case` in `dtype` (outputs poisoned by the caller's fixture):
    every element written, and within the tolerance rule of float64."""
    model = case.model().to(device, dtype)
    images = case.images().to(device)
    images = images if images.dtype == torch.uint8 else images.to(dtype)
    out = run_op(model, images)
    assert torch.isfinite(out).all(), "an output element was not written (poison survived)"
    report = compare_to_float64(model, images, out, dtype)
    assert report.ok, report


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=cuda_only)])
def test_cuda_op_within_twice_pytorch_error(case, dtype, device, cuda_kernels, poisoned):
    assert_within_twice_pytorch_error(case, dtype, device)


@pytest.mark.parametrize("tf32", [True, False], ids=["tf32", "full-fp32"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=cuda_only)])
def test_cuda_float32_honours_the_tf32_switch(tf32, device, cuda_kernels, poisoned, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", tf32)
    case = CASES[1]
    model = case.model().to(device)
    images = case.images().to(device)
    out = run_op(model, images)
    report = compare_to_float64(model, images, out, torch.float32)
    if tf32:
        assert report.ok, report
    else:
        assert report.error <= report.floor, report  # 1e-5 of the largest reference value


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", many_tile_cases(), ids=lambda c: c.name)
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=cuda_only)])
def test_cuda_blocks_that_walk_many_tiles(case, dtype, device, cuda_kernels, poisoned):
    assert native.tokenize_path(device, case.config, dtype) == "fused"
    assert_within_twice_pytorch_error(case, dtype, device)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=cuda_only)])
def test_fused_path_covers_every_preset_on_cuda(device, native_ops):
    for name in ("lumenbridge-small", "lumenbridge-base", "lumenbridge-large"):
        for dtype in (torch.bfloat16, torch.float16):
            assert native.tokenize_path(device, TokenizerConfig.preset(name), dtype) == "fused", (name, dtype)


def test_model_uses_the_op_for_inference(native_ops, monkeypatch):
    calls = []
    monkeypatch.setattr(
        native, "tokenize", lambda images, model: calls.append(1) or model.forward_layers(images, "native")
    )
    model = VisualTokenizer(NARROW, seed=0, backend="native").eval()
    images = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8)
    with torch.no_grad():
        model(images)
    with torch.inference_mode():
        model(images)
    assert len(calls) == 2  # training: test_tokenize_backward.py


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda_only)])
def test_opcheck(device, native_ops):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    for case in (CASES[0], CASES[7], CASES[13]):
        model = case.model().to(device, dtype)
        images = case.images().to(device)
        args = _detached(native.tokenize_arguments(images, model))
        torch.library.opcheck(torch.ops.lumenbridge.tokenize.default, args)


def _detached(args):
    def detach(a):
        if isinstance(a, torch.Tensor):
            return a.detach()
        return [detach(x) for x in a] if isinstance(a, list) else a

    return tuple(detach(a) for a in args)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda_only)])
def test_compile_fullgraph_and_export(device, native_ops):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = VisualTokenizer(NARROW, seed=0, backend="native").to(device, dtype).eval()
    images = torch.randint(0, 256, (2, 3, 32, 48), dtype=torch.uint8, device=device)
    with torch.no_grad():
        expected = model(images)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        torch.testing.assert_close(compiled(images), expected, rtol=0, atol=0)
        exported = torch.export.export(model, (images,))
        assert any("lumenbridge.tokenize" in str(node.target) for node in exported.graph.nodes)
        torch.testing.assert_close(exported.module()(images), expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("device", "dtype"), [("cpu", torch.float32), pytest.param("cuda", torch.bfloat16, marks=cuda_only)]
)
def test_export_with_a_dynamic_image_size(device, dtype, native_ops):
    """padded_size is SymInt[2]: one exported program takes other image sizes."""
    model = VisualTokenizer(NARROW, seed=0, backend="native").to(device, dtype).eval()
    side = torch.export.Dim("side", min=1, max=64)
    height, width = 16 * side, 16 * torch.export.Dim("columns", min=1, max=64)
    with torch.no_grad():
        example = torch.randn(2, 3, 32, 48, device=device, dtype=dtype)
        exported = torch.export.export(model, (example,), dynamic_shapes=({2: height, 3: width},))
        assert any("lumenbridge.tokenize" in str(node.target) for node in exported.graph.nodes)
        images = torch.randn(2, 3, 64, 80, device=device, dtype=dtype)
        torch.testing.assert_close(exported.module()(images), model(images), rtol=0, atol=0)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=cuda_only)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["fused-bf16", "composed-fp32"])
def test_cuda_graph_capture_and_reduce_overhead(device, dtype, cuda_kernels):
    """Both CUDA paths from uint8 images: the composed one's normalization
    must not copy from host memory, which a capture refuses."""
    model = VisualTokenizer(BASE, seed=0).to(device, dtype).eval()
    images = torch.randint(0, 256, (2, 3, 224, 224), dtype=torch.uint8, device=device)
    with torch.inference_mode():
        expected = model(images)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model(images)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = model(images)
        fresh = torch.randint(0, 256, images.shape, dtype=torch.uint8, device=device)
        images.copy_(fresh)
        graph.replay()
        torch.testing.assert_close(captured, model(fresh), rtol=0, atol=0)
        assert not torch.equal(captured, expected)
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.inference_mode():
        for _ in range(3):
            out = compiled(fresh)
        torch.testing.assert_close(out, model(fresh), rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda_only)])
def test_bitwise_deterministic(device, native_ops):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = CASES[1].model().to(device, dtype)
    images = CASES[1].images().to(device)
    first = run_op(model, images)
    for _ in range(3):
        assert torch.equal(run_op(model, images), first)


FRESH_PROCESS_TOKENS = """
import torch
from lumenbridge import VisualTokenizer
model = VisualTokenizer(seed=0, backend="native").eval()
images = torch.randint(0, 256, (8, 3, 224, 224), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
with torch.inference_mode():
    first, second = model(images), model(images)
assert torch.get_num_threads() == 2, torch.get_num_threads()
print((first - second).abs().max().item())
"""


def test_a_fresh_process_gives_the_tokens_of_a_warm_one(native_ops):
    """The CPU op's first call in a process, its batch in one-image chunks
    over two threads, gives the tokens every later call gives. A pool
    thread's first chunk once saw one thread where the caller saw two, and
    oneDNN's convolutions then summed in another order: a resumed run's
    shards differed from the uninterrupted run's by rounding. The thread
    count comes from the environment, not torch.set_num_threads, which hid it."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS_TOKENS], check=False, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.split()[-1]) == 0.0, f"the first call's tokens differ from the second's by {done.stdout}"


@pytest.mark.parametrize("uint8", [True, False], ids=["uint8", "float"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda_only)])
def test_images_off_alignment_give_the_same_tokens(uint8, channels_last, device, native_ops):
    """A view that starts one element past a 16-byte boundary (where kernels
    read 16 bytes at a time) gives the tokens of its aligned copy."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = VisualTokenizer(NARROW).to(device, dtype)
    images = torch.randint(0, 256, (2, 3, 48, 80), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    images = images.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    images = images.to(device) if uint8 else images.to(device, dtype)
    storage = torch.zeros(images.numel() + 1, dtype=images.dtype, device=device)
    shifted = storage[1:].as_strided(images.shape, images.stride())
    shifted.copy_(images)
    assert shifted.data_ptr() % 16 != 0
    assert torch.equal(run_op(model, shifted), run_op(model, images))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda_only)])
def test_changed_parameters_change_the_tokens(device, native_ops, tmp_path):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = VisualTokenizer(NARROW, seed=0).to(device, dtype).eval()
    images = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8, device=device)
    before = run_op(model, images)
    with torch.no_grad():
        model.stages[2].pw.weight.mul_(1.5)  # in place
    after_inplace = run_op(model, images)
    assert not torch.equal(after_inplace, before)
    model.save_pretrained(tmp_path)
    other = VisualTokenizer(NARROW, seed=1).to(device, dtype).eval()
    assert not torch.equal(run_op(other, images), after_inplace)
    other.load_state_dict(VisualTokenizer.from_pretrained(tmp_path).state_dict())
    torch.testing.assert_close(run_op(other, images), after_inplace, rtol=0, atol=0)
    moved = copy.deepcopy(model).to(torch.float64 if device == "cpu" else torch.float16)
    assert run_op(moved, images).dtype == moved.stages[0].dw.weight.dtype


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda_only)])
def test_an_empty_batch_gives_no_tokens(device, native_ops):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = VisualTokenizer(BASE, seed=0).to(device, dtype).eval()
    images = torch.zeros((0, 3, 64, 64), dtype=torch.uint8, device=device)
    tokens = run_op(model, images)
    assert tokens.shape == (0, 16, 768) and tokens.dtype == dtype  # 4 x 4 tokens per image


class _Halve(torch.nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight / 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda_only)])
def test_replaced_and_parametrized_weights_reach_the_op(device, native_ops):
    """The op takes each parameter as the module exposes it: one replaced by
    assignment, and a parametrized one (computed when read)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = VisualTokenizer(NARROW, seed=0).to(device, dtype).eval()
    images = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8, device=device)
    before = run_op(model, images)
    pw = model.stages[1].pw
    pw.weight = torch.nn.Parameter(pw.weight.detach() * 2)
    assert not torch.equal(run_op(model, images), before)
    torch.nn.utils.parametrize.register_parametrization(pw, "weight", _Halve())
    torch.testing.assert_close(run_op(model, images), before, rtol=0, atol=0)  # (2 w) / 2 is w exactly


def test_a_weight_its_class_computes_reaches_the_op(native_ops):
    """A module whose class defines `weight` (a property, as class-swapping
    wrappers do) while the raw parameter stays registered: the op takes the
    attribute, not the table entry."""
    model = VisualTokenizer(NARROW, seed=0).eval()
    images = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8)
    before = run_op(model, images)
    pw = model.stages[1].pw
    zeroed = property(lambda self: torch.zeros_like(self._parameters["weight"]))
    pw.__class__ = type("ZeroedWeightConv", (type(pw),), {"weight": zeroed})
    assert not torch.equal(run_op(model, images), before)


def _edit_act(model):
    model.act = torch.nn.ReLU()


def _edit_token_norm_eps(model):
    model.token_norm.eps = 0.1


def _drop_token_norm_affine(model):
    model.token_norm = torch.nn.LayerNorm(model.config.embed_dim, elementwise_affine=False)


def _drop_token_norm(model):
    model.token_norm = torch.nn.Identity()


def _edit_stage_norm_eps(model):
    model.stages[2].norm.eps = 0.5


def _add_stage_norm(model):
    model.stages[1].norm = torch.nn.BatchNorm2d(model.config.stage_widths[1]).eval()
    model.stages[1].norm.running_var.fill_(4.0)


def _edit_batchnorm_eps(model):
    model.stages[2].norm.eps = 0.5


# The stage norm of the config each edit applies to (the rest: NARROW's, none).
EDITED_STAGE_NORM = {_edit_stage_norm_eps: "layernorm", _edit_batchnorm_eps: "batchnorm"}


@pytest.mark.parametrize(
    "edit",
    [
        _edit_act,
        _edit_token_norm_eps,
        _drop_token_norm_affine,
        _drop_token_norm,
        _edit_stage_norm_eps,
        _add_stage_norm,
        _edit_batchnorm_eps,
    ],
    ids=lambda edit: edit.__name__.strip("_"),
)
def test_edited_modules_run_layer_by_layer_and_say_so(native_ops, edit, caplog):
    """The op takes the architecture from the config: a model whose activation
    or norms were replaced, added or changed runs layer by layer (one log line
    says why), giving the reference's tokens, not the config's."""
    config = dataclasses.replace(NARROW, stage_norm=EDITED_STAGE_NORM.get(edit, NARROW.stage_norm))
    native_model = VisualTokenizer(config, seed=0, backend="native").eval()
    reference_model = VisualTokenizer(config, seed=0, backend="reference").eval()
    for model in (native_model, reference_model):
        with torch.no_grad():  # away from 1 and 0, so that a norm without them differs
            model.token_norm.weight.copy_(torch.linspace(0.5, 1.5, config.embed_dim))
            model.token_norm.bias.copy_(torch.linspace(-0.3, 0.3, config.embed_dim))
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    with torch.inference_mode():
        unedited = native_model(images)
        edit(native_model)
        edit(reference_model)
        with caplog.at_level("WARNING", logger="lumenbridge"):
            tokens = native_model(images)
        want = reference_model(images)
    assert native_model.edited_module() is not None
    assert "runs layer by layer" in caplog.text
    torch.testing.assert_close(tokens, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(tokens, unedited, rtol=1e-3, atol=1e-3)


def test_an_edited_stride_runs_layer_by_layer_and_is_not_saved(native_ops, tmp_path):
    """The layers take a depthwise convolution's stride from the module, the op
    from the config: a changed stride runs layer by layer, as the reference."""
    native_model = VisualTokenizer(NARROW, seed=0, backend="native").eval()
    reference_model = VisualTokenizer(NARROW, seed=0, backend="reference").eval()
    for model in (native_model, reference_model):
        model.stages[1].dw.stride = (1, 1)
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    with torch.inference_mode():
        tokens = native_model(images)
        want = reference_model(images)
    assert tokens.shape == want.shape == (2, 16, NARROW.embed_dim)  # a 4 x 4 grid: total stride 8
    torch.testing.assert_close(tokens, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"stage 1's depthwise stride is \(1, 1\), not the config's 2"):
        native_model.save_pretrained(tmp_path / "out")


def test_a_convolution_without_bias_is_a_clear_error(native_ops):
    model = VisualTokenizer(NARROW, seed=0, backend="native").eval()
    model.stages[1].dw.bias = None
    with pytest.raises(ValueError, match="stage 1 has a convolution without a bias"):
        model(torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8))


def test_import_registers_every_op_of_a_built_extension(native_ops):
    """A fresh process that imports torch, then lumenbridge, finds the ops with
    their fakes: tracing tokenize under FakeTensorMode needs the Python fake."""
    script = (
        "import torch, lumenbridge\n"
        "from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "ops = torch.ops.lumenbridge\n"
        "assert all(hasattr(ops, n) for n in ('tokenize', 'depthwise_conv2d', 'depthwise_conv2d_backward_input'))\n"
        "with FakeTensorMode():\n"
        "    d = ops.depthwise_conv2d(torch.empty(1, 4, 8, 8), torch.empty(4, 1, 3, 3), None, 2)\n"
        "print(tuple(d.shape))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith("(1, 4, 4, 4)")
    assert "compiling" not in run.stderr


# ---- the gateway's checks -------------------------------------------------------


def _arguments(**changes):
    model = VisualTokenizer(NARROW, seed=0).eval()
    images = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8)
    args = {
        "images": images,
        "dw_weights": [s.dw.weight.detach() for s in model.stages],
        "dw_biases": [s.dw.bias.detach() for s in model.stages],
        "pw_weights": [s.pw.weight.detach() for s in model.stages],
        "pw_biases": [s.pw.bias.detach() for s in model.stages],
        "strides": list(NARROW.strides),
        "activation": "gelu",
        "stage_norm": "none",
        "norm_weights": [],
        "norm_biases": [],
        "token_norm_weight": model.token_norm.weight.detach(),
        "token_norm_bias": model.token_norm.bias.detach(),
        "eps": 1e-5,
        "mean": [120.0, 115.0, 100.0],
        "std": [58.0, 57.0, 57.0],
        "padded_size": [32, 32],
        "output_fmt": "NLC",
    }
    args.update(changes)
    return args


def _widen(tensors, index, tensor):
    tensors = list(tensors)
    tensors[index] = tensor
    return tensors


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {"dw_weights": []}, "at least one stage"),
        (lambda a: {"strides": [2, 2, 2]}, "one entry per stage"),
        (lambda a: {"images": a["images"][0]}, "images must be 4-D"),
        (lambda a: {"images": a["images"].to(torch.int32)}, "images must be uint8"),
        (lambda a: {"images": torch.zeros(1, 4, 32, 32, dtype=torch.uint8)}, r"stage 0 dw_weight must have shape \[4"),
        (lambda a: {"strides": [2, 3, 2, 2]}, "stride must be 1 or 2"),
        (lambda a: {"dw_weights": _widen(a["dw_weights"], 1, torch.zeros(12, 1, 5, 5))}, "stage 1 dw_weight"),
        (lambda a: {"dw_weights": [torch.zeros(3, 1, 4, 4)] + a["dw_weights"][1:]}, "kernel_size must be one of"),
        (lambda a: {"pw_weights": _widen(a["pw_weights"], 2, torch.zeros(36, 21, 1, 1))}, "stage 2 pw_weight"),
        (
            lambda a: {"pw_biases": _widen(a["pw_biases"], 3, torch.zeros(39))},
            r"stage 3 pw_bias must have shape \[40\]",
        ),
        (lambda a: {"dw_biases": _widen(a["dw_biases"], 0, torch.zeros(3, dtype=torch.float64))}, "dtype"),
        (lambda a: {"pw_weights": _widen(a["pw_weights"], 0, torch.zeros(12, 6, 1, 1)[:, ::2])}, "contiguous"),
        (lambda a: {"activation": "tanh"}, "activation must be one of gelu, relu, silu, none"),
        (lambda a: {"stage_norm": "groupnorm"}, "stage_norm must be one of"),
        (lambda a: {"stage_norm": "layernorm"}, "needs 4 norm weights"),
        (lambda a: {"token_norm_bias": None}, "given together"),
        (lambda a: {"token_norm_weight": torch.ones(41)}, r"token_norm_weight must have shape \[40\]"),
        (lambda a: {"eps": 0.0}, "eps must be positive"),
        (lambda a: {"eps": -1e-9}, "eps must be positive in float32, got -1e-09"),
        (lambda a: {"eps": 1e-300}, "eps must be positive in float32, got 1e-300"),
        (lambda a: {"std": [1e-50, 1.0, 1.0]}, "channel 0's mean 120 and std 1e-50 do not normalize .* finite Float"),
        (lambda a: {"mean": [1e39, 0.0, 0.0]}, "channel 0's mean 1e\\+39 .* finite Float"),
        (lambda a: {"mean": [1.0, 2.0]}, "one entry per image channel"),
        (lambda a: {"std": [1.0, 0.0, 1.0]}, "std entries must be positive"),
        (lambda a: {"std": [1.0, float("inf"), 1.0]}, "std entries must be positive and finite"),
        (lambda a: {"mean": [1.0, float("nan"), 1.0]}, "mean entries must be finite"),
        (lambda a: {"padded_size": [31, 32]}, "padded_size must be"),
        (lambda a: {"padded_size": [2**31 - 65535, 32]}, "padded_size must be .* and at most 2147418111 each"),
        (lambda a: {"output_fmt": "NCL"}, "output_fmt must be one of NLC, NCHW, NHWC"),
        (lambda a: {"images": torch.randn(1, 3, 32, 32, dtype=torch.float64)}, "parameters' dtype"),
    ],
)
@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta: the fake kernel runs the gateway's checks
def test_gateway_rejects_bad_arguments(change, message, device, native_ops):
    args = _arguments()
    args.update(change(args))
    with pytest.raises(RuntimeError, match=f"LumenBridge: .*{message}"):
        native_ops.tokenize(**{name: _on(device, value) for name, value in args.items()})


def _on(device: str, value):
    """An argument of the op on device (tensors, and lists of them), with its
    strides: a tensor elsewhere becomes an empty one of the same layout
    (meta tensors hold no values)."""
    if isinstance(value, torch.Tensor):
        return (
            value
            if value.device.type == device
            else value.new_empty_strided(value.shape, value.stride(), device=device)
        )
    if isinstance(value, list):
        return [_on(device, v) for v in value]
    return value


def test_half_parameters_bound_the_statistics_by_their_range(native_ops):
    """uint8 images are normalized in the parameters' dtype: float16 cannot
    hold 255 / 1e-3, though float32 can."""
    args = _arguments(std=[1e-3, 57.0, 57.0])
    assert torch.isfinite(native_ops.tokenize(**args)).all()
    for key in ("dw_weights", "dw_biases", "pw_weights", "pw_biases"):
        args[key] = [t.half() for t in args[key]]
    args["token_norm_weight"], args["token_norm_bias"] = (
        args["token_norm_weight"].half(),
        args["token_norm_bias"].half(),
    )
    with pytest.raises(RuntimeError, match="LumenBridge: channel 0's mean 120 and std 0.001 do not normalize"):
        native_ops.tokenize(**args)


def test_images_in_another_layout_are_made_dense_by_the_op(native_ops):
    """A permuted view (an exported program's input, say, which no stride
    guard densifies) gives the tokens of its dense copy."""
    args = _arguments(images=torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8).transpose(2, 3))
    assert not args["images"].is_contiguous() and not args["images"].is_contiguous(memory_format=torch.channels_last)
    got = native_ops.tokenize(**args)
    args["images"] = args["images"].contiguous()
    torch.testing.assert_close(got, native_ops.tokenize(**args), rtol=0, atol=0)


def test_an_exported_model_takes_images_in_another_layout(native_ops):
    model = VisualTokenizer(NARROW, seed=0, backend="native").eval()
    with torch.no_grad():
        exported = torch.export.export(model, (torch.randn(2, 3, 32, 32),))
        images = torch.randn(2, 3, 32, 32).transpose(2, 3)
        torch.testing.assert_close(exported.module()(images), model(images), rtol=0, atol=0)


def test_forward_mode_ad_is_refused_not_dropped(native_ops):
    """The native ops have no forward-mode formula; a tangent would pass
    through them lost (zero), so the gateway refuses it."""
    model = VisualTokenizer(NARROW, seed=0, backend="native").eval()
    images = torch.randn(1, 3, 32, 32)
    with pytest.raises(RuntimeError, match="LumenBridge: an argument carries a forward-mode AD tangent"):
        torch.func.jvp(model, (images,), (torch.randn_like(images),))
    weight = torch.randn(3, 1, 3, 3)
    with (
        fwad.dual_level(),
        pytest.raises(RuntimeError, match="LumenBridge: an argument carries a forward-mode AD tangent"),
    ):
        native_ops.depthwise_conv2d(fwad.make_dual(images, torch.randn_like(images)), weight, None, 1)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=cuda_only)])
def test_gateway_rejects_mixed_devices(device, native_ops):
    args = _arguments()
    args["pw_weights"] = _widen(args["pw_weights"], 1, args["pw_weights"][1].to(device))
    with pytest.raises(RuntimeError, match="LumenBridge: stage 1 pw_weight is on cuda"):
        native_ops.tokenize(**args)


def test_sample_cases_cover_what_the_issue_lists():
    configs = [c.config for c in CASES]
    assert {c.kernel_size for c in configs} == set(KERNEL_SIZES)
    assert {c.activation for c in configs} == {"gelu", "relu", "silu", "none"}
    assert {c.output_fmt for c in configs} == {"NLC", "NCHW", "NHWC"}
    assert {c.stage_norm for c in configs} == {"none", "layernorm", "batchnorm"}
    assert {c.token_norm for c in configs} == {True, False}
    assert {c.uint8 for c in CASES} == {True, False} and {c.channels_last for c in CASES} == {True, False}
    assert {1, 3, 64} <= {c.batch for c in CASES}
    assert any(c.dynamic_pad for c in CASES)
    assert any(w % 16 for c in configs for w in c.stage_widths)
    assert dataclasses.replace(NARROW, strides=(2, 1, 2, 2)) in configs
    # First-kernel tiles (8 x 8 stage-2 outputs) of one case: more than the
    # 264 blocks an H200 keeps resident, so they run in more than one wave.
    first_tiles = max(
        c.batch * -(-c.size[0] // 32) * -(-c.size[1] // 32) for c in CASES if c.config.strides[:2] == (2, 2)
    )
    assert first_tiles > 2 * 132


def test_meta_and_cpu_tensors_in_one_call_are_refused(native_ops):
    """A 'meta' argument sends the call to the fake kernels, which check the
    devices as the gateway does rather than return an uninitialized tensor."""
    model = VisualTokenizer(NARROW, seed=0).eval()
    args = list(native.tokenize_arguments(torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8), model))
    args[0] = args[0].to("meta")
    with pytest.raises(RuntimeError, match="LumenBridge: .*all tensors must be on the same device"):
        torch.ops.lumenbridge.tokenize(*args)
    weight = torch.randn(4, 1, 3, 3)
    with pytest.raises(RuntimeError, match="all tensors must be on the same device"):
        torch.ops.lumenbridge.depthwise_conv2d(torch.randn(1, 4, 8, 8, device="meta"), weight, None, 2)
