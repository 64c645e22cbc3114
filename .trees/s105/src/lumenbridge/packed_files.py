"""Image files to packed native-resolution tokens (the CLI's --max-tokens).

Each image is resized to keep its aspect ratio within a token budget
(packing.fit_token_budget), with no crop, and tokenized with
VisualTokenizer.forward_packed. The result is one [sum of N_i, D] tensor
with cu_seqlens and grid_hw giving each image's share.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from PIL import Image

from .images import (
    DEFAULT_MAX_PIXELS,
    WHITE,
    FileDataset,
    LoadedImage,
    decode_opened,
    image_loader,
    open_image,
    read_batches,
    to_tensor,
    upright_size,
)
from .model import VisualTokenizer
from .packing import check_token_budget, cumulative_lengths, fit_token_budget


def load_image_in_budget(
    path: str, stride: int, max_tokens: int, max_pixels: int = DEFAULT_MAX_PIXELS, background=WHITE
) -> torch.Tensor:
    """Decodes a file into uint8 [3, H, W], resized (aspect ratio kept) to at most max_tokens tokens.

    The size comes from the file's header, so a JPEG decodes at a reduced
    size that still covers it (as load_image does for the crop), and
    max_pixels applies to that reduced size."""
    with open_image(path) as opened:
        width, height = upright_size(opened)
        height, width = fit_token_budget(height, width, stride, max_tokens=max_tokens)
        image = decode_opened(opened, max(height, width), max_pixels=max_pixels, background=background)
    return to_tensor(image.resize((width, height), Image.Resampling.BICUBIC))


class TokenBudgetDataset(FileDataset):
    """Images from files, each resized into the token budget."""

    def __init__(self, paths: Sequence[str], stride: int, max_tokens: int, max_pixels: int, background):
        super().__init__(paths)
        self.stride = stride
        self.max_tokens = max_tokens
        self.max_pixels = max_pixels
        self.background = background

    def load(self, path: str) -> torch.Tensor:
        return load_image_in_budget(path, self.stride, self.max_tokens, self.max_pixels, self.background)


class ImageList(NamedTuple):
    """A batch of readable images of any sizes, plus the unreadable ones."""

    indices: list[int]
    pixels: list[torch.Tensor]
    failures: list[tuple[int, str]]


def collate_image_list(items: Sequence[LoadedImage]) -> ImageList:
    good = [item for item in items if item.pixels is not None]
    failures = [(item.index, item.error) for item in items if item.pixels is None]
    return ImageList([item.index for item in good], [item.pixels for item in good], failures)


@dataclass
class PackedFilesResult:
    tokens: torch.Tensor | None  # [sum of N_i, D]; None when no image was readable
    cu_seqlens: torch.Tensor | None  # int32 [images read + 1]
    grid_hw: torch.Tensor | None  # int64 [images read, 2]
    paths: list[str]  # source of each image, in order
    failures: list[tuple[str, str]]  # (path, reason) of each skipped image
    seconds: float


def tokenize_files_packed(
    model: VisualTokenizer,
    paths: Sequence[str],
    *,
    max_tokens: int,
    batch_size: int = 32,
    workers: int = 0,
    dtype: torch.dtype = torch.float32,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    background: tuple[int, int, int] = WHITE,
    progress: bool = True,
    on_failure: Callable[[str, str], None] | None = None,
) -> PackedFilesResult:
    """Tokenizes image files in order at native resolution, skipping unreadable ones.

    on_failure(path, reason) is called as each unreadable image is found.
    """
    if max_tokens is None:
        raise ValueError("max_tokens is required: the largest number of tokens an image may give")
    check_token_budget(None, max_tokens)  # before any image, not once per image as a read error
    paths = list(paths)
    device = next(model.parameters()).device
    loader = image_loader(
        TokenBudgetDataset(paths, model.config.total_stride, max_tokens, max_pixels, background),
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=collate_image_list,
    )
    pieces: list[torch.Tensor] = []
    grids: list[torch.Tensor] = []
    kept: list[str] = []
    failures: list[tuple[str, str]] = []
    started = time.perf_counter()
    with torch.inference_mode():
        for batch in read_batches(loader, paths, failures, on_failure, progress):
            if batch.pixels:
                packed = model.forward_packed([pixels.to(device) for pixels in batch.pixels])
                pieces.append(packed.tokens.to("cpu", dtype))
                grids.append(packed.grid_hw.cpu())
                kept.extend(paths[index] for index in batch.indices)
    seconds = time.perf_counter() - started
    if not pieces:
        return PackedFilesResult(None, None, None, kept, failures, seconds)
    grid_hw = torch.cat(grids)
    cu_seqlens = cumulative_lengths((grid_hw[:, 0] * grid_hw[:, 1]).tolist())
    return PackedFilesResult(concatenate_releasing(pieces), cu_seqlens, grid_hw, kept, failures, seconds)


def concatenate_releasing(pieces: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(pieces) that empties the list as it goes, so memory peaks at
    the result plus one piece rather than twice the result (the result's
    pages are touched only as each piece is copied in)."""
    out = torch.empty((sum(piece.shape[0] for piece in pieces), *pieces[0].shape[1:]), dtype=pieces[0].dtype)
    row = 0
    pieces.reverse()
    while pieces:
        piece = pieces.pop()
        out[row : row + piece.shape[0]].copy_(piece)
        row += piece.shape[0]
        del piece
    return out
