"""Finding, decoding and preprocessing image files (lumenbridge.images)."""

from __future__ import annotations

import io
import os

import pytest
import torch
from conftest import save_image
from PIL import Image, ImageOps

from lumenbridge import images
from lumenbridge.images import (
    ImageFileDataset,
    collate_images,
    crop_box,
    decode_image,
    load_image,
    preprocess,
    sample_image_paths,
)


def save_truncated_png(path):
    Image.frombytes("RGB", (64, 64), os.urandom(64 * 64 * 3)).save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return str(path)


# --- sample photos ---------------------------------------------------------------------


def test_sample_photos_are_found_in_the_installed_scikit_image():
    paths = sample_image_paths()
    names = [os.path.basename(path) for path in paths]
    assert "astronaut.png" in names
    assert set(names) <= set(images.SAMPLE_IMAGE_NAMES)
    assert all(os.path.isfile(path) for path in paths)


# --- decoding -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "color", "expected"),
    [
        ("L", 77, (77, 77, 77)),
        ("RGBA", (10, 20, 30, 128), (132, 137, 142)),  # half transparent, over white
        ("RGB", (1, 2, 3), (1, 2, 3)),
    ],
)
def test_decoding_gives_rgb(tmp_path, mode, color, expected):
    path = save_image(tmp_path / "image.png", mode=mode, color=color)
    image = decode_image(path)
    assert image.mode == "RGB"
    assert image.getpixel((3, 3)) == expected


def test_palette_images_decode_to_their_rgb_colors(tmp_path):
    image = Image.new("P", (8, 8), 1)
    image.putpalette([0, 0, 0, 250, 120, 5] + [0] * 762)
    image.save(tmp_path / "palette.png")
    decoded = decode_image(tmp_path / "palette.png")
    assert decoded.mode == "RGB"
    assert decoded.getpixel((0, 0)) == (250, 120, 5)


def test_exif_orientation_is_applied(tmp_path):
    # Stored 40 wide x 20 high, red left and blue right; orientation 6 means
    # "rotate 90 degrees clockwise to display", which puts red on top.
    stored = Image.new("RGB", (40, 20), (0, 0, 255))
    stored.paste((255, 0, 0), (0, 0, 20, 20))
    exif = Image.Exif()
    exif[0x0112] = 6
    stored.save(tmp_path / "rotated.jpg", exif=exif, quality=95)
    upright = decode_image(tmp_path / "rotated.jpg")
    assert upright.size == (20, 40)
    top, bottom = upright.getpixel((10, 5)), upright.getpixel((10, 35))
    assert top[0] > 200 and top[2] < 50
    assert bottom[2] > 200 and bottom[0] < 50


@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_orientation_turns_as_pillows_exif_transpose_does(tmp_path, orientation):
    stored = Image.new("RGB", (6, 4))
    stored.putdata([(16 * index, 255 - 10 * index, 7 * index) for index in range(24)])
    exif = Image.Exif()
    exif[0x0112] = orientation
    stored.save(tmp_path / "o.png", exif=exif)
    want = ImageOps.exif_transpose(Image.open(tmp_path / "o.png")).convert("RGB")
    got = decode_image(tmp_path / "o.png")
    assert (got.mode, got.size, got.tobytes()) == (want.mode, want.size, want.tobytes())


def test_an_exif_tag_pillow_cannot_write_back_still_decodes_upright(tmp_path):
    """Rewriting the EXIF (what exif_transpose does) fails on a tag whose type
    does not match its value (AttributeError with Pillow 13, and the whole run
    stopped); only the orientation is read now."""
    stored = Image.new("RGB", (40, 20), (0, 0, 255))
    stored.paste((255, 0, 0), (0, 0, 20, 20))
    exif = Image.Exif()
    exif[0x0112] = 6
    exif[0x010F] = "Maker"
    exif[0x8769] = {0x9003: "2020:01:01 00:00:00"}  # data after Make's, so that a FLOAT still reads
    buffer = io.BytesIO()
    stored.save(buffer, "JPEG", exif=exif.tobytes(), quality=95)
    data = bytearray(buffer.getvalue())
    entry = data.find(b"\x01\x0f\x00\x02", data.find(b"Exif\0\0"))  # Make, ASCII (big-endian)
    data[entry + 3] = 11  # now FLOAT
    (tmp_path / "odd.jpg").write_bytes(bytes(data))
    upright = decode_image(tmp_path / "odd.jpg")
    assert upright.size == (20, 40) and upright.getpixel((10, 5))[0] > 200


def test_large_jpegs_are_decoded_at_reduced_scale_but_never_below_the_needed_side(tmp_path):
    Image.new("RGB", (1024, 768), (9, 99, 199)).save(tmp_path / "big.jpg")
    reduced = decode_image(tmp_path / "big.jpg", min_side=256)
    assert min(reduced.size) >= 256
    assert reduced.size[0] < 1024
    assert tuple(load_image(tmp_path / "big.jpg", 224).shape) == (3, 224, 224)


def test_the_decompression_bomb_limit_stays_on():
    assert Image.MAX_IMAGE_PIXELS is not None


# --- preprocessing --------------------------------------------------------------------


def test_preprocess_gives_a_uint8_square_of_the_image_size():
    tensor = preprocess(Image.new("RGB", (300, 200), (1, 2, 3)), image_size=224)
    assert tensor.dtype == torch.uint8
    assert tuple(tensor.shape) == (3, 224, 224)
    assert tensor[:, 100, 100].tolist() == [1, 2, 3]


def test_the_crop_box_is_the_central_square_after_scaling_the_shorter_side():
    # 400 x 300 scaled to a 256 shorter side is 341.3 x 256; its central 224
    # square is 262.5 source pixels wide.
    assert crop_box(400, 300, 256, 224) == (68.75, 18.75, 331.25, 281.25)
    assert crop_box(100, 200, 256, 224) == (6.25, 56.25, 93.75, 143.75)


def test_extreme_aspect_ratios_stay_cheap():
    # Resizing the whole 1 x 100000 strip first would allocate 256 x 25.6 M pixels.
    strip = Image.new("RGB", (1, 100_000), (7, 8, 9))
    tensor = preprocess(strip, image_size=224)
    assert tuple(tensor.shape) == (3, 224, 224)
    assert tensor[:, 0, 0].tolist() == [7, 8, 9]


def test_center_crop_takes_the_middle_of_the_image():
    # Shorter side already 256, so resizing is the identity and every pixel
    # encodes its own position: red = column, green = row % 256, blue = row // 256.
    width, height = 256, 512
    rows = torch.arange(height).view(height, 1).expand(height, width)
    columns = torch.arange(width).view(1, width).expand(height, width)
    pixels = torch.stack([columns, rows % 256, rows // 256], dim=-1).to(torch.uint8)
    image = Image.frombytes("RGB", (width, height), pixels.numpy().tobytes())

    crop = preprocess(image, image_size=224, resize=256)

    top, left = (512 - 224) // 2, (256 - 224) // 2
    expected = pixels[top : top + 224, left : left + 224].permute(2, 0, 1)
    assert torch.equal(crop, expected)


def test_resize_smaller_than_the_crop_is_rejected():
    with pytest.raises(ValueError, match="resize"):
        preprocess(Image.new("RGB", (300, 300)), image_size=224, resize=200)


# --- dataset and batching -------------------------------------------------------------


def test_dataset_returns_pixels_or_the_reason_a_file_is_unreadable(tmp_path):
    good = save_image(tmp_path / "good.png", color=(5, 6, 7))
    random_bytes = tmp_path / "bad.jpg"
    random_bytes.write_bytes(os.urandom(2000))
    truncated = save_truncated_png(tmp_path / "truncated.png")
    dataset = ImageFileDataset([good, str(random_bytes), truncated], image_size=32)

    assert len(dataset) == 3
    index, pixels, error = dataset[0]
    assert index == 0 and error is None
    assert tuple(pixels.shape) == (3, 32, 32) and pixels[:, 0, 0].tolist() == [5, 6, 7]
    index, pixels, error = dataset[1]
    assert index == 1 and pixels is None and "UnidentifiedImageError" in error
    index, pixels, error = dataset[2]
    assert index == 2 and pixels is None and "truncated" in error


def test_decompression_bombs_are_reported_not_raised(tmp_path, monkeypatch):
    path = save_image(tmp_path / "huge.png", size=(300, 300))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    _, pixels, error = ImageFileDataset([path], image_size=32)[0]
    assert pixels is None and "DecompressionBombError" in error


def test_a_file_that_vanished_is_reported(tmp_path):
    _, pixels, error = ImageFileDataset([str(tmp_path / "gone.png")], image_size=32)[0]
    assert pixels is None and "FileNotFoundError" in error


def test_collate_stacks_the_good_images_and_keeps_failures_aside(tmp_path):
    paths = [save_image(tmp_path / "a.png"), str(tmp_path / "missing.png"), save_image(tmp_path / "c.png")]
    dataset = ImageFileDataset(paths, image_size=16)
    batch = collate_images([dataset[i] for i in range(3)])
    assert batch.indices == [0, 2]
    assert tuple(batch.pixels.shape) == (2, 3, 16, 16)
    assert [index for index, _ in batch.failures] == [1]


def test_collate_of_only_failures_has_no_pixels(tmp_path):
    dataset = ImageFileDataset([str(tmp_path / "missing.png")], image_size=16)
    batch = collate_images([dataset[0]])
    assert batch.indices == [] and batch.pixels is None and len(batch.failures) == 1


def test_dataloader_workers_give_the_same_batches_as_the_main_process(tmp_path):
    paths = [save_image(tmp_path / f"{i}.png", color=(i * 40, 0, 0)) for i in range(5)]
    dataset = ImageFileDataset(paths, image_size=16)

    def load_all(workers):
        loader = torch.utils.data.DataLoader(dataset, batch_size=2, num_workers=workers, collate_fn=collate_images)
        return [(batch.indices, batch.pixels) for batch in loader]

    serial, parallel = load_all(0), load_all(2)
    assert [indices for indices, _ in parallel] == [[0, 1], [2, 3], [4]]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(serial, parallel))


def test_a_folder_that_cannot_be_read_is_named_not_skipped(tmp_path, monkeypatch):
    """os.walk passes over a folder it cannot list unless told otherwise; its
    images would be left out of a run that reports success."""
    save_image(tmp_path / "a.png")
    (tmp_path / "locked").mkdir()
    save_image(tmp_path / "locked" / "b.png")
    scandir = os.scandir

    def refusing(path="."):
        if os.fspath(path) == str(tmp_path / "locked"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refusing)
    with pytest.raises(ValueError, match=r"cannot read folder .*locked: Permission denied"):
        list(images.images_in_folder(tmp_path))
