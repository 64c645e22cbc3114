import json

import pytest

from lumenbridge import PRESETS, TokenizerConfig


def test_base_preset_matches_the_specification():
    cfg = TokenizerConfig.preset("lumenbridge-base")
    assert cfg.stage_widths == (96, 192, 384, 768)
    assert cfg.embed_dim == 768
    assert cfg.kernel_size == 3 and cfg.strides == (2, 2, 2, 2)
    assert cfg.activation == "gelu" and cfg.token_norm and cfg.stage_norm == "none"
    assert cfg.total_stride == 16


def test_presets_have_small_and_large_variants():
    dims = sorted(cfg.embed_dim for cfg in PRESETS.values())
    assert dims == [384, 768, 1024]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_json_round_trip(name):
    cfg = PRESETS[name]
    text = cfg.to_json()
    assert json.loads(text)["stage_widths"] == list(cfg.stage_widths)
    assert TokenizerConfig.from_json(text) == cfg


def test_unknown_json_key_is_named():
    data = TokenizerConfig().to_dict() | {"patch_size": 16}
    with pytest.raises(ValueError, match="patch_size"):
        TokenizerConfig.from_dict(data)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match="lumenbridge-base"):
        TokenizerConfig.preset("nope")


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"embed_dim": 512}, "embed_dim"),
        ({"strides": (2, 2, 2)}, "strides"),
        ({"strides": (2, 3, 2, 2)}, "stride"),
        ({"kernel_size": 4}, "kernel_size"),
        ({"activation": "tanh"}, "activation"),
        ({"stage_norm": "groupnorm"}, "stage_norm"),
        ({"output_fmt": "NLD"}, "output_fmt"),
        ({"std": (1.0, 0.0, 1.0)}, "std"),
        ({"mean": (0.5,)}, "mean"),
        ({"image_size": 200}, "image_size"),
    ],
)
def test_invalid_configs_are_rejected_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        TokenizerConfig(**changes)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"kernel_size": 3.0}, "kernel_size must be an int"),
        ({"image_size": True}, "image_size must be an int"),
        ({"strides": (2.0, 2, 2, 2)}, "strides must hold ints"),
        ({"stage_widths": (96, 192, 384, 768.0)}, "stage_widths must hold ints"),
        ({"mean": (0.5, float("nan"), 0.5)}, "mean must hold finite numbers"),
        ({"token_norm": "yes"}, "token_norm must be true or false"),
    ],
)
def test_wrong_types_are_rejected_by_name(changes, message):
    with pytest.raises(TypeError, match=message):
        TokenizerConfig(**changes)


def test_json_that_is_not_an_object_is_rejected():
    with pytest.raises(TypeError, match="expected a JSON object, got list"):
        TokenizerConfig.from_json("[1, 2]")
