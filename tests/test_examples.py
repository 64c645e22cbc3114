"""examples/: each runs as shipped, on the CPU, in seconds."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_vlm_connector_trains_every_part_for_one_step():
    pytest.importorskip("transformers")
    example = runpy.run_path(str(EXAMPLES / "vlm_connector.py"))
    result = example["main"]()
    assert result.image_tokens == [24, 21]  # 300 x 200 -> 6 x 4 tokens, 180 x 400 -> 3 x 7
    assert result.loss_after < result.loss_before
    model = result.model
    for part in (model.vision, model.projector, model.language_model):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in part.parameters() if p.requires_grad)
