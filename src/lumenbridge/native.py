"""The Python half of torch.ops.lumenbridge: fake (meta) kernels, so that
torch.compile can trace the ops, and the autograd formulas that route
gradients to the native backward ops. The C++ half (schemas, checks, kernels)
is in csrc/; extension.py builds and loads it."""

from __future__ import annotations

import torch

from . import extension


def memory_format_of(t: torch.Tensor) -> torch.memory_format:
    """The layout the gateway reads a tensor in: NCHW when it is contiguous, else channels-last."""
    return torch.contiguous_format if t.is_contiguous() else torch.channels_last


def _output_extent(size: int, kernel_size: int, stride: int) -> int:
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


def _setup_context(ctx, inputs, output):
    input, weight, bias, stride = inputs
    ctx.save_for_backward(input, weight)
    ctx.stride = stride
    ctx.has_bias = bias is not None


def _backward(ctx, grad_output):
    input, weight = ctx.saved_tensors
    # Autograd may hand back any strides (e.g. from a transpose downstream);
    # the gateway reads only dense layouts, so match the input's explicitly.
    grad_output = grad_output.contiguous(memory_format=memory_format_of(input))
    grad_input = grad_weight = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_input = torch.ops.lumenbridge.depthwise_conv2d_backward_input(
            grad_output, weight, ctx.stride, list(input.shape[2:])
        )
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        grad_weight, grad_bias = torch.ops.lumenbridge.depthwise_conv2d_backward_weight(
            grad_output, input, weight.shape[-1], ctx.stride
        )
    return grad_input, grad_weight, grad_bias if ctx.has_bias else None, None


def _register_python_kernels() -> None:
    # torch.library needs the ops to exist, so this runs after the library loads.
    torch.library.register_fake("lumenbridge::depthwise_conv2d", _depthwise_conv2d_fake)
    torch.library.register_fake("lumenbridge::depthwise_conv2d_backward_input", _depthwise_conv2d_backward_input_fake)
    torch.library.register_fake("lumenbridge::depthwise_conv2d_backward_weight", _depthwise_conv2d_backward_weight_fake)
    torch.library.register_autograd("lumenbridge::depthwise_conv2d", _backward, setup_context=_setup_context)


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
    return torch.ops.lumenbridge.depthwise_conv2d(input, weight, bias, stride)
