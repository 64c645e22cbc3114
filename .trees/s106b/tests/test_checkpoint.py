from __future__ import annotations

import dataclasses
import json

import pytest
import safetensors.torch
import torch

from lumenbridge import TokenizerConfig, VisualTokenizer, checkpoint

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


@pytest.mark.parametrize("dying", ["config.json", "model.safetensors"])
def test_a_save_interrupted_between_its_two_files_keeps_the_older_checkpoint(saved, monkeypatch, dying):
    """Over a checkpoint of another architecture, a save that dies writing
    either file leaves the older weights whole: the folder loads as the older
    model, or is refused (its files disagree; transformers would build another
    architecture from config.json) and loads as the older model once
    config.json is deleted."""
    model, directory = saved
    real_write = checkpoint.write_atomically

    def write(path, contents):
        if path.name == dying:
            raise KeyboardInterrupt
        real_write(path, contents)

    monkeypatch.setattr(checkpoint, "write_atomically", write)
    with pytest.raises(KeyboardInterrupt):
        VisualTokenizer(dataclasses.replace(SMALL, stage_widths=(16, 16, 24, 32)), seed=1).save_pretrained(directory)
    monkeypatch.undo()
    try:
        loaded = VisualTokenizer.from_pretrained(directory)
    except ValueError as error:
        assert "config.json does not match the config saved with" in str(error)
        (directory / "config.json").unlink()
        loaded = VisualTokenizer.from_pretrained(directory)
    assert loaded.config == model.config
    assert torch.equal(loaded.stages[0].pw.weight, model.stages[0].pw.weight)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: {**c, "output_fmt": "NCHW"}, "does not match the config saved with"),
        (lambda c: {"model_type": "clip_vision_model", "hidden_size": 768}, "does not match the config saved with"),
        (lambda c: "this is not json", r"config.json is not a readable LumenBridge checkpoint file: JSONDecodeError"),
        (lambda c: {**c, "stage_widths": 768}, r"config.json .*stage_widths must be a list, got 768"),
    ],
    ids=["edited", "another-model", "not-json", "bad-field"],
)
def test_a_config_json_that_disagrees_with_the_weights_is_refused(saved, edit, message):
    _, directory = saved
    config = json.loads((directory / "config.json").read_text())
    edited = edit(config)
    (directory / "config.json").write_text(edited if isinstance(edited, str) else json.dumps(edited))
    with pytest.raises(ValueError, match=message):
        VisualTokenizer.from_pretrained(directory)


def test_keys_for_other_tools_in_config_json_are_left_to_them(saved):
    """README: a folder of save_pretrained loads in transformers once its
    config.json has "model_type"; it still loads here."""
    model, directory = saved
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "lumenbridge"}))
    assert VisualTokenizer.from_pretrained(directory).config == model.config


def test_weights_saved_before_they_carried_the_config_load_with_model_type_added(saved):
    """Checkpoints from before model.safetensors held the config: config.json
    says what they are, and "model_type" added for transformers (as the README
    says) is left to it rather than taken for a LumenBridgeVisionModel folder."""
    model, directory = saved
    safetensors.torch.save_file(
        safetensors.torch.load_file(directory / "model.safetensors"), directory / "model.safetensors"
    )
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "lumenbridge"}))
    loaded = VisualTokenizer.from_pretrained(directory)
    assert loaded.config == model.config
    assert torch.equal(loaded.stages[2].pw.weight, model.stages[2].pw.weight)


def test_a_corrupt_config_in_the_weights_is_named(saved):
    _, directory = saved
    tensors = safetensors.torch.load_file(directory / "model.safetensors")
    safetensors.torch.save_file(tensors, directory / "model.safetensors", {"lumenbridge_config": "{oops"})
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable LumenBridge checkpoint file"):
        VisualTokenizer.from_pretrained(directory)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_weights_load_in_the_dtype_they_were_saved_in(tmp_path, dtype):
    model = VisualTokenizer(SMALL, seed=0).to(dtype)
    with torch.no_grad():
        model.stages[0].dw.weight.add_(1e-12 if dtype == torch.float64 else 0.0)
    model.save_pretrained(tmp_path)
    loaded = VisualTokenizer.from_pretrained(tmp_path)
    for (name, saved_tensor), loaded_tensor in zip(
        model.state_dict().items(), loaded.state_dict().values(), strict=True
    ):
        assert loaded_tensor.dtype == saved_tensor.dtype and torch.equal(loaded_tensor, saved_tensor), name


@pytest.mark.parametrize("edit", ["act", "token_norm", "stage 1's norm"])
def test_an_edited_model_is_not_saved_as_its_config(tmp_path, edit):
    """The checkpoint records the config, so a model whose modules no longer
    match it would reload as another model: save refuses, naming the edit,
    and writes nothing."""
    model = VisualTokenizer(SMALL, seed=0)
    if edit == "act":
        model.act = torch.nn.GELU(approximate="tanh")
    elif edit == "token_norm":
        model.token_norm.eps = 1e-2
    else:
        model.stages[1].norm.eps = 0.5  # a BatchNorm's eps: the checkpoint would reload it as 1e-5
    with pytest.raises(ValueError, match=rf"cannot save this model: {edit}"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_model_of_mixed_dtypes_is_not_saved(tmp_path):
    model = VisualTokenizer(SMALL, seed=0)
    model.stages[0].double()
    with pytest.raises(ValueError, match="mix dtypes"):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _without_pw_bias(model):
    model.stages[0].pw = torch.nn.Conv2d(8, 8, 1, bias=False)


def _tie(model):
    model.stages[3].pw.bias = model.token_norm.bias


@pytest.mark.parametrize(
    "edit, message",
    [
        (_without_pw_bias, "do not fit its config: missing tensor 'stages.0.pw.bias'"),
        (
            lambda m: torch.nn.utils.parametrizations.weight_norm(m.stages[1].pw),
            r"missing tensor 'stages.1.pw.weight'.*remove_parametrizations",
        ),
        (lambda m: setattr(m, "head", torch.nn.Linear(2, 2)), "unexpected tensor 'head.weight'"),
        (lambda m: m.to(torch.float8_e4m3fn), "tensors are torch.float8_e4m3fn, which the model cannot run in"),
        (_tie, r"tensors 'stages.3.pw.bias', 'token_norm.bias' share memory"),
    ],
    ids=["no-bias", "parametrized", "extra-module", "float8", "tied"],
)
def test_a_model_that_would_not_load_is_not_saved(tmp_path, edit, message):
    """save_pretrained refuses what from_pretrained would refuse (or load
    untied), and writes nothing."""
    model = VisualTokenizer(SMALL, seed=0)
    edit(model)
    with pytest.raises(ValueError, match=message):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_file_is_not_taken_for_a_checkpoint_folder(saved):
    _, directory = saved
    with pytest.raises(ValueError, match="model.safetensors is a file: pass the folder that holds"):
        VisualTokenizer.from_pretrained(directory / "model.safetensors")


def test_a_new_config_refills_the_pixel_statistics_and_keeps_the_architecture():
    """The reference normalizes with the buffers, the native op with the
    config's statistics: a new config must reach both."""
    model = VisualTokenizer(SMALL, seed=0)
    config = dataclasses.replace(SMALL, mean=(0.5, 0.25, 0.0), std=(0.5, 1.0, 2.0), output_fmt="NHWC")
    model.config = config
    fresh = VisualTokenizer(config)
    assert torch.equal(model.pixel_mean, fresh.pixel_mean) and torch.equal(model.pixel_std, fresh.pixel_std)
    with pytest.raises(
        ValueError, match="cannot change embed_dim, stage_widths, stage_norm, which its parameters follow"
    ):
        model.config = TokenizerConfig()
    with pytest.raises(TypeError, match="config must be a TokenizerConfig, got dict"):
        model.config = {}
    assert model.config == config


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
        (
            lambda t: t.update({"stages.0.dw.bias": t["stages.0.dw.bias"].to(torch.int8)}),
            r"'stages.0.dw.bias' is stored as torch.int8 but the model holds torch.float32",
        ),
        (
            lambda t: t.update({"stages.0.dw.bias": t["stages.0.dw.bias"].double()}),
            r"floating-point tensors mix dtypes \['torch.float32', 'torch.float64'\]",
        ),
        (
            lambda t: t.update({name: tensor.to(torch.float8_e4m3fn) for name, tensor in t.items()}),
            r"tensors are torch.float8_e4m3fn, which the model cannot run in",
        ),
    ],
)
def test_mismatched_checkpoints_name_the_tensor(saved, edit, message):
    _, directory = saved
    _rewrite(directory, edit)
    with pytest.raises(ValueError, match=message):
        VisualTokenizer.from_pretrained(directory)


def test_a_config_json_that_is_not_utf8_is_named(saved):
    _, directory = saved
    (directory / "model.safetensors").unlink()  # the weights' copy of the config would be read first
    (directory / "config.json").write_bytes(b'{"embed_dim": "\xff"}')
    with pytest.raises(ValueError, match="config.json is not a readable LumenBridge checkpoint file"):
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
