"""The pure-PyTorch reference: the correctness oracle for every kernel and the
fallback on any device PyTorch runs on (CPU, CUDA, Apple MPS).

Each function has the same signature as the native op of the same name in
torch.ops.lumenbridge, so tests can compare the two directly."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def depthwise_conv2d(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: int) -> torch.Tensor:
    """Depthwise K x K convolution, zero padding K // 2; weight is [C, 1, K, K]."""
    return F.conv2d(input, weight, bias, stride=stride, padding=weight.shape[-1] // 2, groups=input.shape[1])


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
    return F.conv2d(input, weight, bias)
