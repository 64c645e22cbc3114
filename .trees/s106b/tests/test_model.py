"""VisualTokenizer behaviour on its default backend for the input (the CPU:
native for NCHW, the reference for channels-last): shapes, formats, input
kinds, layouts, padding and the errors users see."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lumenbridge import TokenizerConfig, VisualTokenizer

BASE = TokenizerConfig.preset("lumenbridge-base")
# A narrow config keeps the tests fast; the structure is the base preset's.
SMALL = dataclasses.replace(BASE, embed_dim=32, stage_widths=(8, 16, 16, 32))


def make(fmt="NLC", **kwargs):
    return VisualTokenizer(dataclasses.replace(SMALL, output_fmt=fmt), seed=0, **kwargs).eval()


def test_base_preset_turns_224_images_into_196_tokens_of_768():
    model = VisualTokenizer(BASE, seed=0).eval()
    with torch.no_grad():
        tokens = model(torch.randint(0, 256, (2, 3, 224, 224), dtype=torch.uint8))
    assert tokens.shape == (2, 196, 768)
    assert torch.isfinite(tokens).all()


@pytest.mark.parametrize(
    "fmt, size, expected",
    [
        ("NLC", (64, 96), (2, 24, 32)),  # non-square
        ("NCHW", (64, 96), (2, 32, 4, 6)),
        ("NHWC", (64, 96), (2, 4, 6, 32)),
        ("NLC", (48, 80), (2, 15, 32)),  # odd multiples of the stride: 3 x 5 tokens
        ("NLC", (16, 16), (2, 1, 32)),  # one token
    ],
)
def test_output_formats_and_sizes(fmt, size, expected):
    model = make(fmt)
    with torch.no_grad():
        out = model(torch.randn(2, 3, *size))
    assert out.shape == expected
    assert model.feature_size(*size) == (size[0] // 16, size[1] // 16)


@pytest.mark.parametrize("size", [(224.0, 320), (224, True)])
def test_feature_size_refuses_sides_that_are_not_integers(size):
    with pytest.raises(TypeError, match="image sides must be integers"):
        make("NLC").feature_size(*size)


def test_output_formats_hold_the_same_values():
    x = torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        nlc, nchw, nhwc = (make(fmt)(x) for fmt in ("NLC", "NCHW", "NHWC"))
    torch.testing.assert_close(nchw.permute(0, 2, 3, 1), nhwc, rtol=0, atol=0)
    torch.testing.assert_close(nhwc.flatten(1, 2), nlc, rtol=0, atol=0)


def test_uint8_path_equals_float_path_after_normalization():
    model = make()
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    mean = torch.tensor(SMALL.mean).view(1, 3, 1, 1)
    std = torch.tensor(SMALL.std).view(1, 3, 1, 1)
    normalized = (images.double() / 255.0 - mean) / std
    with torch.no_grad():
        torch.testing.assert_close(model(images), model(normalized.float()), rtol=1e-5, atol=1e-5)


def test_channels_last_input_gives_the_same_tokens():
    model = make()
    x = torch.randn(2, 3, 32, 48)
    with torch.no_grad():
        torch.testing.assert_close(
            model(x.contiguous(memory_format=torch.channels_last)), model(x), rtol=1e-5, atol=1e-5
        )


def test_strided_view_input_is_accepted():
    model = make()
    x = torch.randn(2, 3, 32, 96)
    with torch.no_grad():
        torch.testing.assert_close(model(x[..., ::2]), model(x[..., ::2].contiguous()), rtol=0, atol=0)


def test_dynamic_pad_pads_to_the_next_multiple():
    model = make(dynamic_pad=True)
    x = torch.randn(1, 3, 35, 50)
    assert model.feature_size(35, 50) == (3, 4)
    padded = torch.nn.functional.pad(x, (0, 14, 0, 13))
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(padded), rtol=0, atol=0)


def test_training_step_reaches_every_parameter():
    model = make().train()
    model(torch.randn(2, 3, 32, 32)).square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize(
    "images, error, message",
    [
        ([[1.0]], TypeError, "torch.Tensor"),
        (torch.randn(3, 32, 32), ValueError, "4-D"),
        (torch.randn(1, 1, 3, 32, 32), ValueError, "4-D"),
        (torch.randn(1, 4, 32, 32), ValueError, "channels"),
        (torch.randn(1, 3, 8, 32), ValueError, "smaller than the total stride"),
        (torch.randn(1, 3, 40, 32), ValueError, "dynamic_pad"),
        (torch.randint(0, 9, (1, 3, 32, 32), dtype=torch.int32), TypeError, "int32"),
        (torch.zeros(1, 3, 32, 32, dtype=torch.bool), TypeError, "bool"),
        (torch.zeros(1, 3, 32, 32, dtype=torch.complex64), TypeError, "complex64"),
    ],
)
def test_bad_images_raise_clear_errors(images, error, message):
    with pytest.raises(error, match=message):
        make()(images)


def test_images_on_another_device_are_rejected():
    with pytest.raises(ValueError, match="images are on meta but the model is on cpu"):
        make()(torch.empty(1, 3, 32, 32, device="meta"))


def test_a_preset_name_instead_of_a_config_is_a_clear_type_error():
    with pytest.raises(TypeError, match="TokenizerConfig.preset"):
        VisualTokenizer("lumenbridge-base")


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_check_finite_rejects_non_finite_values(bad_value):
    x = torch.randn(1, 3, 32, 32)
    x[0, 1, 5, 7] = bad_value
    with pytest.raises(ValueError, match="NaN or Inf"):
        make(check_finite=True)(x)
    assert not torch.isfinite(make()(x)).all()  # without the option the value flows through


def test_check_finite_judges_values_in_the_models_dtype():
    """1e5 is finite in float32 but not in float16, where the model computes."""
    x = torch.randn(1, 3, 32, 32)
    x[0, 0, 0, 0] = 1e5
    with pytest.raises(ValueError, match="NaN or Inf values \\(in the model's dtype, torch.float16\\)"):
        make(check_finite=True).half()(x)


def test_images_in_another_layout_are_a_clear_type_error():
    with pytest.raises(TypeError, match="must be a dense tensor, got layout torch.sparse_coo"):
        make()(torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8).to_sparse())


def test_pixel_statistics_survive_casts_and_to_empty():
    """uint8 images are normalized with the config's mean and std: a cast
    to bfloat16 and back, or a model built on the meta device and
    materialized with to_empty, must not change them."""
    model = make(backend="reference")
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    with torch.no_grad():
        want = model(images)
        round_trip = make(backend="reference").bfloat16().float()
        round_trip.load_state_dict(model.state_dict())  # the weights as they were; the statistics as cast
        assert torch.equal(round_trip.pixel_mean, model.pixel_mean)
        assert torch.equal(round_trip(images), want)
        with torch.device("meta"):
            empty = VisualTokenizer(SMALL, backend="reference").eval()
        empty.to_empty(device="cpu").load_state_dict(model.state_dict())
        assert torch.equal(empty(images), want)
        exact = torch.tensor(SMALL.pixel_mean, dtype=torch.float64).view(1, -1, 1, 1)
        assert torch.equal(make().double().pixel_mean, exact)  # not float32's rounding of it


def test_seed_makes_initialization_reproducible():
    a, b, c = make(), make(), VisualTokenizer(SMALL, seed=1)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.state_dict().values(), c.state_dict().values()))


@pytest.mark.parametrize("norm", ["batchnorm", "layernorm"])
def test_stage_norms_run(norm):
    model = VisualTokenizer(dataclasses.replace(SMALL, stage_norm=norm), seed=0).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 4, 32)
