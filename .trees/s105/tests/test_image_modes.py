"""Decoding every image mode to 8-bit RGB with known values, transparency
composited onto the background, and the pixel limit (lumenbridge.images)."""

from __future__ import annotations

import struct
import warnings
import zlib

import pytest
from PIL import Image

from lumenbridge.images import DEFAULT_MAX_PIXELS, ImageFileDataset, decode_image, to_rgb

BLACK = (0, 0, 0)


def image_with(mode, values, size=None):
    """An image of `mode` holding `values` in a row (one pixel each)."""
    image = Image.new(mode, size or (len(values), 1))
    for x, value in enumerate(values):
        image.putpixel((x, 0), value)
    return image


def row(image):
    return [image.getpixel((x, 0)) for x in range(image.width)]


def gray(*values):
    return [(v, v, v) for v in values]


# --- high bit depths are scaled, not clipped ------------------------------------------


def test_a_16_bit_grayscale_png_gradient_keeps_its_gradient(tmp_path):
    path = tmp_path / "gradient16.png"
    image_with("I;16", [0, 257, 32768, 65535]).save(path)
    assert Image.open(path).mode == "I;16"
    assert row(decode_image(path)) == gray(0, 1, 128, 255)


@pytest.mark.parametrize("mode", ["I;16", "I;16B", "I;16L", "I"])
def test_16_bit_integer_modes_scale_0_to_65535_onto_0_to_255(mode):
    assert row(to_rgb(image_with(mode, [0, 514, 32768, 65535]))) == gray(0, 2, 128, 255)


def test_32_bit_integers_beyond_16_bits_are_clipped():
    assert row(to_rgb(image_with("I", [70000, -5]))) == gray(255, 0)


def test_float_images_scale_0_to_1_onto_0_to_255_and_clip_beyond():
    assert row(to_rgb(image_with("F", [0.0, 0.5, 1.0, 2.0, -1.0]))) == gray(0, 128, 255, 255, 0)


@pytest.mark.parametrize(
    ("mode", "suffix"), [("I;16B", ".tif"), ("I", ".tif"), ("F", ".tif"), ("I;16", ".png")], ids=str
)
def test_wide_modes_decode_from_files(tmp_path, mode, suffix):
    path = tmp_path / f"wide{suffix}"
    values = [0.0, 0.5, 1.0] if mode == "F" else [0, 32768, 65535]
    image_with(mode, values).save(path)
    assert row(decode_image(path)) == gray(0, 128, 255)


# --- colour modes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "values", "expected"),
    [
        ("1", [0, 1], gray(0, 255)),
        ("L", [0, 77, 255], gray(0, 77, 255)),
        ("RGB", [(1, 2, 3)], [(1, 2, 3)]),
        ("CMYK", [(0, 0, 0, 0), (255, 0, 0, 0), (0, 0, 0, 255)], [(255, 255, 255), (0, 255, 255), (0, 0, 0)]),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_colour_modes_decode_to_known_rgb(mode, values, expected):
    assert row(to_rgb(image_with(mode, values))) == expected


def test_ycbcr_converts_with_the_jfif_matrix():
    # Y 76, Cb 85, Cr 255 is pure red in JFIF: R = Y + 1.402 (Cr - 128) = 254.
    (red,) = row(to_rgb(image_with("YCbCr", [(76, 85, 255)])))
    assert abs(red[0] - 254) <= 1 and red[1] <= 1 and red[2] <= 1


def test_a_cmyk_tiff_decodes_like_its_values(tmp_path):
    image_with("CMYK", [(0, 255, 255, 0)]).save(tmp_path / "cmyk.tif")
    assert row(decode_image(tmp_path / "cmyk.tif")) == [(255, 0, 0)]


# --- transparency -------------------------------------------------------------------------


def test_a_fully_transparent_png_that_stores_red_decodes_as_the_background(tmp_path):
    path = tmp_path / "hidden-red.png"
    Image.new("RGBA", (4, 4), (255, 0, 0, 0)).save(path)
    assert decode_image(path).getpixel((1, 1)) == (255, 255, 255)
    assert decode_image(path, background=BLACK).getpixel((1, 1)) == BLACK


def test_a_palette_pngs_transparent_index_decodes_as_the_background(tmp_path):
    path = tmp_path / "palette.png"
    image = image_with("P", [0, 1])
    image.putpalette([255, 0, 255, 10, 200, 30] + [0] * 762)
    image.save(path, transparency=0)  # index 0 (magenta) is transparent
    decoded = decode_image(path, background=(1, 2, 3))
    assert row(decoded) == [(1, 2, 3), (10, 200, 30)]


def test_a_palette_with_per_index_alpha_blends_onto_the_background(tmp_path):
    path = tmp_path / "palette-alpha.png"
    image = image_with("P", [0, 1, 2])
    image.putpalette([200, 100, 0] * 3 + [0] * 759)
    image.save(path, transparency=bytes([0, 255, 51]))  # alpha 0, 1 and 0.2
    assert row(decode_image(path, background=BLACK)) == [BLACK, (200, 100, 0), (40, 20, 0)]


@pytest.mark.parametrize(
    ("mode", "values", "expected"),
    [
        ("RGBA", [(10, 20, 30, 0), (10, 20, 30, 255), (200, 100, 0, 51)], [BLACK, (10, 20, 30), (40, 20, 0)]),
        ("LA", [(100, 0), (100, 255), (200, 51)], [BLACK, (100, 100, 100), (40, 40, 40)]),
        ("PA", [(0, 0), (0, 255)], [BLACK, (0, 0, 0)]),
        ("RGBa", [(40, 20, 0, 51), (0, 0, 0, 0)], [(40, 20, 0), BLACK]),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_alpha_modes_blend_onto_the_background(mode, values, expected):
    assert row(to_rgb(image_with(mode, values), background=BLACK)) == expected


def test_translucent_pixels_blend_onto_a_white_background_by_default():
    (pixel,) = row(to_rgb(image_with("RGBA", [(0, 0, 0, 51)])))  # 20% black over white
    assert pixel == (204, 204, 204)


@pytest.mark.parametrize("mode", ["L", "RGB"])
def test_a_trns_colour_is_transparent(tmp_path, mode):
    path = tmp_path / f"trns-{mode}.png"
    key = 5 if mode == "L" else (5, 6, 7)
    image_with(mode, [key, 9 if mode == "L" else (9, 9, 9)]).save(path, transparency=key)
    assert row(decode_image(path, background=(1, 2, 3))) == [(1, 2, 3), (9, 9, 9)]


def test_a_16_bit_grayscale_trns_value_is_transparent_and_only_it(tmp_path):
    path = tmp_path / "trns16.png"
    image_with("I;16", [1000, 1001, 65535]).save(path, transparency=1000)
    assert row(decode_image(path, background=(1, 2, 3))) == [(1, 2, 3), (4, 4, 4), (255, 255, 255)]


# --- the pixel limit ----------------------------------------------------------------------


def write_declared_png(path, width, height):
    """A valid all-black 8-bit grayscale PNG of width x height, compressed
    row by row so that writing it needs little memory (a decompression bomb)."""
    compressor, scanline, chunks = zlib.compressobj(9), bytes(width + 1), []
    chunks.extend(compressor.compress(scanline) for _ in range(height))
    data = b"".join(chunks) + compressor.flush()

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b""))
    return path


def test_the_default_limit_is_pillows_warning_threshold():
    assert DEFAULT_MAX_PIXELS == 89_478_485


def test_a_small_png_declaring_169_megapixels_is_refused_by_name_without_a_warning(tmp_path):
    path = write_declared_png(tmp_path / "bomb.png", 13000, 13000)
    assert path.stat().st_size < 1_000_000
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, pixels, error = ImageFileDataset([str(path)], image_size=32)[0]
    assert pixels is None
    assert error.startswith("ImageTooLarge: 13000 x 13000 = 169.0 Mpx, over the limit of 89.5 Mpx")
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]


def test_the_limit_is_configurable(tmp_path):
    path = tmp_path / "image.png"
    Image.new("RGB", (100, 60)).save(path)
    assert ImageFileDataset([str(path)], image_size=32, max_pixels=6000)[0].error is None
    assert "ImageTooLarge" in ImageFileDataset([str(path)], image_size=32, max_pixels=5999)[0].error


def test_a_large_jpeg_is_decoded_at_reduced_size_and_counted_at_that_size(tmp_path):
    path = tmp_path / "large.jpg"
    Image.new("RGB", (4000, 3000), (9, 99, 199)).save(path)
    reduced = decode_image(path, min_side=256, max_pixels=1_000_000)
    assert reduced.size == (500, 375)  # one eighth, the largest reduction that keeps 256
    with pytest.raises(ValueError, match="12.0 Mpx"):
        decode_image(path, max_pixels=1_000_000)
