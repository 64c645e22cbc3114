"""JPEG decoding, EXIF orientation, resizing and cropping on the GPU, batched.

decode_jpegs runs torchvision's batched nvJPEG decode (decode_jpeg with
device="cuda"); crop_resize turns the decoded images, of any sizes, into one
uint8 batch [B, 3, S, S] with the same geometry as the CPU path (shorter
side to `resize`, central S x S crop: images.crop_box). Each output pixel
averages sampling_ratio x sampling_ratio bilinear samples of its share of
the box, which antialiases a downscale: torchvision's roi_align with
aligned boxes computes exactly that, and crop_resize_reference does it that
way (a float canvas a group of images, a copy of each into it); the op
torch.ops.lumenbridge.crop_resize reads each image where it lies and writes
the uint8 batch in one kernel (on the CPU the bytes roi_align gives there,
and on CUDA the same bytes as on the CPU), and crop_resize takes it where
the extension is built. Both run on the CPU as well (decode_jpeg and
roi_align have CPU kernels, and so has the op), which is how the tests
check them without a GPU.

nvJPEG's hardware decoder can write its output before work already queued
on its stream has run (pytorch/vision#9606), so decode_jpegs first drains
the stream it runs on: the pipeline gives decoding a stream of its own.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch

from . import extension
from .images import crop_box

# Larger JPEGs decode on the CPU (reduced-size decoding there is much cheaper
# than decoding full size on the GPU only to shrink it, and they keep the
# GPU batch's working memory small).
GPU_MAX_SIDE = 4096
GPU_MAX_PIXELS = 16_000_000
CANVAS_BYTES = 1 << 30  # the float canvas roi_align reads, per chunk of a batch

# torchvision 0.29 warns on every decode that TorchCodec will take its image decoding over.
warnings.filterwarnings(
    "ignore", message="The image decoding and encoding capabilities of TorchVision", category=DeprecationWarning
)


def orient(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """[C, H, W] with its EXIF orientation applied, as PIL.ImageOps.exif_transpose does."""
    if orientation == 2:
        return image.flip(-1)
    if orientation == 3:
        return image.flip(-1, -2)
    if orientation == 4:
        return image.flip(-2)
    if orientation == 5:
        return image.transpose(-1, -2)
    if orientation == 6:
        return torch.rot90(image, -1, dims=(-2, -1))
    if orientation == 7:
        return image.transpose(-1, -2).flip(-1, -2)
    if orientation == 8:
        return torch.rot90(image, 1, dims=(-2, -1))
    return image


def decode_jpegs(data: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """Decodes JPEG bytes (1-D uint8 CPU tensors) to RGB [3, H, W] uint8 on
    device, all in one batched call; if that fails, one by one, so a bad
    image costs only itself (None in its place)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    if not data:
        return []
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # see the module's note on nvJPEG
    try:
        return list(decode_jpeg(list(data), mode=ImageReadMode.RGB, device=device))
    except RuntimeError:
        decoded = []
        for each in data:
            try:
                decoded.append(decode_jpeg(each, mode=ImageReadMode.RGB, device=device))
            except RuntimeError:
                decoded.append(None)
        return decoded


def sampling_ratio(scale: float, margin: float) -> int:
    """Samples per output pixel and axis for a downscale by `scale` (>= 1),
    whose box ends `margin` pixels before the image's right or bottom edge
    (the smaller). At most a pixel apart (ceil(scale)), so the average covers
    every pixel under the output pixel. roi_align's last sample lies half a
    pixel (aligned boxes) plus half a sample spacing before the box's end and
    interpolates towards the next pixel: with less than half a pixel of
    margin it would reach the zeros of the canvas around a smaller image, so
    there the spacing stays at least a pixel (floor(scale)). Uncapped: the
    samples of a batch are about as many as the pixels of its crops, whatever
    the scale (a cap at 8 point-sampled downscales past 8x, such as phone
    photos of 3024 px to 256)."""
    ratio = math.ceil(scale - 1e-6) if margin >= 0.5 else math.floor(scale + 1e-6)
    return max(1, ratio)


def crop_boxes(images: Sequence[torch.Tensor], image_size: int, resize: int) -> list[tuple[tuple[float, ...], int]]:
    """Each image's box (images.crop_box) and samples an axis: 0 for an
    upscale, whose single sample an output pixel may fall past the last
    pixel's centre and takes the edge's value there."""
    boxes = []
    for image in images:
        height, width = image.shape[-2:]
        box = crop_box(width, height, resize, image_size)
        scale = (box[2] - box[0]) / image_size
        margin = min(width - box[2], height - box[3])
        boxes.append((box, sampling_ratio(scale, margin) if scale >= 1 else 0))
    return boxes


def crop_resize(images: Sequence[torch.Tensor], image_size: int, resize: int) -> torch.Tensor:
    """uint8 [3, H, W] images of any sizes -> uint8 [B, 3, image_size, image_size]:
    the shorter side scaled to `resize`, then the central square, in one
    resampling: the op where the extension serves the images' device, else
    crop_resize_reference."""
    if not images:
        raise ValueError("crop_resize needs at least one image")
    device = images[0].device
    served = extension.has_cuda_kernels() if device.type == "cuda" else device.type == "cpu" and extension.load()
    if not served:  # the op's kernels run on the CPU and CUDA GPUs; roi_align elsewhere too
        return crop_resize_reference(images, image_size, resize)
    boxes = crop_boxes(images, image_size, resize)
    corners = [corner for box, _ in boxes for corner in box]
    return torch.ops.lumenbridge.crop_resize(list(images), corners, [max(ratio, 1) for _, ratio in boxes], image_size)


def crop_resize_reference(images: Sequence[torch.Tensor], image_size: int, resize: int) -> torch.Tensor:
    """crop_resize through torchvision's roi_align: images grouped by their
    samples an axis into zero-filled float canvases (each group's ratio keeps
    every sample inside its image), an upscale alone with its edges
    replicated."""
    from torchvision.ops import roi_align

    if not images:
        raise ValueError("crop_resize needs at least one image")
    device = images[0].device
    out = torch.empty((len(images), 3, image_size, image_size), dtype=torch.uint8, device=device)
    boxes = []
    groups: dict[int, list[int]] = {}
    for position, (box, ratio) in enumerate(crop_boxes(images, image_size, resize)):
        boxes.append(box)
        groups.setdefault(ratio, []).append(position)

    def finish(positions: list[int], result: torch.Tensor) -> None:
        index = _on(device, positions, torch.int64)
        out.index_copy_(0, index, result.round_().clamp_(0, 255).to(torch.uint8))

    for position in groups.pop(0, []):
        padded = torch.nn.functional.pad(images[position][None].float(), (0, 1, 0, 1), mode="replicate")
        roi = _on(device, [[0.0, *boxes[position]]], torch.float32)
        finish([position], roi_align(padded, roi, image_size, 1.0, 1, aligned=True))
    for ratio, positions in sorted(groups.items()):
        positions.sort(key=lambda p: images[p].shape[-2] * images[p].shape[-1])
        start = 0
        while start < len(positions):
            # As many images as fit the canvas budget, smallest first, so similar sizes share a canvas.
            end, height, width = start, 0, 0
            while end < len(positions):
                h, w = images[positions[end]].shape[-2:]
                grown_height, grown_width = max(height, h), max(width, w)
                if end > start and (end + 1 - start) * 3 * grown_height * grown_width * 4 > CANVAS_BYTES:
                    break
                height, width, end = grown_height, grown_width, end + 1
            chunk = positions[start:end]
            canvas = torch.zeros((len(chunk), 3, height, width), dtype=torch.float32, device=device)
            for slot, p in enumerate(chunk):
                h, w = images[p].shape[-2:]
                canvas[slot, :, :h, :w].copy_(images[p])
            rois = _on(device, [[slot, *boxes[p]] for slot, p in enumerate(chunk)], torch.float32)
            finish(chunk, roi_align(canvas, rois, image_size, 1.0, ratio, aligned=True))
            start = end
    return out


def _on(device: torch.device, values: list, dtype: torch.dtype) -> torch.Tensor:
    """A small tensor on device without a host-blocking copy from pageable memory."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor
