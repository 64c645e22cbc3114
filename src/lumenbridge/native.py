"""The Python half of torch.ops.lumenbridge: fake (meta) kernels, so that
torch.compile can trace the ops, and autograd formulas for all three ops, so
gradients of any order flow through the native kernels. The C++ half
(schemas, checks, kernels) is in csrc/; extension.py builds and loads it."""

from __future__ import annotations

import torch

from . import extension
from .layout import memory_format_of

ops = torch.ops.lumenbridge


def _output_extent(size: int, kernel_size: int, stride: int) -> int:
    # Mirrors depthwise_output_extent in csrc/gateway.h, for shapes under tracing.
    return (size + 2 * (kernel_size // 2) - kernel_size) // stride + 1


def _depthwise_conv2d_fake(input, weight, bias, stride):
    k = weight.shape[-1]
    n, c, h, w = input.shape
    shape = (n, c, _output_extent(h, k, stride), _output_extent(w, k, stride))
    return input.new_empty(shape).contiguous(memory_format=memory_format_of(input))


def _depthwise_conv2d_backward_input_fake(grad_output, weight, stride, input_size):
    n, c = grad_output.shape[:2]
    shape = (n, c, *input_size)
    return grad_output.new_empty(shape).contiguous(memory_format=memory_format_of(grad_output))


def _depthwise_conv2d_backward_weight_fake(grad_output, input, kernel_size, stride):
    c = input.shape[1]
    return input.new_empty((c, 1, kernel_size, kernel_size)), input.new_empty((c,))


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


def _register_python_kernels() -> None:
    # torch.library needs the ops to exist, so this runs after the library loads.
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
        torch.library.register_fake(f"lumenbridge::{name}", fake)
        torch.library.register_autograd(f"lumenbridge::{name}", backward, setup_context=setup)


_registered = False


def ready() -> bool:
    """Load the extension and register its Python kernels once; False if unavailable."""
    global _registered
    if not extension.load():
        return False
    if not _registered:
        _register_python_kernels()
        _registered = True
    return True


def depthwise_conv2d(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: int) -> torch.Tensor:
    return ops.depthwise_conv2d(input, weight, bias, stride)
