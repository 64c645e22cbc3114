"""Output extents of the tokenizer's convolutions: the one Python statement of
the formula csrc/gateway.h's depthwise_output_extent computes, used by the
fake kernels (shapes under tracing) and by VisualTokenizer.feature_size."""

from __future__ import annotations

from collections.abc import Sequence


def output_extent(size: int, kernel_size: int, stride: int) -> int:
    """One spatial extent after a K x K convolution with padding K // 2 (ceil(size / stride) for odd K)."""
    return (size + 2 * (kernel_size // 2) - kernel_size) // stride + 1


def stage_extents(size: int, kernel_size: int, strides: Sequence[int]) -> list[int]:
    """One extent after each stage, in order."""
    extents = []
    for stride in strides:
        size = output_extent(size, kernel_size, stride)
        extents.append(size)
    return extents


def grid_extent(size: int, kernel_size: int, strides: Sequence[int]) -> int:
    """One extent of the token grid: the extent after every stage."""
    return stage_extents(size, kernel_size, strides)[-1] if strides else size
