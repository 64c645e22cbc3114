"""Packed tokens as vLLM's precomputed image embeddings (no vLLM import needed).

vLLM takes image embeddings in place of pixels when the engine is built with
`LLM(..., enable_mm_embeds=True)` ("Embedding Inputs" in vLLM's
docs/features/multimodal_inputs.md). For the Qwen2-VL family the prompt's
`multi_modal_data["image"]` is a dict of two tensors, checked in
vllm/model_executor/models/qwen2_vl.py (Qwen2VLImageEmbeddingInputs and
_create_qwen2vl_field_factory):

- image_embeds [nf, hs]: every image's features, concatenated; hs is the
  language model's hidden size.
- image_grid_thw [ni, 3]: each image's (t, h, w) in vision patches; vLLM gives
  image i the next t * h * w // spatial_merge_size**2 rows of image_embeds and
  lays its M-RoPE positions on the (h // m, w // m) grid.

So a LumenBridge image of rows x columns tokens is described by
(1, rows * m, columns * m): its token count and its 2-D positions both come
out right.
"""

from __future__ import annotations

import torch

from ..config import is_int
from ..packing import PackedTokens


def qwen2_vl_image_data(
    packed: PackedTokens, image_embeds: torch.Tensor | None = None, *, spatial_merge_size: int = 2
) -> dict[str, torch.Tensor]:
    """The `multi_modal_data["image"]` dict for a Qwen2-VL-family model in vLLM.

    image_embeds: the packed tokens after your projector, [sum of N_i, LM hidden
    size], in the language model's dtype; by default packed.tokens themselves
    (when the tokenizer's width is already the LM's). spatial_merge_size is the
    model's vision_config.spatial_merge_size (2 for Qwen2-VL and Qwen2.5-VL).
    """
    embeds = packed.tokens if image_embeds is None else image_embeds
    if embeds.dim() != 2 or embeds.shape[0] != packed.tokens.shape[0]:
        raise ValueError(
            f"image_embeds must be [{packed.tokens.shape[0]}, hidden size], one row per packed token; "
            f"got shape {tuple(embeds.shape)}"
        )
    if not is_int(spatial_merge_size) or spatial_merge_size < 1:
        raise ValueError(f"spatial_merge_size must be an integer of at least 1, got {spatial_merge_size!r}")
    grid = packed.grid_hw.cpu()
    frames = torch.ones(len(grid), 1, dtype=torch.int64)
    return {"image_embeds": embeds, "image_grid_thw": torch.cat((frames, grid * spatial_merge_size), dim=1)}
