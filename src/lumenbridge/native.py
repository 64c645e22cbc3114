"""The Python half of torch.ops.lumenbridge: fake (meta) kernels, so that
torch.compile can trace the ops, and the depthwise ops' autograd formulas:
each of the three is another one's gradient, which gives gradients of any
order. tokenize's and tokenize_for_training's autograd kernels are in C++
(csrc/autograd.cpp), their backward the op tokenize_backward, first order
only (its autograd formula here raises). The C++ half (schemas, checks,
kernels, autocast, those autograd kernels) is in csrc/; extension.py builds
and loads it."""

from __future__ import annotations

import functools

import torch

from . import extension
from .layout import memory_format_of
from .shapes import grid_extent, output_extent, stage_extents

ops = torch.ops.lumenbridge


def _depthwise_conv2d_fake(input, weight, bias, stride):
    k = weight.shape[-1]
    n, c, h, w = input.shape
    shape = (n, c, output_extent(h, k, stride), output_extent(w, k, stride))
    return input.new_empty(shape).contiguous(memory_format=memory_format_of(input))


def _depthwise_conv2d_backward_input_fake(grad_output, weight, stride, input_size):
    n, c = grad_output.shape[:2]
    shape = (n, c, *input_size)
    return grad_output.new_empty(shape).contiguous(memory_format=memory_format_of(grad_output))


def _depthwise_conv2d_backward_weight_fake(grad_output, input, kernel_size, stride):
    c = input.shape[1]
    return input.new_empty((c, 1, kernel_size, kernel_size)), input.new_empty((c,))


def _symbolic(values) -> bool:
    """Whether any size or stride (or integer argument) is symbolic."""
    for value in values:
        if isinstance(value, torch.SymInt):
            return True
        if isinstance(value, torch.Tensor) and any(
            isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride())
        ):
            return True
    return False


def _checked(fake, check=None):
    """fake, first running the gateway's checks (`check`, the op's checks
    alone, where every size is known) or, with symbolic sizes, its device
    check: any argument on 'meta' sends a call to the fakes, so a bad call
    there would otherwise return a shape (or, mixing 'meta' and CPU tensors,
    an uninitialized tensor) instead of its error."""

    @functools.wraps(fake)
    def checked(*arguments):
        values = [v for a in arguments for v in (a if isinstance(a, (list, tuple)) else [a])]
        if check is not None and not _symbolic(values):
            check(*arguments)
            return fake(*arguments)
        devices = {v.device for v in values if isinstance(v, torch.Tensor)}
        if len(devices) > 1:
            raise RuntimeError(
                f"LumenBridge: the tensors are on {', '.join(sorted(map(str, devices)))}; "
                "all tensors must be on the same device"
            )
        return fake(*arguments)

    return checked


def _tokenize_fake(
    images,
    dw_weights,
    dw_biases,
    pw_weights,
    pw_biases,
    strides,
    activation,
    stage_norm,
    norm_weights,
    norm_biases,
    token_norm_weight,
    token_norm_bias,
    eps,
    mean,
    std,
    padded_size,
    output_fmt,
):
    k = dw_weights[0].shape[-1]
    n, d = images.shape[0], pw_weights[-1].shape[0]
    h, w = (grid_extent(extent, k, strides) for extent in padded_size)
    shape = {"NLC": (n, h * w, d), "NHWC": (n, h, w, d), "NCHW": (n, d, h, w)}[output_fmt]
    return dw_weights[0].new_empty(shape)


def _tokenize_for_training_fake(images, dw_weights, dw_biases, pw_weights, *args):
    """The tokens, each stage's depthwise rows [N * h * w, row width], then
    the pointwise output [N * h * w, Cout] of each stage after the first but
    the last, and of the last where a norm follows it."""
    tokens = _tokenize_fake(images, dw_weights, dw_biases, pw_weights, *args)
    strides, stage_norm, token_norm_weight, padded_size = args[1], args[3], args[6], args[11]
    saved_stop = None if token_norm_weight is not None or stage_norm != "none" else -1
    k, n = dw_weights[0].shape[-1], images.shape[0]
    pixels = [n * h * w for h, w in zip(*(stage_extents(e, k, strides) for e in padded_size), strict=True)]
    rows = [
        dw_weights[0].new_empty((m, ops.depthwise_row_width(weight.shape[0])))
        for weight, m in zip(dw_weights, pixels, strict=True)
    ]
    outputs = [
        dw_weights[0].new_empty((m, weight.shape[0]))
        for weight, m in zip(pw_weights[1:saved_stop], pixels[1:saved_stop], strict=True)
    ]
    return tokens, rows, outputs


def _tokenize_backward_fake(
    grad_tokens,
    images,
    dw_weights,
    dw_biases,
    pw_weights,
    pw_biases,
    strides,
    activation,
    stage_norm,
    norm_weights,
    norm_biases,
    token_norm_weight,
    token_norm_bias,
    eps,
    mean,
    std,
    padded_size,
    output_fmt,
    saved_rows,
    saved_outputs,
    output_mask,
):
    images_grad, parameters_grad = output_mask

    def like(tensors):
        return [t.new_empty(t.shape) for t in tensors if t is not None] if parameters_grad else []

    grad_images = [images.new_empty(images.shape).contiguous(memory_format=memory_format_of(images))]
    return (
        grad_images if images_grad else [],
        like(dw_weights),
        like(dw_biases),
        like(pw_weights),
        like(pw_biases),
        like(norm_weights),
        like(norm_biases),
        like([token_norm_weight, token_norm_bias]),
    )


def _crop_resize_fake(images, boxes, ratios, size):
    return images[0].new_empty((len(images), images[0].shape[0], size, size))


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "LumenBridge: lumenbridge::tokenize supports first-order gradients only (lumenbridge::tokenize_backward "
        "has no derivative); for double backward, build the VisualTokenizer with backend='reference'"
    )


def _like(t: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """t in reference's layout: autograd may hand back any strides (e.g. from a
    transpose downstream), and the gateway reads only dense layouts."""
    return t.contiguous(memory_format=memory_format_of(reference))


# All three ops are linear in each tensor argument, so each one's gradient is
# another of the three:
#   y  = forward(x, w, b)            dx = backward_input(gy, w)   (dw, db) = backward_weight(gy, x)
#   dx = backward_input(gy, w)       d(gy) = forward(g_dx, w)     dw = backward_weight(gy, g_dx)
#   (dw, db) = backward_weight(gy, x)  d(gy) = forward(x, g_dw, g_db)  dx = backward_input(gy, g_dw)


def _forward_setup(ctx, inputs, output):
    input, weight, bias, stride = inputs
    ctx.save_for_backward(input, weight)
    ctx.stride = stride
    ctx.has_bias = bias is not None


def _forward_backward(ctx, grad_output):
    input, weight = ctx.saved_tensors
    grad_output = _like(grad_output, input)
    grad_input = grad_weight = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_input = ops.depthwise_conv2d_backward_input(grad_output, weight, ctx.stride, list(input.shape[2:]))
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        grad_weight, grad_bias = ops.depthwise_conv2d_backward_weight(grad_output, input, weight.shape[-1], ctx.stride)
    return grad_input, grad_weight, grad_bias if ctx.has_bias else None, None


def _backward_input_setup(ctx, inputs, output):
    grad_output, weight, stride, _ = inputs
    ctx.save_for_backward(grad_output, weight)
    ctx.stride = stride


def _backward_input_backward(ctx, grad_grad_input):
    grad_output, weight = ctx.saved_tensors
    grad_grad_input = _like(grad_grad_input, grad_output)
    d_grad_output = d_weight = None
    if ctx.needs_input_grad[0]:
        d_grad_output = ops.depthwise_conv2d(grad_grad_input, weight, None, ctx.stride)
    if ctx.needs_input_grad[1]:
        d_weight, _ = ops.depthwise_conv2d_backward_weight(grad_output, grad_grad_input, weight.shape[-1], ctx.stride)
    return d_grad_output, d_weight, None, None


def _backward_weight_setup(ctx, inputs, output):
    grad_output, input, _, stride = inputs
    ctx.save_for_backward(grad_output, input)
    ctx.stride = stride


def _backward_weight_backward(ctx, grad_grad_weight, grad_grad_bias):
    grad_output, input = ctx.saved_tensors
    grad_grad_weight = grad_grad_weight.contiguous()
    d_grad_output = d_input = None
    if ctx.needs_input_grad[0]:
        d_grad_output = ops.depthwise_conv2d(input, grad_grad_weight, grad_grad_bias.contiguous(), ctx.stride)
    if ctx.needs_input_grad[1]:
        d_input = ops.depthwise_conv2d_backward_input(grad_output, grad_grad_weight, ctx.stride, list(input.shape[2:]))
    return d_grad_output, d_input, None, None


_registered = False


def register_python_kernels() -> None:
    """Every op's fake, and the autograd formulas of all but tokenize and
    tokenize_for_training (whose autograd kernels are C++); extension.py calls
    this right after it loads the library (torch.library needs the ops to exist)."""
    global _registered
    if _registered:
        return
    _registered = True
    for name, fake, backward, setup in (
        ("depthwise_conv2d", _depthwise_conv2d_fake, _forward_backward, _forward_setup),
        (
            "depthwise_conv2d_backward_input",
            _depthwise_conv2d_backward_input_fake,
            _backward_input_backward,
            _backward_input_setup,
        ),
        (
            "depthwise_conv2d_backward_weight",
            _depthwise_conv2d_backward_weight_fake,
            _backward_weight_backward,
            _backward_weight_setup,
        ),
    ):
        torch.library.register_fake(f"lumenbridge::{name}", _checked(fake, getattr(ops, f"_check_{name}")))
        torch.library.register_autograd(f"lumenbridge::{name}", backward, setup_context=setup)
    for name, fake, check in (
        ("tokenize", _tokenize_fake, ops._check_tokenize),
        ("tokenize_for_training", _tokenize_for_training_fake, ops._check_tokenize),
        ("tokenize_backward", _tokenize_backward_fake, None),
        ("crop_resize", _crop_resize_fake, None),
    ):
        torch.library.register_fake(f"lumenbridge::{name}", _checked(fake, check))
    torch.library.register_autograd("lumenbridge::tokenize_backward", _no_double_backward)


def ready() -> bool:
    """Load the extension (building it if needed) with its Python kernels; False if unavailable."""
    return extension.load()


def depthwise_conv2d(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: int) -> torch.Tensor:
    return ops.depthwise_conv2d(input, weight, bias, stride)


@functools.cache
def _class_defines(cls: type, name: str) -> bool:
    """Whether `cls` or a base class defines `name` itself (a property, say)."""
    return any(name in klass.__dict__ for klass in cls.__mro__)


# The classes the model builds its convolutions and token norm from, which
# define neither `weight` nor `bias` themselves (asking _class_defines costs
# as much as reading the table).
_PLAIN_CLASSES = frozenset({torch.nn.Conv2d, torch.nn.LayerNorm})


def _parameter(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    """module.<name>, read from the module's parameter table where that is what
    the attribute returns: nn.Module's attribute lookup costs microseconds,
    and a forward reads 18 of them. A parametrized name is not in the table
    (and its module's class is a subclass made for it), and a class may
    define the name itself (a property); both take the normal lookup."""
    found = module._parameters.get(name)
    if found is None or (type(module) not in _PLAIN_CLASSES and _class_defines(type(module), name)):
        return getattr(module, name)
    return found


def tokenize_arguments(images: torch.Tensor, model) -> tuple:
    """The arguments of torch.ops.lumenbridge.tokenize for `model` (a
    VisualTokenizer) on `images`: its parameters in their nn layouts."""
    cfg = model.config
    # A traced forward takes the normal lookup: torch.compile pays it once,
    # and would warn about tracing through _class_defines's cache.
    parameter = getattr if torch.compiler.is_compiling() else _parameter
    dw_weights, dw_biases, pw_weights, pw_biases = [], [], [], []
    for stage in model._modules["stages"]._modules.values():
        dw, pw = stage._modules["dw"], stage._modules["pw"]
        dw_weights.append(parameter(dw, "weight"))
        dw_biases.append(parameter(dw, "bias"))
        pw_weights.append(parameter(pw, "weight"))
        pw_biases.append(parameter(pw, "bias"))
        if dw_biases[-1] is None or pw_biases[-1] is None:
            raise ValueError(
                f"stage {len(dw_biases) - 1} has a convolution without a bias, which the native op needs "
                "(the architecture has them); use backend='reference' for such a model"
            )
    if images.dtype != torch.uint8:
        images = images.to(dw_weights[0].dtype)
    stage_norm, norm_weights, norm_biases = _stage_norm_arguments(model)
    token_norm = model._modules["token_norm"] if cfg.token_norm else None
    return (
        images,  # in any layout: the op makes other layouts than NCHW and NHWC dense itself
        dw_weights,
        dw_biases,
        pw_weights,
        pw_biases,
        cfg.strides,
        cfg.activation,
        stage_norm,
        norm_weights,
        norm_biases,
        None if token_norm is None else parameter(token_norm, "weight"),
        None if token_norm is None else parameter(token_norm, "bias"),
        model.norm_eps,
        cfg.pixel_mean,
        cfg.pixel_std,
        list(model.padded_size(*images.shape[2:])),
        cfg.output_fmt,
    )


def tokenize(images: torch.Tensor, model) -> torch.Tensor:
    """The whole tokenizer as one op call: tokenize_for_training where autograd
    will need a backward (what it saves spares the backward most of its
    recompute), tokenize otherwise."""
    args = tokenize_arguments(images, model)
    if torch.is_grad_enabled() and any(_needs_grad(a) for a in args):
        return ops.tokenize_for_training(*args)[0]
    return ops.tokenize(*args)


def _needs_grad(argument) -> bool:
    """Whether an op argument (a tensor, a list of them, or an option) requires grad."""
    if isinstance(argument, list):
        return any(_needs_grad(a) for a in argument)
    return isinstance(argument, torch.Tensor) and argument.requires_grad


def _stage_norm_arguments(model) -> tuple[str, list[torch.Tensor], list[torch.Tensor]]:
    """The op's stage_norm and its per-stage tensors: LayerNorm as is, an
    eval-mode BatchNorm as the per-channel affine map it computes."""
    kind = model.config.stage_norm
    if kind == "none":
        return "none", [], []
    norms = [s.norm for s in model.stages]
    if kind == "layernorm":
        return "layernorm", [n.weight for n in norms], [n.bias for n in norms]
    scales = [n.weight * torch.rsqrt(n.running_var + n.eps) for n in norms]
    shifts = [n.bias - n.running_mean * scale for n, scale in zip(norms, scales, strict=True)]
    return "affine", scales, shifts


def tokenize_path(device_type: str, cfg, dtype: torch.dtype) -> str:
    """How tokenize runs a configuration on a device: "fused", or "composed: <why>"."""
    if device_type != "cuda":
        return (
            "composed, one op call: inference on ATen's channels-last convolutions, a large batch "
            "in chunks of images; training on the CPU depthwise kernels and GEMMs"
        )
    norm = "affine" if cfg.stage_norm == "batchnorm" else cfg.stage_norm
    return ops.tokenize_path(dtype, cfg.in_chans, list(cfg.stage_widths), cfg.kernel_size, list(cfg.strides), norm)


def tokenize_backward_path(device_type: str) -> str:
    """How tokenize_backward runs on a device: one composition everywhere, with
    CUDA's one-pass kernels where they apply."""
    common = (
        "lumenbridge::tokenize_backward, composed from the per-layer kernels, GEMMs and ATen; "
        "it takes every stage's depthwise rows and the later stages' outputs from what "
        "lumenbridge::tokenize_for_training saves and recomputes the rest of the forward"
    )
    if device_type != "cuda":
        return common
    return common + (
        "; one kernel takes each later stage's depthwise gradients in one pass at stride 2 "
        "(the second stage's input computed from the images' stage's rows, and in half types "
        "the images' stage's pointwise gradients folded into the same pass); for up to three "
        "image channels, one kernel the images' stage's pointwise gradients where that fold "
        "does not apply (half types), and one pass over the images as given each its depthwise "
        "weight gradients and, where they were not saved, its depthwise rows"
    )
