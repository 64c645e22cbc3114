"""The pure-PyTorch reference: the correctness oracle for every kernel and the
fallback on any device PyTorch runs on (CPU, CUDA, Apple MPS).

Each function has the same signature as the native op of the same name in
torch.ops.lumenbridge, so tests can compare the two directly."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check_convolution(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, shape: tuple[int, ...], described: str
) -> None:
    """The contract of a convolution's arguments that the native ops' gateway
    checks in C++, for the convolutions PyTorch runs: F.conv2d would take a
    weight of another shape as another convolution, integer tensors with
    wrap-around, and a meta weight with an uninitialized result.
    shape: the weight's expected shape; described: that shape as the message names it."""
    for name, tensor in (("input", input), ("weight", weight), ("bias", bias)):
        if tensor is None:
            continue
        if not tensor.is_floating_point():
            raise TypeError(
                f"LumenBridge: {name} has dtype {tensor.dtype}; the convolutions take floating-point tensors"
            )
        if tensor.device != input.device:
            raise ValueError(f"LumenBridge: {name} is on {tensor.device} but input is on {input.device}")
    if tuple(weight.shape) != shape:
        raise ValueError(f"LumenBridge: weight must have shape {described}, got {list(weight.shape)}")
    if bias is not None and tuple(bias.shape) != shape[:1]:
        raise ValueError(f"LumenBridge: bias must have shape [{shape[0]}], got {list(bias.shape)}")


def _four_d(input: torch.Tensor) -> None:
    if input.dim() != 4:
        raise ValueError(f"LumenBridge: input must be 4-D [N, C, H, W], got shape {list(input.shape)}")


def depthwise_conv2d(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: int) -> torch.Tensor:
    """Depthwise K x K convolution, zero padding K // 2; weight is [C, 1, K, K], K odd."""
    _four_d(input)
    channels, k = input.shape[1], weight.shape[-1]
    described = f"[C, 1, K, K] with C = {channels} and K odd"
    _check_convolution(input, weight, bias, (channels, 1, k, k) if k % 2 else (), described)
    return F.conv2d(input, weight, bias, stride=stride, padding=k // 2, groups=channels)


def depthwise_conv2d_backward_input(
    grad_output: torch.Tensor, weight: torch.Tensor, stride: int, input_size: list[int]
) -> torch.Tensor:
    """Gradient of depthwise_conv2d with respect to its input of spatial size input_size."""
    n, c = grad_output.shape[:2]
    return torch.nn.grad.conv2d_input(
        (n, c, *input_size), weight, grad_output, stride=stride, padding=weight.shape[-1] // 2, groups=c
    )


def depthwise_conv2d_backward_weight(
    grad_output: torch.Tensor, input: torch.Tensor, kernel_size: int, stride: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of depthwise_conv2d with respect to weight [C, 1, K, K] and bias [C]."""
    c = input.shape[1]
    grad_weight = torch.nn.grad.conv2d_weight(
        input, (c, 1, kernel_size, kernel_size), grad_output, stride=stride, padding=kernel_size // 2, groups=c
    )
    return grad_weight, grad_output.sum(dim=(0, 2, 3))


def pointwise_conv2d(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """1 x 1 convolution mixing channels; weight is [C_out, C_in, 1, 1]."""
    _four_d(input)
    channels = input.shape[1]
    shape = (weight.shape[0], channels, 1, 1) if weight.dim() == 4 else ()
    _check_convolution(input, weight, bias, shape, f"[C_out, C_in, 1, 1] with C_in = {channels}")
    return F.conv2d(input, weight, bias)
