"""The backward of torch.ops.lumenbridge.tokenize and tokenize_for_training
(the op tokenize_backward): gradients against float64 autograd of the
reference over the shared sample cases, gradcheck, opcheck, determinism, what
autograd saves (tokenize_for_training's depthwise rows and stage outputs
checked against the reference), double backward, the gateway's checks, autocast with GradScaler,
torch.compile, and the model using the op for training."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import warnings

import pytest
import torch
from conftest import HAS_CUDA, device_params
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from lumenbridge import VisualTokenizer, dispatch, native
from lumenbridge.testing import (
    NARROW,
    ROUNDING_FLOOR,
    TokenizeCase,
    compare_gradients_to_float64,
    compare_to_float64,
    exactly_normalized,
    float64_model,
    tensor_report,
    tokenize_cases,
)

CASES = tokenize_cases()
cuda_only = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
TINY = dataclasses.replace(NARROW, embed_dim=6, stage_widths=(4, 6), strides=(2, 2))


def op(model, images):
    """The model's op call: tokenize_for_training wherever a gradient is needed."""
    return native.tokenize(images, model)


def case_named(name):
    return next(c for c in CASES if c.name == name)


def assert_within(reports):
    failed = {name: report for name, report in reports.items() if not report.ok}
    assert not failed, failed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("device", device_params())
def test_gradients_within_twice_pytorch_error(case, dtype, device, native_ops, request):
    """Image gradients within 2x, parameter gradients within 3x the error of
    PyTorch's own autograd in the same dtype, plus the dtype's rounding floor."""
    if device == "cuda":
        request.getfixturevalue("cuda_kernels")
    assert_within(compare_gradients_to_float64(case.model(), case.images(), op, dtype, device))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["relu-nchw-out", "small"])
def test_the_gradient_rule_takes_exact_normalization_as_pytorchs_own(name, dtype):
    """PyTorch's reference on the images normalized exactly and rounded once
    (nearly as the fused CUDA kernels normalize) passes the rule: with ReLU, its
    stage-2 gradients in float16 are 24-64x those of the reference's own
    normalization, a unit in the last place flipping near-zero masks."""
    case = case_named(name)
    model64 = float64_model(case.model())

    def exactly(model, images):
        return model.forward_layers(exactly_normalized(model64, images, model.pixel_mean.dtype, "cpu"), "reference")

    assert_within(compare_gradients_to_float64(case.model(), case.images(), exactly, dtype, "cpu"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["relu-nchw-out", "small"])
def test_the_gradient_rule_rejects_the_gradients_of_other_images(name, dtype):
    """Taking the larger of two roundings as PyTorch's error leaves the rule
    able to fail: PyTorch's own gradients from other images fail it (all but
    the token norm's bias, whose gradient is the cotangent's sum whatever the
    images)."""
    case = case_named(name)
    others = case.images(seed=1)

    def other_images(model, images):
        return model.forward_layers(others, "reference")

    reports = compare_gradients_to_float64(case.model(), case.images(seed=0), other_images, dtype, "cpu")
    assert reports.pop("token_norm.bias").ok
    assert all(not report.ok for report in reports.values()), reports


@pytest.mark.parametrize("stage_norm", ["none", "layernorm"])
@pytest.mark.parametrize("channels", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("device", device_params())
def test_gradients_for_other_image_channel_counts(channels, stage_norm, device, native_ops, request):
    """The images' stage's narrow rows, read by its pointwise backward and by
    the second stage's depthwise backward (as that stage's input times the
    pointwise terms): on CUDA, for up to three image channels (four terms),
    one kernel that takes both (the pointwise backward folded into the
    depthwise one), the composed GEMMs for more; within the rule either way.
    A first width of 48 (the fold's 32-channel slabs, the second half empty)
    and 12 x 20 first-stage pixels an image (tiles of 16 x 16 pixels part
    empty). With
    stage norms the second stage reads its input, not the rows, and the
    images' stage's pointwise backward is the narrow kernel of its own (a
    multiple of 16 channels, 64-row tiles, the last one part empty)."""
    if device == "cuda":
        request.getfixturevalue("cuda_kernels")
    config = dataclasses.replace(
        NARROW,
        in_chans=channels,
        mean=(0.45,) * channels,
        std=(0.25,) * channels,
        embed_dim=24,
        stage_widths=(48, 24),
        strides=(2, 2),
        stage_norm=stage_norm,
    )
    images = torch.randint(0, 256, (2, channels, 24, 40), dtype=torch.uint8)
    model = VisualTokenizer(config, seed=0)
    assert_within(compare_gradients_to_float64(model, images, op, torch.bfloat16, device))


def plain_op(model, images):
    """The op that saves nothing: its backward recomputes the whole forward
    (on CUDA each later stage's depthwise gradient may take the memory of its
    input, the only reference the stage loop holds)."""
    return torch.ops.lumenbridge.tokenize(*native.tokenize_arguments(images, model))


@pytest.mark.parametrize("kernel_size", [3, 5])
@pytest.mark.parametrize("device", device_params())
def test_gradients_of_the_op_that_saves_nothing(kernel_size, device, native_ops, request):
    if device == "cuda":
        request.getfixturevalue("cuda_kernels")
    model = VisualTokenizer(dataclasses.replace(NARROW, kernel_size=kernel_size), seed=0)
    images = torch.randn(2, 3, 48, 40)
    for dtype in (torch.float32, torch.bfloat16):
        assert_within(compare_gradients_to_float64(model, images, plain_op, dtype, device))


@pytest.mark.parametrize(
    "widths",
    [(16,), (4, 8, 16), (16, 4, 8, 16)],
    ids=["one-stage", "narrow-first-stage", "narrow-middle-stage"],
)
@pytest.mark.parametrize("device", device_params())
def test_gradients_with_one_stage_or_a_narrow_stage(widths, device, native_ops, request):
    """What tokenize_for_training saves for one stage (its rows, no output),
    and for a stage of fewer than 8 channels after the first (its output
    saved, though the next stage's backward would read its rows)."""
    if device == "cuda":
        request.getfixturevalue("cuda_kernels")
    config = dataclasses.replace(NARROW, embed_dim=widths[-1], stage_widths=widths, strides=(2,) * len(widths))
    model = VisualTokenizer(config, seed=0)
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        assert_within(compare_gradients_to_float64(model, images, op, dtype, device))


def floating_tensors(args):
    """tokenize's floating tensor arguments, flat, and how to put others in their place."""
    leaves, spec = pytree.tree_flatten(args)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]

    def rebuild(tensors):
        new = list(leaves)
        for position, tensor in zip(positions, tensors, strict=True):
            new[position] = tensor
        return pytree.tree_unflatten(new, spec)

    return [leaves[i] for i in positions], rebuild


def detached(args, requires_grad=False):
    tensors, rebuild = floating_tensors(args)
    return rebuild([t.detach().requires_grad_(requires_grad) for t in tensors])


@pytest.mark.parametrize(
    "config, images",
    [
        (dataclasses.replace(TINY, stage_norm="layernorm"), torch.randn(2, 3, 8, 8)),
        (dataclasses.replace(TINY, activation="silu", output_fmt="NCHW"), torch.randn(1, 3, 8, 12)),
        (
            dataclasses.replace(TINY, stage_norm="batchnorm", token_norm=False, output_fmt="NHWC", kernel_size=5),
            torch.randn(2, 3, 7, 9).contiguous(memory_format=torch.channels_last),
        ),
    ],
    ids=["layernorm-stages", "silu-nchw-out", "affine-no-token-norm-padded-channels-last"],
)
@pytest.mark.parametrize(
    "call",
    [
        lambda *args: torch.ops.lumenbridge.tokenize(*args),
        lambda *args: torch.ops.lumenbridge.tokenize_for_training(*args)[0],
    ],
    ids=["tokenize", "tokenize_for_training"],
)
def test_gradcheck_in_float64(config, images, call, native_ops):
    model = VisualTokenizer(config, dynamic_pad=True, seed=0).double().eval()
    tensors, rebuild = floating_tensors(detached(native.tokenize_arguments(images.double(), model)))
    inputs = [t.requires_grad_(True) for t in tensors]
    assert torch.autograd.gradcheck(lambda *ts: call(*rebuild(ts)), inputs)


@pytest.mark.parametrize("device", device_params())
def test_opcheck(device, native_ops):
    """The backward op on its own (every output_mask, with and without saved
    rows), and the forward ops with inputs that need gradients, which traces
    the backward through its fake."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    lib = torch.ops.lumenbridge
    for name, mask, forward_too in (
        ("dynamic-pad-float", [True, True], True),
        ("layernorm-stages", [False, True], False),
        ("no-token-norm", [True, False], False),
        ("base", [False, True], True),
    ):
        case = case_named(name)
        model = case.model().to(device, dtype)
        args = detached(native.tokenize_arguments(case.images().to(device), model))
        tokens, rows, outputs = lib.tokenize_for_training(*args)
        grad = torch.randn_like(tokens)
        for saved in (([], []), (rows, outputs)):
            torch.library.opcheck(lib.tokenize_backward.default, (grad, *args, *saved, mask))
        if forward_too:
            for forward in (lib.tokenize.default, lib.tokenize_for_training.default):
                torch.library.opcheck(forward, detached(args, requires_grad=True))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_training_ops_fake_gives_its_shapes(case, native_ops):
    """tokenize_for_training's fake kernel against the op on every sample case
    (strides of 1, odd sizes, padding, two and three stages)."""
    args = native.tokenize_arguments(case.images(), case.model())
    tokens, rows, outputs = torch.ops.lumenbridge.tokenize_for_training(*args)
    with FakeTensorMode() as mode:
        fake_args = pytree.tree_map_only(torch.Tensor, mode.from_tensor, args)
        fake_tokens, fake_rows, fake_outputs = torch.ops.lumenbridge.tokenize_for_training(*fake_args)
    assert fake_tokens.shape == tokens.shape
    assert [t.shape for t in fake_rows] == [t.shape for t in rows]
    assert [t.shape for t in fake_outputs] == [t.shape for t in outputs]


def all_gradients(model, images):
    """Every parameter's gradient (and the images', when they need one) of one backward through the op."""
    model.zero_grad(set_to_none=True)
    images.grad = None
    tokens = native.tokenize(images, model)
    cotangent = torch.linspace(-1, 1, tokens.numel(), device=tokens.device, dtype=tokens.dtype).view_as(tokens)
    (tokens * cotangent).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return grads + ([images.grad.clone()] if images.requires_grad else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("device", device_params())
def test_gradients_are_bitwise_deterministic(device, dtype, native_ops):
    for name in ("base-float-channels-last", "layernorm-stages", "batch-64"):
        case = case_named(name)
        model = case.model().to(device, dtype)
        images = case.images().to(device)
        images = images if images.dtype == torch.uint8 else images.to(dtype).requires_grad_(True)
        first = all_gradients(model, images)
        for _ in range(2):
            again = all_gradients(model, images)
            assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True)), name


def saved_tensors(run):
    """The tensors autograd saves while run() builds its graph."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        run()
    return saved


@pytest.mark.parametrize("uint8", [True, False], ids=["uint8", "float"])
def test_what_the_forward_saves(uint8, native_ops):
    """tokenize saves its inputs alone; tokenize_for_training (the model's
    training call) also each stage's depthwise rows and the pointwise output
    of each stage after the first (the last's feeds the token norm's
    backward): for lumenbridge-base at 64 x 64, 32^2 x 8 + 16^2 x 104 + 8^2 x
    200 + 4^2 x 392 and 16^2 x 192 + 8^2 x 384 + 4^2 x 768 values an image
    (the README states the 224 x 224 figure), about a third (34%) of what
    eager autograd saves."""
    case = case_named("base")
    model = case.model()
    images = case.images() if uint8 else torch.randn(2, 3, 64, 64).requires_grad_(True)
    args = native.tokenize_arguments(images, model)
    parameters = {p.data_ptr() for p in model.parameters()}

    def activations(run):
        return [t for t in saved_tensors(run) if t.data_ptr() not in parameters]

    only_inputs = activations(lambda: torch.ops.lumenbridge.tokenize(*args))
    assert len(only_inputs) == 1 and only_inputs[0].data_ptr() == images.data_ptr()
    assert only_inputs[0].nbytes // len(images) == images[0].nbytes  # 3 x 64 x 64 bytes for uint8, 4x for float32

    training = activations(lambda: native.tokenize(images, model))
    assert training[0].data_ptr() == images.data_ptr()
    rows, outputs = training[1:5], training[5:]
    in_channels = (case.config.in_chans, *case.config.stage_widths[:-1])
    widths = [torch.ops.lumenbridge.depthwise_row_width(c) for c in in_channels]
    assert widths == [8, 104, 200, 392]
    assert [tuple(t.shape) for t in rows] == [(len(images) * s * s, w) for s, w in zip((32, 16, 8, 4), widths)]
    sides_and_widths = ((16, 192), (8, 384), (4, 768))
    assert [tuple(t.shape) for t in outputs] == [(len(images) * s * s, w) for s, w in sides_and_widths]
    saved_per_image = sum(t.nbytes for t in training[1:]) // len(images)
    rows_values = 32 * 32 * 8 + 16 * 16 * 104 + 8 * 8 * 200 + 4 * 4 * 392
    assert saved_per_image == (rows_values + 16 * 16 * 192 + 8 * 8 * 384 + 4 * 4 * 768) * 4
    eager = saved_tensors(lambda: model.forward_layers(images, "reference"))
    eager_per_image = sum(t.nbytes for t in eager if t.data_ptr() not in parameters) // len(images)
    assert saved_per_image < 0.35 * eager_per_image


class OpNames(TorchDispatchMode):
    """Records the name of every ATen op that runs under it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_what_is_saved_gets_no_materialized_gradient(native_ops):
    """Autograd hands tokenize_for_training's backward no zeros for what it
    saved (they would be as large as the saved tensors themselves)."""
    model = VisualTokenizer(NARROW, seed=0)
    tokens = native.tokenize(torch.randn(2, 3, 32, 32), model)
    with OpNames() as ops:
        tokens.sum().backward()
    assert not [name for name in ops.names if "zeros" in name or "fill" in name]
    assert all(p.grad is not None for p in model.parameters())


def stage_outputs(model, images):
    """Each stage's depthwise output and its pointwise output before the norm
    and the activation, [N, C, h, w] each, layer by layer through the reference."""
    inputs, pointwise = [], []
    hooks = [stage.register_forward_pre_hook(lambda _, args: inputs.append(args[0])) for stage in model.stages]
    hooks += [stage.norm.register_forward_pre_hook(lambda _, args: pointwise.append(args[0])) for stage in model.stages]
    try:
        with torch.no_grad():
            model.forward_layers(images, "reference")
    finally:
        for hook in hooks:
            hook.remove()
    depthwise = [
        torch.nn.functional.conv2d(x, s.dw.weight, s.dw.bias, s.dw.stride, s.dw.padding, groups=s.dw.groups)
        for x, s in zip(inputs, model.stages, strict=True)
    ]
    return depthwise, pointwise


def as_rows(x):
    """[N, C, h, w] as float64 rows [N * h * w, C] on the CPU."""
    return x.permute(0, 2, 3, 1).reshape(-1, x.shape[1]).cpu().double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("device", device_params())
def test_what_is_saved_holds_the_stages_depthwise_and_pointwise_outputs(case, dtype, device, poisoned, request):
    """Every element of what tokenize_for_training saves written (poisoned
    outputs): each stage's rows hold its depthwise output within 2x
    PyTorch's own error in the dtype against float64, then exactly a one and
    zeros; each saved output (of the stages after the first but the last,
    and of the last where a norm follows it) is the stage's pointwise output
    before the norm and activation, within the same rule; and the tokens too
    (and bitwise tokenize's where both run the fused kernels: saving changes
    nothing)."""
    if device == "cuda":
        request.getfixturevalue("cuda_kernels")
    model, images = case.model(), case.images()
    low = copy.deepcopy(model).to(device, dtype)
    low_images = images.to(device) if images.dtype == torch.uint8 else images.to(device, dtype)
    args = native.tokenize_arguments(low_images, low)
    with torch.no_grad():
        tokens, saved_rows, saved_outputs = torch.ops.lumenbridge.tokenize_for_training(*args)
        plain = torch.ops.lumenbridge.tokenize(*args)
    if device == "cuda" and native.tokenize_path(device, case.config, dtype) == "fused":
        assert torch.equal(tokens, plain)
    report = compare_to_float64(model, low_images, tokens, dtype)
    assert report.ok, report
    exact, exact_pointwise = stage_outputs(
        copy.deepcopy(model).double(), images if images.dtype == torch.uint8 else images.double()
    )
    pytorch, pytorch_pointwise = stage_outputs(low, low_images)
    stop = None if case.config.token_norm or case.config.stage_norm != "none" else -1
    assert len(saved_rows) == len(exact) and len(saved_outputs) == len(exact[1:stop])
    for output, p64, p in zip(saved_outputs, exact_pointwise[1:stop], pytorch_pointwise[1:stop], strict=True):
        flat64 = as_rows(p64)
        assert output.shape == flat64.shape
        report = tensor_report(output, flat64, as_rows(p), dtype)
        assert report.ok, (output.shape, report)
    for rows, d64, d in zip(saved_rows, exact, pytorch, strict=True):
        cin = d64.shape[1]
        flat64 = as_rows(d64)
        rows = rows.cpu().double()
        assert rows.shape == (len(flat64), torch.ops.lumenbridge.depthwise_row_width(cin))
        report = tensor_report(rows[:, :cin], flat64, as_rows(d), dtype)
        assert report.ok, (cin, report)
        assert torch.equal(rows[:, cin], torch.ones_like(rows[:, cin]))
        assert not rows[:, cin + 1 :].any()


def test_double_backward_raises_naming_the_op(native_ops):
    model = VisualTokenizer(TINY, seed=0)
    images = torch.randn(1, 3, 16, 16, requires_grad=True)
    tokens = native.tokenize(images, model)
    (grad,) = torch.autograd.grad(tokens.square().sum(), images, create_graph=True)
    with pytest.raises(RuntimeError, match="LumenBridge: lumenbridge::tokenize supports first-order gradients only"):
        grad.sum().backward()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {"grad_tokens": a["grad_tokens"][:, :-1]}, "grad_tokens has shape"),
        (lambda a: {"grad_tokens": a["grad_tokens"].double()}, "grad_tokens has dtype"),
        (lambda a: {"output_mask": [True, True]}, "uint8 images have no gradient"),
        (lambda a: {"activation": "tanh"}, "activation must be one of"),
        (
            lambda a: {"saved_rows": a["saved_rows"][1:]},
            r"saved_rows and saved_outputs must both be empty or hold 4 and 3 tensors .* got 3 and 3",
        ),
        (lambda a: {"saved_outputs": []}, r"must both be empty or hold 4 and 3 tensors .* got 4 and 0"),
        (
            lambda a: {"saved_rows": [a["saved_rows"][0][:-1], *a["saved_rows"][1:]]},
            r"saved_rows\[0\] must have shape \[256, 8\]",
        ),
        (
            lambda a: {"saved_rows": [a["saved_rows"][0], a["saved_rows"][1][:-1], *a["saved_rows"][2:]]},
            r"saved_rows\[1\] must have shape \[64, 16\]",
        ),
        (
            lambda a: {"saved_outputs": [a["saved_outputs"][0], a["saved_outputs"][1][:, :-1], a["saved_outputs"][2]]},
            r"saved_outputs\[1\] must have shape \[16, 36\]",
        ),
        (
            lambda a: {"saved_rows": [a["saved_rows"][0].double(), *a["saved_rows"][1:]]},
            r"saved_rows\[0\] has dtype Double",
        ),
        (
            lambda a: {"saved_outputs": [a["saved_outputs"][0].t().contiguous().t(), *a["saved_outputs"][1:]]},
            r"saved_outputs\[0\] must be contiguous",
        ),
    ],
)
def test_gateway_rejects_bad_backward_arguments(change, message, native_ops):
    args = narrow_backward_arguments("cpu")
    args.update(change(args))
    with pytest.raises(RuntimeError, match=f"LumenBridge: .*{message}"):
        native_ops.tokenize_backward(**args)


def test_without_a_norm_after_the_last_stage_its_output_is_not_saved_nor_expected(native_ops):
    args = narrow_backward_arguments("cpu", dataclasses.replace(NARROW, token_norm=False))
    assert [tuple(t.shape) for t in args["saved_outputs"]] == [(64, 20), (16, 36)]  # stages 1 and 2 of 4
    args["saved_outputs"] = [*args["saved_outputs"], args["saved_outputs"][-1]]
    with pytest.raises(RuntimeError, match=r"must both be empty or hold 4 and 2 tensors .* got 4 and 3"):
        native_ops.tokenize_backward(**args)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gateway_rejects_saved_tensors_on_another_device(cuda_kernels):
    args = narrow_backward_arguments("cuda")
    args["saved_outputs"][1] = args["saved_outputs"][1].cpu()
    with pytest.raises(RuntimeError, match=r"LumenBridge: saved_outputs\[1\] is on cpu but images is on cuda"):
        cuda_kernels.tokenize_backward(**args)


def narrow_backward_arguments(device: str, config=NARROW) -> dict:
    """tokenize_backward's arguments for `config` (NARROW) on one uint8 32 x
    32 image: tokenize's, a token gradient of ones, what
    tokenize_for_training saved, and the parameters' gradients asked for."""
    model = VisualTokenizer(config, seed=0).eval().to(device)
    images = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8, device=device)
    names = [a.name for a in torch.ops.lumenbridge.tokenize.default._schema.arguments]
    args = dict(zip(names, detached(native.tokenize_arguments(images, model)), strict=True))
    tokens, rows, outputs = torch.ops.lumenbridge.tokenize_for_training(**args)
    return {
        **args,
        "grad_tokens": torch.ones_like(tokens),
        "saved_rows": list(rows),
        "saved_outputs": list(outputs),
        "output_mask": [False, True],
    }


# ---- the model trains through the op ----------------------------------------------


def test_model_uses_the_op_for_training_except_batchnorm_statistics(native_ops, monkeypatch):
    calls, real = [], native.tokenize
    monkeypatch.setattr(native, "tokenize", lambda images, model: calls.append(1) or real(images, model))
    images = torch.randn(2, 3, 32, 32, requires_grad=True)
    model = VisualTokenizer(NARROW, seed=0, backend="native")
    model(images).sum().backward()
    assert len(calls) == 1 and images.grad is not None
    assert all(p.grad is not None for p in model.parameters())
    batchnorm = VisualTokenizer(dataclasses.replace(NARROW, stage_norm="batchnorm"), seed=0, backend="native")
    batchnorm(images).sum().backward()  # training-mode BatchNorm needs batch statistics: layer by layer
    assert len(calls) == 1
    batchnorm.eval()(images).sum().backward()
    assert len(calls) == 2


def test_each_batchnorm_follows_its_own_mode(native_ops):
    """model.eval() then a stage norm's train(), to adapt its statistics at
    test time: that norm uses and updates batch statistics, as the reference
    does; norms in eval mode in a training model keep their running ones."""
    images = torch.randn(4, 3, 32, 32)
    config = dataclasses.replace(NARROW, stage_norm="batchnorm")
    models = {name: VisualTokenizer(config, seed=0, backend=name).eval() for name in ("native", "reference")}
    for model in models.values():
        model.stages[1].norm.train()
    with torch.no_grad():
        tokens = {name: model(images) for name, model in models.items()}
    torch.testing.assert_close(tokens["native"], tokens["reference"])
    assert [int(m.stages[1].norm.num_batches_tracked) for m in models.values()] == [1, 1]
    frozen = VisualTokenizer(config, seed=0, backend="native").train()
    for stage in frozen.stages:
        stage.norm.eval()
    assert dispatch.NativeBackend.layer_reason(images, frozen) is None  # running statistics: the one op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("width", [248, 264, 1024, 1032])
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_token_norm_widths_around_the_layer_norm_kernels_limits(width, dtype, native_ops, cuda_kernels):
    """The CUDA LayerNorm backward's lanes hold up to 1,024 columns in 16-byte
    vectors (256 columns a warp-wide round in bf16, 128 in float): widths just
    below and above a round, its widest, and one past it (ATen's form), on
    four tokens, fewer rows than a block has warps."""
    config = dataclasses.replace(NARROW, embed_dim=width, stage_widths=(12, 20, 36, width))
    model = VisualTokenizer(config, seed=0)
    images = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8)
    assert_within(compare_gradients_to_float64(model, images, op, dtype, "cuda"))


@pytest.mark.parametrize("device", device_params())
def test_images_that_need_a_gradient_get_the_reference_gradient(device, native_ops, monkeypatch):
    """A frozen model and images that need a gradient: the images' gradient
    within float32's 1e-5 of the float64 reference's largest. (The weights
    keep the activations' scale: with PyTorch's default initialization this
    gradient is so small that half of it passed an absolute tolerance.)"""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # float32 on both sides
    frozen = TokenizeCase("frozen", NARROW, batch=2, size=(32, 48), uint8=False).model().requires_grad_(False)
    images = torch.randn(2, 3, 32, 48, requires_grad=True)
    reference = float64_model(frozen)
    wanted = images.detach().double().requires_grad_(True)
    reference.forward_layers(wanted, "reference").square().sum().backward()
    model = frozen.to(device)
    model.backend = "native"
    on_device = images.detach().to(device).requires_grad_(True)
    model(on_device).square().sum().backward()
    error = (on_device.grad.cpu().double() - wanted.grad).abs().max().item()
    assert error <= 1e-5 * wanted.grad.abs().max().item(), (error, wanted.grad.abs().max().item())


@pytest.mark.parametrize("device", device_params())
def test_autocast_runs_the_op_in_the_autocast_dtype_with_float32_gradients(device, native_ops):
    model = VisualTokenizer(NARROW, seed=0, backend="native").to(device)
    low = copy.deepcopy(model).to(torch.bfloat16)
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        tokens = model(images)
    expected = low(images)
    assert tokens.dtype == torch.bfloat16
    assert torch.equal(tokens, expected)  # the same op call on the cast parameters
    target = torch.randn_like(expected)
    (tokens * target).sum().backward()
    (expected * target).sum().backward()
    for p, q in zip(model.parameters(), low.parameters(), strict=True):
        assert p.grad.dtype == torch.float32
        assert torch.equal(p.grad, q.grad.float())


@pytest.mark.parametrize("device", device_params())
def test_autocast_casts_the_float32_parameters_together_and_leaves_other_dtypes_to_autocast(device, native_ops):
    """The float32 parameters reach the op through one cast node (one
    conversion each way); a parameter already in another dtype is cast on its
    own, and every parameter gets its gradient in its own dtype, equal to the
    cast model's."""
    model = VisualTokenizer(NARROW, seed=0, backend="native").to(device)
    model.stages[1].pw.to(torch.float16)  # a mix: one stage's pointwise in float16
    low = copy.deepcopy(model).to(torch.bfloat16)
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        tokens = model(images)
    expected = low(images)
    assert torch.equal(tokens, expected)
    casts = {edge[0].name() for edge in tokens.grad_fn.next_functions if edge[0] is not None}
    assert sum("CastTogether" in name for name in casts) == 1, casts
    target = torch.randn_like(expected)
    (tokens * target).sum().backward()
    (expected * target).sum().backward()
    for p, q in zip(model.parameters(), low.parameters(), strict=True):
        assert p.grad.dtype == p.dtype
        assert torch.equal(p.grad, q.grad.to(p.dtype))


class LumenBridgeArguments(TorchDispatchMode):
    """Records every tensor handed to a torch.ops.lumenbridge op under it."""

    def __init__(self):
        super().__init__()
        self.tensors = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "lumenbridge":
            self.tensors += [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", device_params())
def test_autocast_hands_the_op_16_byte_aligned_parameters(device, native_ops):
    """The parameters cast together are views of one buffer; each starts on a
    16-byte boundary (the kernels' vector paths need it), although the first
    stage's depthwise weight has an odd element count (3 x 3 x 3)."""
    model = VisualTokenizer(NARROW, seed=0, backend="native").to(device)
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, device=device)
    assert model.stages[0].dw.weight.numel() % 2 == 1
    with LumenBridgeArguments() as seen, torch.autocast(device, dtype=torch.bfloat16):
        model(images).sum().backward()
    cast = [t for t in seen.tensors if t.dtype == torch.bfloat16 and t.dim() > 0]
    assert len(cast) > len(list(model.parameters()))
    assert [t.shape for t in cast if t.data_ptr() % 16] == []
    assert all(p.grad.data_ptr() % 16 == 0 for p in model.parameters())


def disjoint_views_of_one_buffer(tensors: list[torch.Tensor], alignment: int) -> bool:
    """Whether the tensors share one storage, none overlapping another, each
    starting on a multiple of `alignment` bytes."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors)
    return (
        len({t.untyped_storage().data_ptr() for t in tensors}) == 1
        and all(start % alignment == 0 for start, _ in spans)
        and all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    )


@pytest.mark.parametrize("device", device_params())
def test_parameter_gradients_are_views_of_one_buffer(device, native_ops):
    """The backward hands autograd the parameters' gradients as views of one
    buffer, each on a 16-byte boundary, and autograd keeps them as they are:
    a step's `p.grad = None` then frees one block of memory, not one per
    parameter. Their values are those of the separate gradients (the
    gradient tests above)."""
    model = VisualTokenizer(NARROW, seed=0, backend="native").to(device)
    model(torch.randn(2, 3, 32, 32, device=device)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert [g.shape for g in grads] == [p.shape for p in model.parameters()]
    assert disjoint_views_of_one_buffer(grads, 16)


@pytest.mark.parametrize("device", device_params())
def test_autocast_packs_the_gradients_once(device, native_ops):
    """Under autocast the op gets the parameters' casts, whose backward makes
    the float32 gradients views of one buffer; the op's backward leaves its
    low-precision gradients separate rather than packing them first: one
    multi-tensor copy in the backward, not two."""
    model = VisualTokenizer(NARROW, seed=0, backend="native").to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        tokens = model(torch.randn(2, 3, 32, 32, device=device))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        tokens.float().sum().backward()
    assert [event.name for event in profile.events()].count("aten::_foreach_copy_") == 1
    grads = [p.grad for p in model.parameters()]
    assert {g.dtype for g in grads} == {torch.float32}
    assert disjoint_views_of_one_buffer(grads, 16)


# The loss scale of the float16 training tests, the GradScaler's and the float16 model's.
LOSS_SCALE = 2.0**10


def scaled_float16_step(model, images, target, device):
    """One GradScaler step under float16 autocast; the unscaled gradients, and whether the step was taken."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device, init_scale=LOSS_SCALE)
    with torch.autocast(device, dtype=torch.float16):
        tokens = model(images)
    # The op runs in the autocast dtype; PyTorch's own model returns float32
    # tokens from its LayerNorm, which autocast runs in float32 on CUDA.
    assert tokens.dtype == torch.float16 or model.backend == "reference"
    scaler.scale((tokens.float() * target).sum()).backward()
    scaler.unscale_(optimizer)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    # update() halves the scale after a step it skipped for non-finite
    # gradients, and keeps it otherwise. (Whether every parameter changed
    # would not tell: lr times a small gradient can be below a weight's ulp.)
    scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    return grads, scaler.get_scale() == scale


def float16_gradients(model, images, target):
    """A float16 model's parameter gradients of (tokens * target).sum(), the
    loss scaled by LOSS_SCALE and the gradients divided by it in float32, as
    a GradScaler does (which refuses float16 parameters)."""
    ((model(images).float() * target).sum() * LOSS_SCALE).backward()
    return {name: p.grad.float() / LOSS_SCALE for name, p in model.named_parameters()}


@pytest.mark.parametrize("device", device_params())
def test_grad_scaler_with_float16_autocast(device, native_ops):
    """The op's float16 gradients, unscaled, are within 3x PyTorch's error:
    the larger of its own model's under the same autocast and GradScaler and
    of that model in float16, the dtype the op computes in. The autocast
    model's alone depends on the CPU: where oneDNN has AVX512-FP16 and AMX it
    is more accurate (the second stage's pointwise bias gradient off by
    0.0049, against 0.0088 with oneDNN held to AVX512_CORE), while the op's
    was off by 0.0186 on both and the float16 model's by 0.0186 and 0.0181.
    Its own generator, so that the cases do not depend on the tests run
    before it."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, generator=generator).to(device)
    case = TokenizeCase("scaler", NARROW)  # weights that keep the activations' scale
    exact = float64_model(case.model())
    features = exact.forward_layers(images.cpu(), "reference")
    target = torch.randn(features.shape, dtype=torch.float64, generator=generator)
    (features * target).sum().backward()
    target = target.to(device, torch.float32)

    def model_on(backend: str) -> VisualTokenizer:
        model = case.model().to(device)
        model.backend = backend
        return model

    results = {
        backend: scaled_float16_step(model_on(backend), images, target, device) for backend in ("native", "reference")
    }
    float16_grads = float16_gradients(model_on("reference").half(), images, target)
    for name, q in exact.named_parameters():
        native_grad = results["native"][0][name]
        assert native_grad.dtype == torch.float32
        error, autocast_error, float16_error = (
            (g.cpu().double() - q.grad).abs().max().item()
            for g in (native_grad, results["reference"][0][name], float16_grads[name])
        )
        torch_error = max(autocast_error, float16_error)
        assert error <= 3 * torch_error + ROUNDING_FLOOR[torch.float16] * q.grad.abs().max().item(), name
    assert results["native"][1] and results["reference"][1]  # finite gradients: both steps were taken


@pytest.mark.parametrize("device", device_params())
def test_compiled_training_step_matches_eager(device, native_ops, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = VisualTokenizer(NARROW, seed=0, backend="native").to(device)
    compiled_model = copy.deepcopy(model)
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(images).square().sum().backward()
    # The compiled forward runs without warnings of LumenBridge's making (say, Dynamo tracing through a cache).
    assert not [w for w in caught if "lumenbridge" in str(w.filename) + str(w.message)], [
        str(w.message) for w in caught
    ]
    model(images).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=cuda_only)])
def test_the_wide_stages_depthwise_gradient_takes_no_memory_of_its_own(device, cuda_kernels):
    """lumenbridge-base's stage 2 (96 -> 192 channels at 56 x 56): the wide
    pointwise kernel writes the depthwise output's gradient g_d over its own
    input g, so the training backward never holds both. Its peak above what
    it held when it began stays below g + g_d, which it held together before
    (243 MB at this size). A GPU that gives a block too little shared memory
    for the wide kernel takes the composed GEMMs, and a g_d of its own."""
    batch, side = 128, 56
    model = VisualTokenizer(seed=0, backend="native").to(device, torch.bfloat16).train()
    images = torch.randint(0, 256, (batch, 3, 224, 224), dtype=torch.uint8, device=device)

    def backward_peak() -> int:
        model.zero_grad(set_to_none=True)
        tokens = model(images)
        grad_tokens = torch.randn_like(tokens)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
        tokens.backward(grad_tokens)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - held

    # The first backward also allocates cuBLAS's workspace.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        backward_peak()
    if not any("pointwise_backward_wide" in event.name for event in profile.events()):
        assert torch.cuda.get_device_capability() < (9, 0), "the wide pointwise kernel did not run on a Hopper GPU"
        pytest.skip("this GPU gives a block too little shared memory for the wide pointwise kernel")
    g = batch * side * side * 192 * 2
    g_d = batch * side * side * 96 * 2
    peak = backward_peak()
    assert peak < g + g_d, f"{peak / 1e6:.1f} MB above what the backward began with, g + g_d = {(g + g_d) / 1e6:.1f} MB"
