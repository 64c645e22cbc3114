"""Which dense memory layout a 4-D tensor is in: the one test used everywhere."""

from __future__ import annotations

import torch


def is_channels_last(t: torch.Tensor) -> bool:
    """True for a dense channels-last (NHWC) tensor that is not also plain contiguous."""
    return t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()


def memory_format_of(t: torch.Tensor) -> torch.memory_format:
    """channels_last for channels-last tensors, contiguous_format otherwise."""
    return torch.channels_last if is_channels_last(t) else torch.contiguous_format
