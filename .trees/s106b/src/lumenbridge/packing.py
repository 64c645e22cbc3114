"""Native-resolution tokens: images of different sizes packed into one sequence.

Each image keeps its aspect ratio and gives rows x columns tokens. The tokens
of all images are concatenated into one [sum of N_i, D] tensor with the
boundaries in `cu_seqlens`, the layout that flash-attention's varlen functions
(and Qwen2-VL, NaViT-style packing) take, so attention can stay within each
image without padding. Images of one size run through the model as one batch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .config import is_int

if TYPE_CHECKING:
    from .model import VisualTokenizer


@dataclass(frozen=True)
class PackedTokens:
    """The tokens of several images as one sequence.

    tokens: [sum of N_i, D], image after image, each row-major over its grid.
    cu_seqlens: int32 [n + 1], where image i's tokens start and end
        (tokens[cu_seqlens[i] : cu_seqlens[i + 1]]).
    grid_hw: int64 [n, 2], each image's token grid as (rows, columns).
    positions: int64 [sum of N_i, 2], each token's (row, column) in its image's grid.
    max_seqlen: the longest image's token count, which varlen attention takes too.
    """

    tokens: torch.Tensor
    cu_seqlens: torch.Tensor
    grid_hw: torch.Tensor
    positions: torch.Tensor
    max_seqlen: int

    def unpack(self) -> list[torch.Tensor]:
        """The tokens of each image, [N_i, D] each, in order."""
        sizes = (self.grid_hw[:, 0] * self.grid_hw[:, 1]).tolist()
        return list(self.tokens.split(sizes))


def _check_per_image_statistics(model: VisualTokenizer) -> None:
    """Each image's tokens must be its own forward's: BatchNorm layers that
    normalize with the batch's statistics (training mode, or no running
    statistics) would mix the images of a size group."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and (
            module.training or module.running_mean is None
        ):
            raise ValueError(
                f"forward_packed: {name} normalizes with batch statistics, which would mix the images' tokens; "
                "call model.eval() first (and keep track_running_stats=True)"
            )


def _check_images(model: VisualTokenizer, images: Sequence[torch.Tensor]) -> None:
    if not isinstance(images, (list, tuple)):
        raise TypeError(f"forward_packed takes a list of [C, H, W] images, got {type(images).__name__}")
    if not images:
        raise ValueError("forward_packed needs at least one image, got an empty list")
    first = images[0]
    for index, image in enumerate(images):
        if not isinstance(image, torch.Tensor):
            raise TypeError(f"image {index} must be a torch.Tensor, got {type(image).__name__}")
        if image.dim() != 3:
            raise ValueError(f"image {index} must be 3-D [C, H, W], got shape {tuple(image.shape)}")
        if image.device != first.device:
            raise ValueError(f"image {index} is on {image.device} but image 0 is on {first.device}; use one device")
        if image.dtype != first.dtype:
            raise TypeError(f"image {index} is {image.dtype} but image 0 is {first.dtype}; use one dtype")
        try:  # the model's own checks (dtype, channels, sizes, device, finite values), naming the image
            model._check_images(image[None])
        except (TypeError, ValueError) as error:
            raise type(error)(f"image {index} ({tuple(image.shape)}): {error}") from error


def _as_sequences(output: torch.Tensor, fmt: str) -> torch.Tensor:
    """The model's output in its config's format as [B, N, D], row-major over the grid."""
    if fmt == "NCHW":
        return output.permute(0, 2, 3, 1).flatten(1, 2)
    if fmt == "NHWC":
        return output.flatten(1, 2)
    return output


def _positions(grid_hw: torch.Tensor, cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(row, column) of every token, from where its image starts and how wide its grid is."""
    sizes = grid_hw[:, 0] * grid_hw[:, 1]
    image = torch.repeat_interleave(torch.arange(len(grid_hw), device=grid_hw.device), sizes, output_size=total)
    local = torch.arange(total, device=grid_hw.device) - cu_seqlens[image].long()
    columns = grid_hw[image, 1]
    return torch.stack((local // columns, local % columns), dim=1)


def cumulative_lengths(lengths: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """cu_seqlens for sequences of these lengths: int32 [0, l0, l0 + l1, ...], as flash-attention's varlen functions take."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def pack(model: VisualTokenizer, images: Sequence[torch.Tensor]) -> PackedTokens:
    """Tokenize images of different sizes into one packed sequence (see VisualTokenizer.forward_packed)."""
    _check_per_image_statistics(model)
    _check_images(model, images)
    groups: dict[tuple[int, int], list[int]] = {}
    for index, image in enumerate(images):
        groups.setdefault(tuple(image.shape[1:]), []).append(index)
    pieces: list[torch.Tensor | None] = [None] * len(images)
    for indices in groups.values():
        batch = torch.stack([images[i] for i in indices])
        for i, sequence in zip(indices, _as_sequences(model(batch), model.config.output_fmt)):
            pieces[i] = sequence
    grids = [model.feature_size(*image.shape[1:]) for image in images]
    lengths = [rows * columns for rows, columns in grids]
    device = images[0].device
    cu_seqlens = cumulative_lengths(lengths, device)
    grid_hw = torch.tensor(grids, dtype=torch.int64, device=device)
    total = sum(lengths)
    return PackedTokens(torch.cat(pieces), cu_seqlens, grid_hw, _positions(grid_hw, cu_seqlens, total), max(lengths))


def check_token_budget(min_tokens: int | None, max_tokens: int | None) -> None:
    """Raise ValueError unless each given bound is a positive integer and min <= max."""
    for name, value in (("min_tokens", min_tokens), ("max_tokens", max_tokens)):
        if value is not None and (not is_int(value) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if min_tokens is not None and max_tokens is not None and min_tokens > max_tokens:
        raise ValueError(f"min_tokens ({min_tokens}) is larger than max_tokens ({max_tokens})")


def fit_token_budget(
    height: int, width: int, stride: int, *, min_tokens: int | None = None, max_tokens: int | None = None
) -> tuple[int, int]:
    """The (height, width) to resize an image to: multiples of stride, close to the
    image's aspect ratio, giving between min_tokens and max_tokens tokens.

    Like Qwen2-VL's min_pixels / max_pixels, counted in tokens: each side is
    rounded to a whole number of tokens, then both are scaled down (or up) by
    one factor when the count falls outside the budget. Where rounding after
    that scaling leaves the count outside the budget (a narrow one, such as
    min_tokens = max_tokens), the grid within it closest to the image's
    aspect ratio is taken. The result is always within the budget.
    """
    if not (is_int(height) and is_int(width)) or height < 1 or width < 1:
        raise ValueError(f"image size must be positive integers, got {height!r} x {width!r}")
    if not is_int(stride) or stride < 1:
        raise ValueError(f"stride must be a positive integer (the model's total_stride), got {stride!r}")
    check_token_budget(min_tokens, max_tokens)
    rows, columns = max(1, round(height / stride)), max(1, round(width / stride))
    if min_tokens is not None and rows * columns < min_tokens:
        scale = math.sqrt(min_tokens * stride * stride / (height * width))
        rows, columns = math.ceil(height * scale / stride), math.ceil(width * scale / stride)
    if max_tokens is not None and rows * columns > max_tokens:
        scale = math.sqrt(height * width / (max_tokens * stride * stride))
        rows, columns = max(1, math.floor(height / scale / stride)), max(1, math.floor(width / scale / stride))
        if rows * columns > max_tokens:
            # The short side was clamped to one token (a very long, thin image): trim the long side.
            if rows > columns:
                rows = max_tokens // columns
            else:
                columns = max_tokens // rows
    if min_tokens is not None and rows * columns < min_tokens:
        rows, columns = _closest_grid_in_budget(height / width, min_tokens, max_tokens)
    return rows * stride, columns * stride


def _closest_grid_in_budget(aspect: float, min_tokens: int, max_tokens: int) -> tuple[int, int]:
    """The (rows, columns) with min_tokens <= rows * columns <= max_tokens whose
    rows / columns is closest to aspect (height / width) in ratio."""
    best, best_distance = (1, min_tokens), math.inf
    for rows in range(1, max_tokens + 1):
        low, high = -(-min_tokens // rows), max_tokens // rows
        if low > high:
            continue
        ideal = min(max(round(rows / aspect), low), high)
        for columns in {low, ideal, high}:
            distance = abs(math.log(rows / columns / aspect))
            if distance < best_distance:
                best, best_distance = (rows, columns), distance
    return best


def resize_to_token_budget(
    image: torch.Tensor, stride: int, *, min_tokens: int | None = None, max_tokens: int | None = None
) -> torch.Tensor:
    """Resize a [C, H, W] image (uint8 or float) to the size fit_token_budget picks,
    keeping its dtype; bicubic with antialiasing, so shrinking does not alias."""
    if not isinstance(image, torch.Tensor) or image.dim() != 3:
        raise ValueError(f"image must be a [C, H, W] tensor, got {getattr(image, 'shape', type(image).__name__)}")
    size = fit_token_budget(*image.shape[1:], stride, min_tokens=min_tokens, max_tokens=max_tokens)
    if size == tuple(image.shape[1:]):
        return image
    # In float32: antialiased bicubic has no half-type kernel on the CPU and
    # no uint8 kernel off it.
    resized = F.interpolate(image.float()[None], size=size, mode="bicubic", antialias=True, align_corners=False)[0]
    if image.dtype == torch.uint8:
        resized = resized.round_().clamp_(0, 255)
    return resized.to(image.dtype)
