"""Native-resolution packing: VisualTokenizer.forward_packed, cu_seqlens, grids,
positions, batching by size, the token-budget resize and the errors users see."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import device_params

from lumenbridge import TokenizerConfig, VisualTokenizer
from lumenbridge.packing import cumulative_lengths, fit_token_budget, resize_to_token_budget

SMALL = dataclasses.replace(TokenizerConfig(), embed_dim=32, stage_widths=(8, 16, 16, 32))
SIZES = [(32, 48), (64, 16), (32, 48), (16, 16), (48, 32), (64, 16)]


def make(fmt="NLC", **kwargs):
    return VisualTokenizer(dataclasses.replace(SMALL, output_fmt=fmt), seed=0, **kwargs).eval()


def own_tokens(model, image):
    """The image's tokens from its own forward, as [N, D]."""
    out = model(image[None])[0]
    fmt = model.config.output_fmt
    return out.permute(1, 2, 0).flatten(0, 1) if fmt == "NCHW" else out.flatten(0, 1) if fmt == "NHWC" else out


@pytest.mark.parametrize("fmt", ["NLC", "NCHW", "NHWC"])
def test_each_image_gets_the_tokens_of_its_own_forward(fmt):
    model = make(fmt)
    images = [torch.randn(3, *size) for size in SIZES]
    with torch.no_grad():
        packed = model.forward_packed(images)
        pieces = packed.unpack()
        assert len(pieces) == len(images)
        for image, piece in zip(images, pieces):
            expected = own_tokens(model, image)
            assert piece.dtype == expected.dtype
            torch.testing.assert_close(piece, expected, rtol=1e-5, atol=1e-5)


def test_layout_tensors_describe_the_packed_sequence():
    model = make()
    images = [torch.randn(3, *size) for size in SIZES]
    with torch.no_grad():
        packed = model.forward_packed(images)
    grids = [(h // 16, w // 16) for h, w in SIZES]  # [(2, 3), (4, 1), (2, 3), (1, 1), (3, 2), (4, 1)]
    lengths = [rows * cols for rows, cols in grids]
    assert packed.tokens.shape == (sum(lengths), 32)
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, 6, 10, 16, 17, 23, 27]
    assert packed.grid_hw.dtype == torch.int64 and packed.grid_hw.tolist() == [list(g) for g in grids]
    assert packed.max_seqlen == 6
    assert packed.positions.dtype == torch.int64 and packed.positions.shape == (27, 2)
    # Image 0 is 2 x 3, row-major; image 1 (4 x 1) starts again at (0, 0).
    assert packed.positions[:10].tolist() == [
        [0, 0],
        [0, 1],
        [0, 2],
        [1, 0],
        [1, 1],
        [1, 2],
        [0, 0],
        [1, 0],
        [2, 0],
        [3, 0],
    ]
    for i, (rows, cols) in enumerate(grids):
        span = packed.positions[packed.cu_seqlens[i] : packed.cu_seqlens[i + 1]]
        assert span.tolist() == [[r, c] for r in range(rows) for c in range(cols)]


def test_images_of_one_size_run_as_one_batch():
    model = make()
    batch_sizes = []
    # A hook on the whole model: the native backend runs all stages as one op, past the stage modules.
    model.register_forward_pre_hook(lambda module, args: batch_sizes.append(args[0].shape[0]))
    with torch.no_grad():
        model.forward_packed([torch.randn(3, *size) for size in SIZES])
    assert sorted(batch_sizes) == [1, 1, 2, 2]  # (32, 48) x 2, (64, 16) x 2, (16, 16), (48, 32)


def test_uint8_and_bfloat16_images_keep_their_forward_dtype():
    images = [torch.randint(0, 256, (3, *size), dtype=torch.uint8) for size in SIZES[:3]]
    model = make()
    with torch.no_grad():
        packed = model.forward_packed(images)
        assert packed.tokens.dtype == torch.float32
        torch.testing.assert_close(packed.unpack()[1], own_tokens(model, images[1]), rtol=1e-5, atol=1e-5)
    model = make().to(torch.bfloat16)
    with torch.no_grad():
        packed = model.forward_packed([image.to(torch.bfloat16) for image in images])
        assert packed.tokens.dtype == torch.bfloat16
        torch.testing.assert_close(packed.unpack()[0], own_tokens(model, images[0].to(torch.bfloat16)))


def test_dynamic_pad_packs_any_size_at_least_the_stride():
    model = make(dynamic_pad=True)
    images = [torch.randn(3, 35, 50), torch.randn(3, 16, 17)]
    with torch.no_grad():
        packed = model.forward_packed(images)
        assert packed.grid_hw.tolist() == [[3, 4], [1, 2]]
        torch.testing.assert_close(packed.unpack()[0], own_tokens(model, images[0]), rtol=1e-5, atol=1e-5)


def test_gradients_flow_back_to_each_image_and_the_parameters():
    model = make().train()
    images = [torch.randn(3, *size, requires_grad=True) for size in SIZES[:3]]
    weights = torch.randn(sum(math.prod(s) // 256 for s in SIZES[:3]), 32)
    (model.forward_packed(images).tokens * weights).sum().backward()
    packed_grads = [image.grad.clone() for image in images]
    # The same loss image by image gives the same input gradients.
    start = 0
    for image, grad in zip(images, packed_grads):
        image.grad = None
        tokens = own_tokens(model, image)
        (tokens * weights[start : start + len(tokens)]).sum().backward()
        start += len(tokens)
        torch.testing.assert_close(image.grad, grad, rtol=1e-4, atol=1e-5)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_cumulative_lengths():
    assert cumulative_lengths([3, 1, 4]).tolist() == [0, 3, 4, 8]
    assert cumulative_lengths([3]).dtype == torch.int32


@pytest.mark.parametrize(
    "images, error, message",
    [
        ([], ValueError, "empty list"),
        (torch.randn(2, 3, 32, 32), TypeError, "list of"),
        ([torch.randn(3, 32, 32), "image"], TypeError, "image 1 must be a torch.Tensor"),
        ([torch.randn(1, 3, 32, 32)], ValueError, r"image 0 must be 3-D \[C, H, W\]"),
        (
            [torch.randn(3, 32, 32), torch.randn(4, 32, 32)],
            ValueError,
            r"image 1 \(\(4, 32, 32\)\): images have 4 channels but the model expects 3",
        ),
        ([torch.randn(3, 32, 32), torch.randn(3, 8, 32)], ValueError, "image 1 .*smaller than the total stride 16"),
        ([torch.randn(3, 40, 32)], ValueError, "image 0 .*not a multiple of the total stride 16.*dynamic_pad"),
        (
            [torch.randn(3, 32, 32), torch.randn(3, 32, 32, dtype=torch.float64)],
            TypeError,
            "image 1 is torch.float64 but image 0 is torch.float32",
        ),
        (
            [torch.randn(3, 32, 32), torch.empty(3, 32, 32, device="meta")],
            ValueError,
            "image 1 is on meta but image 0 is on cpu",
        ),
        ([torch.zeros(3, 32, 32, dtype=torch.int16)], TypeError, "image 0 .*must be uint8 .* or floating point"),
    ],
)
def test_bad_input_raises_clear_errors(images, error, message):
    with pytest.raises(error, match=message):
        make().forward_packed(images)


def test_check_finite_names_the_image():
    model = make()
    model.check_finite = True
    with pytest.raises(ValueError, match="image 1 .*NaN or Inf"):
        model.forward_packed([torch.randn(3, 32, 32), torch.full((3, 32, 48), float("nan"))])


def test_images_on_another_device_than_the_model_are_rejected():
    with pytest.raises(ValueError, match="image 0 .*images are on meta but the model is on cpu"):
        make().forward_packed([torch.empty(3, 32, 32, device="meta")])


@pytest.mark.parametrize("train, track", [(True, True), (False, False)])
def test_forward_packed_refuses_batchnorm_on_batch_statistics(train, track):
    model = make()
    model.stages[1].norm = torch.nn.BatchNorm2d(16, track_running_stats=track)
    model.train(train)
    images = [torch.rand(3, *size) for size in SIZES]
    with pytest.raises(ValueError, match=r"stages.1.norm normalizes with batch statistics.*model.eval\(\)"):
        model.forward_packed(images)
    model.stages[1].norm = torch.nn.BatchNorm2d(16)
    model.eval()  # running statistics: each image its own
    with torch.no_grad():
        packed = model.forward_packed(images)
        torch.testing.assert_close(packed.tokens[: packed.cu_seqlens[1]], own_tokens(model, images[0]))


@pytest.mark.parametrize("height", [1, 7, 16, 90, 333, 1000, 4000])
@pytest.mark.parametrize("width", [1, 16, 50, 480, 640, 2500, 100000])
@pytest.mark.parametrize("max_tokens", [1, 64, 256, 1024])
def test_fit_token_budget_stays_within_the_budget_in_stride_multiples(height, width, max_tokens):
    new_height, new_width = fit_token_budget(height, width, 16, max_tokens=max_tokens)
    assert new_height % 16 == 0 and new_width % 16 == 0 and new_height >= 16 and new_width >= 16
    assert (new_height // 16) * (new_width // 16) <= max_tokens


def test_fit_token_budget_keeps_the_aspect_ratio():
    assert fit_token_budget(1000, 600, 16, max_tokens=256) == (320, 192)  # 20 x 12 = 240 tokens
    height, width = fit_token_budget(480, 640, 14, max_tokens=100)
    assert abs(height / width - 0.75) < 0.1
    assert fit_token_budget(224, 224, 16, max_tokens=256) == (224, 224)  # already within: only rounded
    assert fit_token_budget(230, 250, 16) == (224, 256)  # no budget: each side to the nearest multiple


def test_fit_token_budget_grows_small_images_to_min_tokens():
    height, width = fit_token_budget(20, 30, 16, min_tokens=64)
    assert (height // 16) * (width // 16) >= 64
    assert (height, width) == (112, 160)
    height, width = fit_token_budget(20, 30, 16, min_tokens=64, max_tokens=64)
    assert (height, width) == (128, 128)  # 8 x 8, the only grid of 64 tokens near 2:3 in range
    assert fit_token_budget(20, 30, 16, min_tokens=60, max_tokens=64) == (96, 160)  # 6 x 10, nearer 2:3 than 7 x 9


@pytest.mark.parametrize("height", [1, 20, 333, 1000])
@pytest.mark.parametrize("width", [1, 30, 600, 100000])
@pytest.mark.parametrize("budget", [(1, 1), (60, 64), (64, 64), (250, 256), (7, 7)])
def test_fit_token_budget_reaches_min_tokens_whatever_the_rounding(height, width, budget):
    low, high = budget
    new_height, new_width = fit_token_budget(height, width, 16, min_tokens=low, max_tokens=high)
    assert low <= (new_height // 16) * (new_width // 16) <= high


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens must be a positive integer, got 0"),
        ({"min_tokens": -1}, "min_tokens must be a positive integer, got -1"),
        ({"max_tokens": 24.5}, "max_tokens must be a positive integer, got 24.5"),
        ({"max_tokens": True}, "max_tokens must be a positive integer, got True"),
        ({"min_tokens": 10, "max_tokens": 5}, r"min_tokens \(10\) is larger than max_tokens \(5\)"),
    ],
)
def test_fit_token_budget_rejects_bad_budgets(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fit_token_budget(100, 100, 16, **kwargs)


@pytest.mark.parametrize("size", [(100.7, 100), (100, 0), (True, 100)])
def test_fit_token_budget_rejects_sizes_that_are_not_positive_integers(size):
    with pytest.raises(ValueError, match="image size must be positive integers"):
        fit_token_budget(*size, 16, max_tokens=64)


@pytest.mark.parametrize("stride", [0, -16, 2.5, 16.0, True])
def test_fit_token_budget_rejects_a_stride_that_is_not_a_positive_integer(stride):
    with pytest.raises(ValueError, match="stride must be a positive integer"):
        fit_token_budget(100, 100, stride, max_tokens=64)


def test_resize_to_token_budget_keeps_dtype_and_feeds_forward_packed():
    images = [torch.randint(0, 256, (3, 300, 200), dtype=torch.uint8), torch.rand(3, 90, 400)]
    resized = [resize_to_token_budget(image, 16, max_tokens=24) for image in images]
    assert [r.dtype for r in resized] == [torch.uint8, torch.float32]
    assert [tuple(r.shape[1:]) for r in resized] == [(96, 64), (32, 160)]  # 6 x 4 and 2 x 10 tokens
    assert resize_to_token_budget(resized[0], 16, max_tokens=24) is resized[0]  # already fits
    with torch.no_grad():
        packed = make().forward_packed([resized[0].float() / 255, resized[1]])
    assert packed.grid_hw.tolist() == [[6, 4], [2, 10]]
    with pytest.raises(ValueError, match=r"\[C, H, W\]"):
        resize_to_token_budget(torch.rand(1, 3, 32, 32), 16, max_tokens=4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_resize_to_token_budget_takes_half_types(dtype):
    image = torch.rand(3, 300, 200)
    resized = resize_to_token_budget(image.to(dtype), 16, max_tokens=24)
    assert resized.dtype == dtype and resized.shape == (3, 96, 64)
    expected = resize_to_token_budget(image.to(dtype).float(), 16, max_tokens=24)
    torch.testing.assert_close(resized, expected.to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("device", device_params())
def test_resize_to_token_budget_takes_uint8_on_every_device(device):
    """Rounded from the float32 resize, which every device has (CUDA has no
    antialiased uint8 kernel)."""
    image = torch.randint(0, 256, (3, 300, 200), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    resized = resize_to_token_budget(image.to(device), 16, max_tokens=24)
    assert resized.dtype == torch.uint8 and resized.shape == (3, 96, 64) and resized.device.type == device
    expected = resize_to_token_budget(image.float(), 16, max_tokens=24).round().clamp(0, 255).to(torch.uint8)
    difference = (resized.cpu().int() - expected.int()).abs().max().item()
    assert difference <= (0 if device == "cpu" else 1)  # another device's float32 rounding may move a half
