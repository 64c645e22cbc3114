"""The tensors handed to vLLM as precomputed image embeddings, checked against
what vLLM's Qwen2-VL code does with them (vLLM itself is not needed).

vllm/model_executor/models/qwen2_vl.py: Qwen2VLImageEmbeddingInputs declares
image_embeds as TensorShape("nf", "hs") and image_grid_thw as
TensorShape("ni", 3); _create_qwen2vl_field_factory gives image i
image_grid_thw[i].prod() // spatial_merge_size**2 rows of image_embeds
(flat_from_sizes), _process_image_input splits them with those sizes, and
get_mrope_input_positions lays image i's tokens on the
(h // spatial_merge_size, w // spatial_merge_size) grid.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lumenbridge import TokenizerConfig, VisualTokenizer
from lumenbridge.integrations.vllm import qwen2_vl_image_data

SMALL = dataclasses.replace(TokenizerConfig(), embed_dim=32, stage_widths=(8, 16, 16, 32))
LM_HIDDEN = 48
SIZES = [(32, 48), (64, 16), (48, 48)]


@pytest.fixture
def packed():
    model = VisualTokenizer(SMALL, seed=0).eval()
    with torch.no_grad():
        return model.forward_packed([torch.randn(3, *size) for size in SIZES])


def vllm_split_sizes(image_grid_thw, merge):
    """What vLLM's field factory and _process_image_input compute."""
    return (torch.tensor(image_grid_thw.tolist(), dtype=torch.long).prod(-1) // (merge * merge)).tolist()


def vllm_mrope_grids(image_grid_thw, merge):
    return [(t, h // merge, w // merge) for t, h, w in image_grid_thw.tolist()]


@pytest.mark.parametrize("merge", [2, 1])
def test_qwen2_vl_image_data_matches_the_embedding_input_schema(packed, merge):
    projector = torch.nn.Linear(32, LM_HIDDEN).to(torch.bfloat16)
    with torch.no_grad():
        embeds = projector(packed.tokens.to(torch.bfloat16))
    data = qwen2_vl_image_data(packed, embeds, spatial_merge_size=merge)

    assert set(data) == {"image_embeds", "image_grid_thw"}
    image_embeds, grid_thw = data["image_embeds"], data["image_grid_thw"]
    # TensorShape("nf", "hs") and TensorShape("ni", 3), in the LM's dtype and integer grids.
    assert image_embeds.shape == (6 + 4 + 9, LM_HIDDEN) and image_embeds.dtype == torch.bfloat16
    assert grid_thw.shape == (3, 3) and grid_thw.dtype == torch.int64
    assert grid_thw.tolist() == [[1, 2 * merge, 3 * merge], [1, 4 * merge, 1 * merge], [1, 3 * merge, 3 * merge]]
    # vLLM's split gives each image exactly its own tokens, in order ...
    sizes = vllm_split_sizes(grid_thw, merge)
    assert sum(sizes) == len(image_embeds)
    for piece, tokens in zip(image_embeds.split(sizes), packed.unpack()):
        with torch.no_grad():
            torch.testing.assert_close(piece, projector(tokens.to(torch.bfloat16)))
    # ... and its M-RoPE grid is the image's token grid.
    assert vllm_mrope_grids(grid_thw, merge) == [(1, h // 16, w // 16) for h, w in SIZES]


def test_the_tokens_themselves_when_the_widths_match(packed):
    data = qwen2_vl_image_data(packed)
    assert data["image_embeds"] is packed.tokens
    assert vllm_split_sizes(data["image_grid_thw"], 2) == [6, 4, 9]


def test_bad_embeddings_are_clear_errors(packed):
    with pytest.raises(ValueError, match=r"image_embeds must be \[19, hidden size\].*got shape \(18, 48\)"):
        qwen2_vl_image_data(packed, torch.zeros(18, 48))
    with pytest.raises(ValueError, match=r"got shape \(1, 19, 48\)"):
        qwen2_vl_image_data(packed, torch.zeros(1, 19, 48))
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="spatial_merge_size must be an integer of at least 1"):
            qwen2_vl_image_data(packed, spatial_merge_size=bad)
