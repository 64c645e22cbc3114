"""The functional API: every convolution of the model goes through these
functions, which hand it to the backend dispatch.select_backend chooses.

Tensors passed to the native backend must be dense, contiguous NCHW or
channels-last NHWC; any other strides are rejected by the gateway with an
error saying how to fix them (VisualTokenizer makes its input dense itself).
The native backend takes K in config.KERNEL_SIZES and stride 1 or 2; the
reference is PyTorch's own convolution and takes any odd K and stride."""

from __future__ import annotations

import torch

from .dispatch import Backend, select_backend
from .layout import is_channels_last


def _backend_for(input: torch.Tensor, backend: str | None, **tensors: torch.Tensor | None) -> Backend:
    """The backend for input, once input and the other tensor arguments (named
    as the caller names them; None allowed) are dense torch tensors."""
    for name, tensor in {"input": input, **tensors}.items():
        if tensor is None and name != "input":
            continue
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            kind = f"a {tensor.layout} tensor" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise TypeError(f"LumenBridge: {name} must be a dense torch.Tensor, got {kind}")
    return select_backend(input.device, backend, channels_last=is_channels_last(input))


def depthwise_conv2d(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int = 1,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Depthwise K x K conv with zero padding K // 2: input [N, C, H, W], weight [C, 1, K, K]."""
    return _backend_for(input, backend, weight=weight, bias=bias).depthwise_conv2d(input, weight, bias, stride)


def pointwise_conv2d(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, backend: str | None = None
) -> torch.Tensor:
    """1 x 1 conv: input [N, C_in, H, W], weight [C_out, C_in, 1, 1]."""
    return _backend_for(input, backend, weight=weight, bias=bias).pointwise_conv2d(input, weight, bias)


def separable_conv(
    input: torch.Tensor,
    dw_weight: torch.Tensor,
    dw_bias: torch.Tensor | None,
    pw_weight: torch.Tensor,
    pw_bias: torch.Tensor | None,
    stride: int,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """One tokenizer stage's convolutions: depthwise (stride) then pointwise.
    Backends may fuse the two; the result is the same either way."""
    chosen = _backend_for(input, backend, dw_weight=dw_weight, dw_bias=dw_bias, pw_weight=pw_weight, pw_bias=pw_bias)
    return chosen.separable_conv(input, dw_weight, dw_bias, pw_weight, pw_bias, stride)
