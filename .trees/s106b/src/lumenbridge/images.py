"""Image inputs for the tokenizer: finding files, decoding, preprocessing, batching.

Inputs may come from untrusted sources: an image with more than max_pixels
pixels (after a JPEG's reduced-size decoding) is refused before its pixels
are decoded, so a tiny file that expands to gigapixels fails loudly, naming
the file, instead of exhausting memory. Pillow's own hard limit stays on.

Every mode decodes to 8-bit RGB: 16- and 32-bit grayscale is scaled, not
clipped, and transparent pixels are composited onto a background colour
instead of showing the colour they happen to store.
"""

from __future__ import annotations

import importlib.resources
import os
import signal
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, NamedTuple

import torch
from PIL import Image, ImageMath
from tqdm import tqdm

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp"})

# Pillow's own warning threshold (1 GiB of 24-bit RGB): about 89.5 Mpx.
DEFAULT_MAX_PIXELS = 1024 * 1024 * 1024 // 4 // 3
# The most bytes one image file or tar member may have, checked before it is
# read whole: 1 GiB, far above what any image within the default pixel limit
# needs (8 bytes a pixel, 16-bit RGBA stored uncompressed, is 716 MB). A larger
# "image" would only fill a worker's memory, again on every rerun.
MAX_IMAGE_BYTES = 1024 * 1024 * 1024
WHITE = (255, 255, 255)

SAMPLE_IMAGE_NAMES = (
    "astronaut.png",
    "chelsea.png",
    "coffee.png",
    "rocket.jpg",
    "motorcycle_left.png",
    "hubble_deep_field.jpg",
    "retina.jpg",
    "camera.png",
)


# The EXIF orientation tag, and the transpose that shows each value (2-8) upright.
ORIENTATION_TAG = 0x0112
UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
# The transposes among those that exchange width and height.
SIDE_SWAPPING = {
    Image.Transpose.TRANSPOSE,
    Image.Transpose.ROTATE_270,
    Image.Transpose.TRANSVERSE,
    Image.Transpose.ROTATE_90,
}


def upright_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) of the image once its EXIF orientation is applied."""
    width, height = image.size
    swaps_sides = UPRIGHT.get(exif_orientation(image)) in SIDE_SWAPPING
    return (height, width) if swaps_sides else (width, height)


def exif_orientation(image: Image.Image) -> int:
    """The image's EXIF orientation, 1 (as stored) where it has none or its EXIF
    cannot be parsed: cameras write malformed tags that Pillow raises on in
    many ways, and the pixels are fine."""
    try:
        value = image.getexif().get(ORIENTATION_TAG, 1)
    except Exception:  # noqa: BLE001 - any parse failure of optional metadata
        return 1
    return int(value) if value in UPRIGHT else 1


class ImageTooLarge(ValueError):
    """An image with more pixels than the decoding limit allows, or more bytes than MAX_IMAGE_BYTES."""


# What a bad input file can raise while being opened and decoded.
# UnidentifiedImageError and truncated-file errors are OSError subclasses;
# some format plugins raise SyntaxError or EOFError on malformed data.
IMAGE_READ_ERRORS = (
    OSError,
    ValueError,
    SyntaxError,
    EOFError,
    Image.DecompressionBombError,
)


def is_image_file(path: str | os.PathLike) -> bool:
    """Whether a path has one of the image extensions we pick up from folders and globs."""
    return Path(path).suffix.lower() in IMAGE_EXTENSIONS


def images_in_folder(folder: str | os.PathLike) -> Iterator[str]:
    """All image files below a folder, recursively, in sorted order (as a
    path's parts sort), skipping hidden ones, found one folder at a time:
    a folder tree of millions of images is never listed whole. Links to
    folders are followed, each folder once (so a link back up the tree is no
    loop); where two paths reach one folder, the first in sorted order is
    kept. A folder that cannot be read is an error (its images would
    otherwise be left out unsaid)."""
    yield from _images_below(os.fspath(folder), set())


def _images_below(folder: str, visited: set[str]) -> Iterator[str]:
    real = os.path.realpath(folder)
    if real in visited:
        return
    visited.add(real)  # a few tens of bytes a folder, not an image
    try:
        with os.scandir(folder) as listing:
            entries = sorted((entry.name, entry.is_dir()) for entry in listing)
    except OSError as error:
        raise ValueError(f"cannot read folder {error.filename}: {error.strerror}") from error
    for name, is_folder in entries:
        # Hidden entries (".name", such as macOS "._IMG_1.jpg" metadata files) are not images.
        if name.startswith("."):
            continue
        path = os.path.join(folder, name)
        if is_folder:
            yield from _images_below(path, visited)
        elif is_image_file(name) and os.path.isfile(path):
            yield path


def sample_image_paths() -> list[str]:
    """The sample photos installed with scikit-image (no download needed)."""
    try:
        folder = importlib.resources.files("skimage.data")
    except ModuleNotFoundError as error:
        raise FileNotFoundError("sample photos need scikit-image, which is not installed") from error
    paths = [str(folder / name) for name in SAMPLE_IMAGE_NAMES if (folder / name).is_file()]
    if not paths:
        raise FileNotFoundError(f"no sample photos found in scikit-image's data folder {folder}")
    return paths


def resolve_resize(image_size: int, resize: int | None = None) -> int:
    """The shorter side to resize to before cropping image_size x image_size.

    By default the usual 256/224 ratio; an explicit resize must leave room for the crop.
    """
    if resize is None:
        return round(image_size * 256 / 224)
    if resize < image_size:
        raise ValueError(f"resize ({resize}) must be at least image_size ({image_size})")
    return resize


def check_pixel_count(size: tuple[int, int], max_pixels: int) -> None:
    """Raise ImageTooLarge if an image of this size has more than max_pixels pixels."""
    width, height = size
    if width * height > max_pixels:
        raise ImageTooLarge(
            f"{width} x {height} = {pixel_count(width * height)}, over the limit of {pixel_count(max_pixels)} "
            "(--max-pixels)"
        )


def check_byte_count(size: int) -> None:
    """Raise ImageTooLarge if an image file (or tar member) of this many bytes is over MAX_IMAGE_BYTES."""
    if size > MAX_IMAGE_BYTES:
        raise ImageTooLarge(f"{size:,} bytes, over the limit of {MAX_IMAGE_BYTES:,} for one image file")


def pixel_count(pixels: int) -> str:
    """A pixel count for a message: in Mpx from a million up, else in pixels (a small limit is not 0.0 Mpx)."""
    return f"{pixels / 1e6:.1f} Mpx" if pixels >= 1_000_000 else f"{pixels:,} pixels"


def _wide_gray_to_8bit(image: Image.Image) -> Image.Image:
    """A 16- or 32-bit integer or 32-bit float grayscale image as 8-bit L, or
    LA where a tRNS value marks transparent pixels. Integers are taken as
    16-bit (0..65535, as PNG and TIFF store them), floats as 0..1; values
    beyond are clipped. Pillow's own conversion clips instead of scaling,
    which turns almost every 16-bit pixel white."""
    if image.mode == "F":
        return image.point(lambda v: v * 255 + 0.5).convert("L")
    wide = image.convert("I")
    gray = wide.point(lambda v: v / 257 + 0.5).convert("L")
    transparent = image.info.get("transparency")
    if transparent is None:
        return gray
    alpha = ImageMath.lambda_eval(lambda args: args["notequal"](args["im"], transparent) * 255, im=wide)
    return Image.merge("LA", (gray, alpha.convert("L")))


def to_rgb(image: Image.Image, background: tuple[int, int, int] = WHITE) -> Image.Image:
    """Any decoded image as 8-bit RGB, with transparent and translucent pixels
    composited onto `background` (alpha channels, palette and tRNS transparency)."""
    if image.mode == "F" or image.mode.startswith("I"):
        image = _wide_gray_to_8bit(image)
    if not image.has_transparency_data:
        return image.convert("RGB")
    canvas = Image.new("RGBA", image.size, (*background, 255))
    return Image.alpha_composite(canvas, image.convert("RGBA")).convert("RGB")


def decode_image(
    path: str | os.PathLike,
    min_side: int | None = None,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    background: tuple[int, int, int] = WHITE,
) -> Image.Image:
    """Decodes an image file to 8-bit RGB with its EXIF orientation applied
    (see to_rgb). Raises ImageTooLarge, before decoding any pixel, if the
    image has more than max_pixels pixels.

    min_side lets the JPEG decoder downscale by a power of two while keeping
    both sides at least that long, which is much cheaper than decoding a
    large photo at full size only to shrink it afterwards; the pixel limit
    applies to that reduced size.
    """
    with open_image(path) as image:
        return decode_opened(image, min_side, max_pixels=max_pixels, background=background)


def open_image(file: str | os.PathLike | BinaryIO) -> Image.Image:
    """Image.open, which reads only the header; Pillow's unnamed warning for
    large images stays quiet (check_pixel_count names the file instead)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        return Image.open(file)


def decode_opened(
    image: Image.Image,
    min_side: int | None = None,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    background: tuple[int, int, int] = WHITE,
) -> Image.Image:
    """decode_image for an image already opened with open_image."""
    if min_side is not None:
        image.draft("RGB", (min_side, min_side))
    check_pixel_count(image.size, max_pixels)
    # Only the orientation is read: ImageOps.exif_transpose also rewrites the
    # EXIF, which fails on tags Pillow can read but not write.
    transpose = UPRIGHT.get(exif_orientation(image))
    return to_rgb(image if transpose is None else image.transpose(transpose), background)


def crop_box(width: int, height: int, resize: int, image_size: int) -> tuple[float, float, float, float]:
    """The source region that becomes the output: the central image_size square
    of the image once its shorter side is scaled to `resize`, in the source's
    own (fractional) pixel coordinates."""
    side = image_size * min(width, height) / resize
    left, top = (width - side) / 2, (height - side) / 2
    return left, top, left + side, top + side


def to_tensor(image: Image.Image) -> torch.Tensor:
    """An RGB image as a uint8 tensor [3, H, W]."""
    width, height = image.size
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    return pixels.view(height, width, 3).permute(2, 0, 1).contiguous()


def preprocess(image: Image.Image, image_size: int, resize: int | None = None) -> torch.Tensor:
    """Resize shorter side, center-crop to image_size, return uint8 [3, image_size, image_size].

    Both happen in one resampling of just the cropped region, so memory stays
    at the output size whatever the aspect ratio: a 1 x 100000 image would
    otherwise be scaled to 256 x 25600000 before cropping. Bicubic filtering
    widens with the scale factor, so downscaling is antialiased."""
    resize = resolve_resize(image_size, resize)
    box = crop_box(*image.size, resize, image_size)
    return to_tensor(image.resize((image_size, image_size), Image.Resampling.BICUBIC, box=box))


def load_image(
    path: str | os.PathLike,
    image_size: int,
    resize: int | None = None,
    *,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    background: tuple[int, int, int] = WHITE,
) -> torch.Tensor:
    """Decodes and preprocesses one file into a uint8 tensor [3, image_size, image_size]."""
    resize = resolve_resize(image_size, resize)
    image = decode_image(path, min_side=resize, max_pixels=max_pixels, background=background)
    return preprocess(image, image_size, resize)


class LoadedImage(NamedTuple):
    """One dataset item: the pixels of image `index`, or why it could not be read."""

    index: int
    pixels: torch.Tensor | None
    error: str | None


class ImageBatch(NamedTuple):
    """The readable images of a batch stacked together, plus the unreadable ones."""

    indices: list[int]
    pixels: torch.Tensor | None
    failures: list[tuple[int, str]]


class FileDataset(torch.utils.data.Dataset):
    """Images decoded from a list of files by `load(path)`; a bad file becomes
    an error item, not an exception, so one corrupt file among millions does
    not stop a DataLoader."""

    def __init__(self, paths: Sequence[str]):
        self.paths = list(paths)

    def load(self, path: str) -> torch.Tensor:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> LoadedImage:
        try:
            pixels = self.load(self.paths[index])
        except IMAGE_READ_ERRORS as error:
            return LoadedImage(index, None, f"{type(error).__name__}: {error}")
        return LoadedImage(index, pixels, None)


class ImageFileDataset(FileDataset):
    """Images resized and center-cropped to image_size."""

    def __init__(
        self,
        paths: Sequence[str],
        image_size: int,
        resize: int | None = None,
        *,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        background: tuple[int, int, int] = WHITE,
    ):
        super().__init__(paths)
        self.image_size = image_size
        # Checked here, not per item, where the error would read as an unreadable image.
        self.resize = resolve_resize(image_size, resize)
        self.max_pixels = max_pixels
        self.background = background

    def load(self, path: str) -> torch.Tensor:
        return load_image(path, self.image_size, self.resize, max_pixels=self.max_pixels, background=self.background)


def image_loader(dataset: torch.utils.data.Dataset, **options) -> torch.utils.data.DataLoader:
    """A DataLoader over `dataset` (options as DataLoader's) whose worker
    processes leave Ctrl-C to the main process. A terminal's Ctrl-C reaches
    the whole process group; the main process stops its workers when it is
    interrupted, and a worker that also took the signal could print a
    traceback of its own as it exited."""
    return torch.utils.data.DataLoader(dataset, worker_init_fn=_leave_interrupts_to_main, **options)


def _leave_interrupts_to_main(worker_id: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.excepthook = _quiet_when_main_is_gone


def _quiet_when_main_is_gone(error_type, error, traceback) -> None:
    """A worker's thread that was handing a batch's shared memory to the main
    process when it stopped (multiprocessing's resource sharer, which reports
    through sys.excepthook) fails with EOFError or a connection error:
    expected once the main process has been interrupted, so not printed.
    Anything else is, as by default."""
    if not issubclass(error_type, (EOFError, ConnectionError)):
        sys.__excepthook__(error_type, error, traceback)


def read_batches(loader, paths: Sequence[str], failures: list, on_failure, progress: bool):
    """The loader's batches in order, with one progress bar over `paths`; each
    unreadable image goes into `failures` as (path, reason), and to
    on_failure(path, reason) when given, as it is found."""
    with tqdm(total=len(paths), unit="img", file=sys.stderr, disable=not progress) as bar:
        for batch in loader:
            for index, reason in batch.failures:
                failures.append((paths[index], reason))
                if on_failure is not None:
                    on_failure(paths[index], reason)
            yield batch
            bar.update(len(batch.indices) + len(batch.failures))


def collate_images(items: Sequence[LoadedImage]) -> ImageBatch:
    """DataLoader collate function: stacks the good images, keeps the failures aside."""
    good = [item for item in items if item.pixels is not None]
    pixels = torch.stack([item.pixels for item in good]) if good else None
    failures = [(item.index, item.error) for item in items if item.pixels is None]
    return ImageBatch([item.index for item in good], pixels, failures)
