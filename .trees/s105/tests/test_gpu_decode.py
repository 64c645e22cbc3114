"""The --decode gpu preprocessing (lumenbridge.gpu_decode): EXIF orientation,
batched resize and crop, decode fallbacks. The functions run on the CPU too,
so their logic is checked here without a GPU; the CUDA tests skip without one."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
import torch
from conftest import device_params, import_or_skip
from PIL import Image, ImageOps

from lumenbridge.images import preprocess, to_tensor
from lumenbridge.pipeline import SampleDataset
from lumenbridge.sources import Sample

torchvision = import_or_skip("torchvision")
from lumenbridge.gpu_decode import crop_boxes, crop_resize, crop_resize_reference, decode_jpegs, orient, sampling_ratio

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


def random_images(seed: int = 0) -> list[torch.Tensor]:
    """Noise of many sizes (down- and upscales, boxes at the edges or with a
    margin), one image a transposed view and one a crop of a larger one."""
    generator = torch.Generator().manual_seed(seed)
    sizes = [(300, 200), (64, 90), (120, 120), (37, 37), (50, 40), (20, 30), (1000, 700), (33, 700), (31, 31)]
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=generator) for w, h in sizes]
    return [*images, images[0].transpose(1, 2), images[6][:, 100:400, 50:600]]


def crop_resize_op(images: list[torch.Tensor], image_size: int, resize: int) -> torch.Tensor:
    boxes = crop_boxes(images, image_size, resize)
    corners = [corner for box, _ in boxes for corner in box]
    return torch.ops.lumenbridge.crop_resize(images, corners, [max(r, 1) for _, r in boxes], image_size)


@pytest.mark.parametrize("resize", [37, 32, 90], ids=["margin", "box-at-the-edges", "upscales"])
def test_the_op_writes_the_references_bytes(poisoned, resize):
    images = random_images()
    got = crop_resize_op(images, 32, resize)
    want = crop_resize_reference(images, 32, resize)
    assert got.shape == want.shape == (len(images), 3, 32, 32)
    assert torch.equal(got, want), (got.int() - want.int()).abs().max()


@pytest.mark.parametrize("device", device_params())
def test_crop_resize_takes_the_op_where_the_extension_serves_the_device(native_ops, device, monkeypatch):
    images = [image.to(device) for image in random_images(1)[:4]]
    calls = []
    op = torch.ops.lumenbridge.crop_resize
    monkeypatch.setattr(torch.ops.lumenbridge, "crop_resize", lambda *a: calls.append(a) or op(*a), raising=False)
    got = crop_resize(images, 24, 28)
    assert len(calls) == 1 and torch.equal(got, crop_resize_reference(images, 24, 28))


def test_crop_resize_takes_roi_align_on_a_device_the_op_has_no_kernels_for(native_ops, monkeypatch):
    images = random_images(3)[:2]
    taken = []
    monkeypatch.setattr(
        "lumenbridge.gpu_decode.crop_resize_reference", lambda *a: taken.append(a) or torch.zeros(2, 3, 24, 24)
    )
    meta = [image.to("meta") for image in images]
    crop_resize(meta, 24, 28)
    assert len(taken) == 1


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_the_op_on_cuda_writes_the_bytes_it_writes_on_the_cpu(poisoned, cuda_kernels):
    images = random_images(2)
    for resize in (37, 32, 90):
        on_cpu = crop_resize_op(images, 32, resize)
        on_gpu = crop_resize_op([image.cuda() for image in images], 32, resize)
        assert on_gpu.device.type == "cuda" and torch.equal(on_gpu.cpu(), on_cpu)
    with pytest.raises(RuntimeError, match=re.escape("LumenBridge: images[1] is on cpu but images[0] is on cuda:0")):
        crop_resize_op([images[0].cuda(), images[1]], 32, 37)


def test_the_op_refuses_bad_arguments(native_ops):
    image = torch.zeros((3, 10, 12), dtype=torch.uint8)
    op = native_ops.crop_resize
    box = [0.0, 0.0, 10.0, 10.0]
    cases = [
        (([], [], [], 8), "needs at least one image"),
        (([image.float()], box, [1], 8), "takes uint8 images; images[0] has dtype Float"),
        (([image[0]], box, [1], 8), "shape [C, H, W]; images[0] has shape [10, 12]"),
        (([image, image[:2]], box * 2, [1, 1], 8), "one channel count; images[0] has 3 and images[1] has 2"),
        (([torch.zeros((5, 10, 12), dtype=torch.uint8)], box, [1], 8), "takes 1 to 4 channels; images[0] has 5"),
        (([image.to_sparse()], box, [1], 8), "takes dense images; images[0] is sparse"),
        (([image[:, :0]], box, [1], 8), "images[0] must have between 1 and"),
        (([image], box[:3], [1], 8), "four box values an image, [x0, y0, x1, y1] each: 4 for 1 images, got 3"),
        (([image], box, [], 8), "one sample count an image: 1, got 0"),
        (([image], box, [1], 0), "size must be between 1 and 65535, got 0"),
        (([image], [0.0, 0.0, 12.5, 10.0], [1], 8), "its size 12 x 10 (W x H), got [0, 0, 12.5, 10]"),
        (([image], [3.0, 0.0, 3.0, 10.0], [1], 8), "box of image 0 must satisfy"),
        (([image], [0.0, -1.0, 10.0, 9.0], [1], 8), "box of image 0 must satisfy"),
        (([image], [0.0, 0.0, float("nan"), 9.0], [1], 8), "box of image 0 must satisfy"),
        (([image], box, [0], 8), "sample count of image 0 must be between 1 and 4096, got 0"),
    ]
    for arguments, message in cases:
        with pytest.raises(RuntimeError, match="LumenBridge: .*" + re.escape(message)):
            op(*arguments)


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
