from __future__ import annotations

import dataclasses
import json

import pytest
import safetensors.torch
import torch

from lumenbridge import TokenizerConfig, VisualTokenizer

SMALL = dataclasses.replace(TokenizerConfig(), embed_dim=32, stage_widths=(8, 16, 16, 32), stage_norm="batchnorm")


@pytest.fixture
def saved(tmp_path):
    model = VisualTokenizer(SMALL, seed=0)
    model.train()
    model(torch.randn(4, 3, 32, 32))  # moves the batch-norm running statistics off their defaults
    model.eval()
    model.save_pretrained(tmp_path)
    return model, tmp_path


def test_round_trip_gives_identical_tokens(saved):
    model, directory = saved
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors"]
    loaded = VisualTokenizer.from_pretrained(directory).eval()
    assert loaded.config == model.config
    images = torch.randint(0, 256, (2, 3, 48, 32), dtype=torch.uint8)
    with torch.no_grad():
        assert torch.equal(loaded(images), model(images))


def test_checkpoint_holds_no_pickle(saved):
    _, directory = saved
    json.loads((directory / "config.json").read_text())
    # The safetensors layout: an 8-byte little-endian header length, a JSON
    # header describing every tensor, then raw bytes. A pickle or a
    # torch.save zip archive would fail to parse here.
    raw = (directory / "model.safetensors").read_bytes()
    header_length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_length])
    tensors = {name for name in header if name != "__metadata__"}
    assert tensors == set(VisualTokenizer(SMALL).state_dict())
    assert all(set(header[name]) == {"dtype", "shape", "data_offsets"} for name in tensors)


def test_save_replaces_an_older_checkpoint(saved, tmp_path):
    _, directory = saved
    other = VisualTokenizer(SMALL, seed=5)
    other.save_pretrained(directory)
    loaded = VisualTokenizer.from_pretrained(directory)
    assert torch.equal(loaded.stages[0].dw.weight, other.stages[0].dw.weight)
    assert not any(p.name.endswith(".tmp") for p in directory.iterdir())


def test_a_save_killed_between_its_two_files_loads_what_it_wrote(saved):
    """Over a checkpoint of another architecture, a save that replaced
    model.safetensors but died before config.json still loads: the weights
    carry their own config, and loading prefers it."""
    _, directory = saved
    older_config = (directory / "config.json").read_text()
    wider = VisualTokenizer(dataclasses.replace(SMALL, stage_widths=(16, 16, 24, 32)), seed=1)
    wider.save_pretrained(directory)
    (directory / "config.json").write_text(older_config)  # as if killed between the two renames
    loaded = VisualTokenizer.from_pretrained(directory)
    assert loaded.config == wider.config
    assert torch.equal(loaded.stages[0].pw.weight, wider.stages[0].pw.weight)


def _rewrite(directory, edit):
    tensors = safetensors.torch.load_file(directory / "model.safetensors")
    edit(tensors)
    safetensors.torch.save_file(tensors, directory / "model.safetensors")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("stages.1.pw.weight"), "missing tensor 'stages.1.pw.weight'"),
        (lambda t: t.update({"head.weight": torch.zeros(3)}), "unexpected tensor 'head.weight'"),
        (lambda t: t.update({"stages.0.dw.bias": torch.zeros(5)}), r"'stages.0.dw.bias' has shape \[5\]"),
    ],
)
def test_mismatched_checkpoints_name_the_tensor(saved, edit, message):
    _, directory = saved
    _rewrite(directory, edit)
    with pytest.raises(ValueError, match=message):
        VisualTokenizer.from_pretrained(directory)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_corrupt_file_is_named(saved, name):
    _, directory = saved
    if name == "config.json":
        (directory / "model.safetensors").unlink()  # the weights' copy of the config would be read first
    (directory / name).write_bytes(b"{ not json")
    with pytest.raises(ValueError, match=f"{name} is not a readable LumenBridge checkpoint file"):
        VisualTokenizer.from_pretrained(directory)


def test_missing_files_are_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        VisualTokenizer.from_pretrained(tmp_path)
