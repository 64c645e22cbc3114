"""Image files to packed native-resolution tokens (the CLI's --max-tokens).

Each image is resized to keep its aspect ratio within a token budget
(packing.fit_token_budget), with no crop, and tokenized with
VisualTokenizer.forward_packed. The result is one [sum of N_i, D] tensor
with cu_seqlens and grid_hw giving each image's share.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from PIL import Image
from tqdm import tqdm

from .images import DEFAULT_MAX_PIXELS, IMAGE_READ_ERRORS, WHITE, LoadedImage, decode_image, to_tensor
from .model import VisualTokenizer
from .packing import cumulative_lengths, fit_token_budget


def load_image_in_budget(
    path: str, stride: int, max_tokens: int, max_pixels: int = DEFAULT_MAX_PIXELS, background=WHITE
) -> torch.Tensor:
    """Decodes a file into uint8 [3, H, W], resized (aspect ratio kept) to at most max_tokens tokens."""
    image = decode_image(path, max_pixels=max_pixels, background=background)
    height, width = fit_token_budget(image.height, image.width, stride, max_tokens=max_tokens)
    return to_tensor(image.resize((width, height), Image.Resampling.BICUBIC))


class TokenBudgetDataset(torch.utils.data.Dataset):
    """Images from files, each resized into the token budget; a bad file becomes an error item."""

    def __init__(self, paths: Sequence[str], stride: int, max_tokens: int, max_pixels: int, background):
        self.paths = list(paths)
        self.stride = stride
        self.max_tokens = max_tokens
        self.max_pixels = max_pixels
        self.background = background

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> LoadedImage:
        try:
            pixels = load_image_in_budget(
                self.paths[index], self.stride, self.max_tokens, self.max_pixels, self.background
            )
        except IMAGE_READ_ERRORS as error:
            return LoadedImage(index, None, f"{type(error).__name__}: {error}")
        return LoadedImage(index, pixels, None)


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
    paths = list(paths)
    device = next(model.parameters()).device
    loader = torch.utils.data.DataLoader(
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
    with torch.inference_mode(), tqdm(total=len(paths), unit="img", file=sys.stderr, disable=not progress) as bar:
        for batch in loader:
            for index, reason in batch.failures:
                failures.append((paths[index], reason))
                if on_failure is not None:
                    on_failure(paths[index], reason)
            if batch.pixels:
                packed = model.forward_packed([pixels.to(device) for pixels in batch.pixels])
                pieces.append(packed.tokens.to("cpu", dtype))
                grids.append(packed.grid_hw.cpu())
                kept.extend(paths[index] for index in batch.indices)
            bar.update(len(batch.indices) + len(batch.failures))
    seconds = time.perf_counter() - started
    if not pieces:
        return PackedFilesResult(None, None, None, kept, failures, seconds)
    grid_hw = torch.cat(grids)
    cu_seqlens = cumulative_lengths((grid_hw[:, 0] * grid_hw[:, 1]).tolist())
    return PackedFilesResult(torch.cat(pieces), cu_seqlens, grid_hw, kept, failures, seconds)
