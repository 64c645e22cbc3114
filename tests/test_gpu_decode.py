"""The --decode gpu preprocessing (lumenbridge.gpu_decode): EXIF orientation,
batched resize and crop, decode fallbacks. The functions run on the CPU too,
so their logic is checked here without a GPU; the CUDA tests skip without one."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from conftest import import_or_skip
from PIL import Image, ImageOps

from lumenbridge.images import preprocess, to_tensor
from lumenbridge.pipeline import SampleDataset
from lumenbridge.sources import Sample

torchvision = import_or_skip("torchvision")
from lumenbridge.gpu_decode import crop_resize, decode_jpegs, orient, sampling_ratio

HAS_CUDA = torch.cuda.is_available()


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 2 + y) % 256, (y * 3) % 256, ((x - y) * 2) % 256], -1).astype(float)
    base = base + rng.normal(0, 6, base.shape)
    return Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))


def jpeg_bytes(image: Image.Image, orientation: int = 1) -> bytes:
    buffer = io.BytesIO()
    exif = Image.Exif()
    if orientation != 1:
        exif[0x0112] = orientation
    image.save(buffer, "JPEG", quality=95, exif=exif.tobytes())
    return buffer.getvalue()


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orient_matches_pillow_exif_transpose(orientation):
    image = photo(7, 5)
    tagged = Image.open(io.BytesIO(jpeg_bytes(image, orientation)))
    tagged.load()
    want = to_tensor(ImageOps.exif_transpose(tagged).convert("RGB"))
    got = orient(to_tensor(tagged.convert("RGB")), orientation)
    assert torch.equal(got, want)


@pytest.mark.parametrize("size", [(300, 200), (200, 333), (64, 64), (1000, 700), (20, 30)])
def test_crop_resize_is_close_to_the_cpu_preprocessing(size):
    image = photo(*size)
    want = preprocess(image, 32, 37).float()
    got = crop_resize([to_tensor(image)], 32, 37)
    assert got.shape == (1, 3, 32, 32) and got.dtype == torch.uint8
    # Another filter (bilinear box average, not bicubic), the same geometry.
    assert (got[0].float() - want).abs().mean() < 6


@pytest.mark.parametrize("resize", [37, 32], ids=["margin", "box-at-the-edges"])
def test_crop_resize_of_a_batch_equals_each_image_alone(resize):
    # Images of different sizes share a zero-padded canvas: none may read the padding.
    sizes = [(300, 200), (64, 90), (120, 120), (37, 37), (50, 40)]
    images = [to_tensor(photo(w, h, seed)) for seed, (w, h) in enumerate(sizes)]
    together = crop_resize(images, 32, resize)
    for position, image in enumerate(images):
        assert torch.equal(together[position], crop_resize([image], 32, resize)[0])


def test_sampling_ratio_spaces_samples_a_pixel_apart_where_the_margin_allows():
    assert [sampling_ratio(scale, margin=1.0) for scale in (1.0, 1.2, 1.99, 2.0, 2.5)] == [1, 2, 2, 2, 3]
    assert [sampling_ratio(scale, margin=0.4) for scale in (1.0, 1.2, 1.99, 2.0, 2.5)] == [1, 1, 1, 2, 2]
    assert sampling_ratio(12.5, margin=10.0) == 13  # past 8x too: a phone photo of 3200 px to 256


@pytest.mark.parametrize("size", [(640, 480), (500, 375)])
def test_a_downscale_under_two_is_antialiased(size):
    """One-pixel black and white stripes shrunk by 1.9 and 1.5: a filter
    averages them towards grey, point sampling keeps them (a spread about 73
    around the mean, measured; Pillow's bicubic leaves 0.4 and 14, roi_align's
    two samples a pixel 7.5 and 31)."""
    width, height = size
    stripes = (torch.arange(width) % 2 * 255).to(torch.uint8).expand(3, height, width).contiguous()
    got = crop_resize([stripes], 224, 256)[0].float()
    want = preprocess(Image.fromarray(stripes.permute(1, 2, 0).numpy()), 224, 256).float()
    assert got.std() < 2.5 * want.std() + 10, (got.std(), want.std())


def test_a_downscale_past_eight_is_antialiased():
    """One-pixel lines every third pixel, 2400 px shrunk to 256 (9.4x): with
    samples capped at eight an axis they were point-sampled (a spread of
    about 21 around the mean, measured); samples a pixel apart average them
    to their grey (about 2)."""
    side = 2400
    lines = ((torch.arange(side) % 3 == 0).to(torch.uint8) * 255).expand(3, side, side).contiguous()
    got = crop_resize([lines], 224, 256)[0].float()
    assert abs(got.mean().item() - 85) < 2 and got.std() < 5, (got.mean(), got.std())


def test_a_bad_jpeg_in_a_batch_costs_only_itself():
    good = torch.frombuffer(bytearray(jpeg_bytes(photo(40, 30))), dtype=torch.uint8)
    bad = good[:100].clone()
    decoded = decode_jpegs([good, bad, good], torch.device("cpu"))
    assert decoded[1] is None
    assert decoded[0].shape == decoded[2].shape == (3, 30, 40)


def test_the_dataset_hands_jpegs_to_the_gpu_and_decodes_the_rest(tmp_path):
    rotated = tmp_path / "rotated.jpg"
    rotated.write_bytes(jpeg_bytes(photo(60, 40), orientation=6))
    png = tmp_path / "flat.png"
    photo(50, 50).save(png)
    cmyk = tmp_path / "cmyk.jpg"
    photo(50, 50).convert("CMYK").save(cmyk)
    plan = [Sample(str(path), str(path)) for path in (rotated, png, cmyk)]
    dataset = SampleDataset(plan, 32, 37, gpu=True)
    jpeg, flat, inked = dataset[0], dataset[1], dataset[2]
    assert jpeg.encoded is not None and jpeg.orientation == 6 and jpeg.size == (60, 40)
    assert flat.encoded is None and flat.pixels.shape == (3, 32, 32)
    assert inked.encoded is None and inked.pixels is not None  # CMYK: the CPU decodes it
    # Decoded, oriented, resized and cropped like the CPU path does it.
    (decoded,) = decode_jpegs([jpeg.encoded], torch.device("cpu"))
    got = crop_resize([orient(decoded, jpeg.orientation)], 32, 37)[0].float()
    want = SampleDataset(plan, 32, 37)[0].pixels.float()
    assert (got - want).abs().mean() < 6


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_nvjpeg_decode_resize_on_cuda_matches_the_cpu():
    device = torch.device("cuda")
    data = [
        torch.frombuffer(bytearray(jpeg_bytes(photo(w, h, s))), dtype=torch.uint8)
        for s, (w, h) in enumerate([(300, 200), (480, 640), (64, 64)])
    ]
    data.append(data[0][:200].clone())  # broken: decoded one by one after the batch fails
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        decoded = decode_jpegs(data, device)
        assert decoded[3] is None
        on_gpu = crop_resize(decoded[:3], 32, 37)
    stream.synchronize()
    on_cpu = crop_resize(decode_jpegs(data[:3], torch.device("cpu")), 32, 37)
    assert on_gpu.device.type == "cuda"
    assert (on_gpu.cpu().float() - on_cpu.float()).abs().mean() < 3
