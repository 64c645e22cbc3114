"""`lumenbridge tokenize --max-tokens`: native-resolution tokens, packed, from image files."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from safetensors import safe_open

from lumenbridge import TokenizerConfig, VisualTokenizer, cli
from lumenbridge.images import DEFAULT_MAX_PIXELS, WHITE
from lumenbridge.packed_files import concatenate_releasing, load_image_in_budget, tokenize_files_packed
from lumenbridge.packing import fit_token_budget

SMALL = "lumenbridge-small"
FAST = ["--preset", SMALL, "--workers", "0", "--device", "cpu"]


def save_noise(path, size, seed):
    """Seeded noise: a flip, a turn or another image's pixels change every token."""
    pixels = torch.randint(
        0, 256, (size[1], size[0], 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )
    Image.fromarray(pixels.numpy()).save(path)
    return str(path)


@pytest.fixture
def photos(tmp_path):
    # (width, height): landscape, portrait, square, and one far over a 24-token budget.
    sizes = [(300, 200), (120, 250), (64, 64), (2000, 900)]
    return [save_noise(tmp_path / f"photo{i}.png", size, seed=i) for i, size in enumerate(sizes)]


def read(path):
    with safe_open(path, framework="pt") as file:
        return {name: file.get_tensor(name) for name in file.keys()}, file.metadata()  # noqa: SIM118 - not iterable


def test_max_tokens_writes_packed_tokens_with_their_layout(tmp_path, photos, capsys):
    out = tmp_path / "packed.safetensors"
    assert cli.main(["tokenize", *photos, "--out", str(out), "--max-tokens", "24", "--batch-size", "3", *FAST]) == 0
    tensors, metadata = read(out)
    grid_hw = tensors["grid_hw"]
    assert grid_hw.dtype == torch.int64 and grid_hw.shape == (4, 2)
    lengths = (grid_hw[:, 0] * grid_hw[:, 1]).tolist()
    assert all(n <= 24 for n in lengths)
    assert grid_hw.tolist()[2] == [4, 4]  # 64 x 64 fits as it is
    rows, columns = grid_hw.tolist()[0]  # 300 x 200 stays landscape
    assert columns > rows
    rows, columns = grid_hw.tolist()[1]  # 120 x 250 stays portrait
    assert rows > columns
    assert tensors["cu_seqlens"].dtype == torch.int32
    assert tensors["cu_seqlens"].tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert tensors["tokens"].shape == (sum(lengths), 384)
    assert json.loads(metadata["paths"]) == photos
    preprocess = {"max_tokens": 24, "background": list(WHITE), "max_pixels": DEFAULT_MAX_PIXELS}
    assert json.loads(metadata["preprocess"]) == preprocess

    # Each image's rows are its own forward on the budget-resized pixels.
    model = VisualTokenizer(TokenizerConfig.preset(SMALL), seed=0).eval()
    starts = tensors["cu_seqlens"].tolist()
    for i, path in enumerate(photos):
        with torch.no_grad():
            expected = model(load_image_in_budget(path, 16, 24)[None])[0]
        torch.testing.assert_close(tensors["tokens"][starts[i] : starts[i + 1]], expected, rtol=1e-4, atol=1e-4)
    assert f"tokenized 4 images -> tokens [{sum(lengths)}, 384]" in capsys.readouterr().out


def test_unreadable_images_are_skipped_and_the_rest_packed(tmp_path, photos, capsys):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a png")
    out = tmp_path / "packed.safetensors"
    code = cli.main(["tokenize", photos[0], str(bad), photos[2], "--out", str(out), "--max-tokens", "16", *FAST])
    assert code == 1
    assert "bad.png" in capsys.readouterr().err
    tensors, metadata = read(out)
    assert json.loads(metadata["paths"]) == [photos[0], photos[2]]
    assert len(tensors["grid_hw"]) == 2 and tensors["cu_seqlens"][-1] == len(tensors["tokens"])


def test_no_readable_image_writes_nothing(tmp_path, capsys):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a png")
    out = tmp_path / "packed.safetensors"
    assert cli.main(["tokenize", str(bad), "--out", str(out), "--max-tokens", "16", *FAST]) == 2
    assert "no output written" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--max-tokens", "0"], "--max-tokens must be positive"),
        (["--max-tokens", "16", "--image-size", "64"], "cannot go with --image-size or --resize"),
        (["--max-tokens", "16", "--resize", "300"], "cannot go with --image-size or --resize"),
    ],
)
def test_bad_max_tokens_is_a_usage_error(tmp_path, photos, capsys, extra, message):
    out = tmp_path / "packed.safetensors"
    assert cli.main(["tokenize", photos[0], "--out", str(out), *extra, *FAST]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_tokenize_files_packed_stores_the_requested_dtype(photos):
    model = VisualTokenizer(TokenizerConfig.preset(SMALL), seed=0).eval()
    result = tokenize_files_packed(model, photos[:2], max_tokens=12, dtype=torch.bfloat16, progress=False)
    assert result.tokens.dtype == torch.bfloat16
    assert result.paths == photos[:2] and result.failures == []
    assert int(result.cu_seqlens[-1]) == len(result.tokens) <= 24


@pytest.mark.parametrize("max_tokens", [0, 2.5, None])
def test_tokenize_files_packed_refuses_a_bad_budget_before_reading_any_image(photos, max_tokens):
    model = VisualTokenizer(TokenizerConfig.preset(SMALL), seed=0).eval()
    with pytest.raises(ValueError, match="max_tokens"):
        tokenize_files_packed(model, photos[:2], max_tokens=max_tokens, progress=False)


def save_jpeg(path, size, orientation=1):
    pixels = torch.randint(0, 256, (size[1], size[0], 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(pixels.numpy()).save(path, quality=90, exif=exif)
    return str(path)


def test_the_budget_decodes_a_large_jpeg_reduced_and_counts_its_pixels_there(tmp_path):
    """As the crop path does: a 2400 x 1600 photo for 64 tokens decodes at a
    quarter of its size, so a pixel limit between the two admits it."""
    photo = save_jpeg(tmp_path / "photo.jpg", (2400, 1600))
    pixels = load_image_in_budget(photo, 16, 64, max_pixels=1_500_000)
    assert pixels.shape == (3, *fit_token_budget(1600, 2400, 16, max_tokens=64)) == (3, 96, 144)
    assert (
        cli.main(
            ["tokenize", photo, "--out", str(tmp_path / "p.safetensors"), "--max-tokens", "64"]
            + ["--max-pixels", "1500000", *FAST]
        )
        == 0
    )


def test_the_budget_follows_the_exif_orientation(tmp_path):
    photo = save_jpeg(tmp_path / "turned.jpg", (2400, 1600), orientation=6)  # stored landscape, shown portrait
    assert load_image_in_budget(photo, 16, 64).shape == (3, 144, 96)


def test_the_packed_tokens_are_concatenated_releasing_each_batch():
    pieces = [torch.randn(n, 4) for n in (3, 1, 5)]
    expected = torch.cat(pieces)
    held = list(pieces)
    assert torch.equal(concatenate_releasing(held), expected)
    assert held == []  # each batch let go once copied
