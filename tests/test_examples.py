"""examples/: each runs as shipped (train_classifier.py shortened), on the CPU, in seconds."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
from conftest import import_or_skip

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_vlm_connector_trains_every_part_for_one_step():
    import_or_skip("transformers")
    example = runpy.run_path(str(EXAMPLES / "vlm_connector.py"))
    result = example["main"]()
    assert result.image_tokens == [24, 21]  # 300 x 200 -> 6 x 4 tokens, 180 x 400 -> 3 x 7
    assert result.loss_after < result.loss_before
    model = result.model
    for part in (model.vision, model.projector, model.language_model):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in part.parameters() if p.requires_grad)


def test_train_classifier_checkpoints_each_epoch_and_resumes_exactly(tmp_path, native_ops):
    """A shortened run: two epochs straight, against one interrupted after its
    first checkpoint and resumed; both end with the same weights."""
    example = runpy.run_path(str(EXAMPLES / "train_classifier.py"))
    main = example["main"]
    common = ["--epochs", "2", "--steps-per-epoch", "2", "--batch-size", "8", "--device", "cpu"]
    straight = main([*common, "--checkpoint", str(tmp_path / "straight")])
    assert 0.0 <= straight.accuracy <= 1.0 and straight.held_out == 135 and straight.epochs == 2
    saved = tmp_path / "straight" / "epoch-2"
    assert sorted(p.name for p in (tmp_path / "straight").iterdir()) == ["epoch-2"]  # older epochs dropped
    assert {p.name for p in saved.iterdir()} == {"tokenizer", "classifier.safetensors", "training.pt"}

    train_epoch = main.__globals__["train_epoch"]

    def interrupted(model, training, regions, epoch, args, device):
        if epoch == 2:
            raise KeyboardInterrupt
        return train_epoch(model, training, regions, epoch, args, device)

    main.__globals__["train_epoch"] = interrupted
    with pytest.raises(KeyboardInterrupt):
        main([*common, "--checkpoint", str(tmp_path / "resumed")])
    main.__globals__["train_epoch"] = train_epoch
    with pytest.raises(SystemExit, match="already holds a checkpoint"):
        main([*common, "--checkpoint", str(tmp_path / "resumed")])
    abandoned = tmp_path / "resumed" / ".epoch-2.partial-999999"  # a save killed midway, in another process
    (abandoned / "tokenizer").mkdir(parents=True)
    resumed = main([*common, "--checkpoint", str(tmp_path / "resumed"), "--resume"])
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == ["epoch-2"]
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert resumed.accuracy == straight.accuracy
