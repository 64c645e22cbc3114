"""The `lumenbridge` command: tokenize images to a safetensors file, report the setup, build the kernels."""

from __future__ import annotations

import argparse
import json
import os
import platform
import stat
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import safetensors
import safetensors.torch
import torch
from PIL import ImageColor
from tqdm import tqdm

import lumenbridge
from lumenbridge.atomic import staging_folder, write_atomically
from lumenbridge.dispatch import BACKENDS
from lumenbridge.images import (
    DEFAULT_MAX_PIXELS,
    WHITE,
    ImageFileDataset,
    collate_images,
    discover_images,
    read_batches,
    resolve_resize,
    sample_image_paths,
)
from lumenbridge.packed_files import tokenize_files_packed

EXIT_OK = 0
EXIT_SOME_SKIPPED = 1
EXIT_USAGE = 2
EXIT_CRASH = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a job stopped by Ctrl-C
EXIT_OUTPUT_CLOSED = 141  # 128 + SIGPIPE, as for any program whose reader went away

TOKEN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

TOKENIZE_HELP = """\
Tokenize images into one safetensors file holding the tensor 'tokens' [N, T, D]
and the metadata 'paths' (JSON list: the absolute path of each row's source,
in order), 'config', 'weights' and 'preprocess'. Unreadable images, and
images over --max-pixels, are named on stderr with the reason and skipped.
Transparent pixels are composited onto --background.

The file is written atomically: a failed run never leaves a partial file or
replaces an existing one. --out never names an input image, and replaces an
existing file only if it is a LumenBridge tokens file or --overwrite is
given; a symlink is followed (the file it points to is replaced). The new
file keeps the permissions of the one it replaces.
"""

EXIT_CODES_HELP = """\
exit codes:
  0    every image was tokenized and the output written
  1    the output was written, but some unreadable images were skipped
       (each is named on stderr with the reason)
  2    usage error (a refused --out included), no image could be read, or the
       output could not be written; no output is written and an existing
       --out file is left as it was
  3    an unexpected error stopped the run (traceback on stderr); no output
       is written and an existing --out file is left as it was
  130  interrupted (Ctrl-C); the output is written only if it was complete
  141  standard output was closed early (e.g. piped into head)
"""


class UsageError(Exception):
    """A problem with the command line or its inputs, reported before any output is written."""


@dataclass
class TokenizeResult:
    tokens: torch.Tensor | None  # [images read, ...model output per image]; None when none was readable
    paths: list[str]  # source of each row of tokens, in order
    failures: list[tuple[str, str]]  # (path, reason) of each skipped image
    seconds: float


def tokenize_files(
    model: torch.nn.Module,
    paths: Sequence[str],
    *,
    image_size: int,
    resize: int | None = None,
    batch_size: int = 32,
    workers: int = 0,
    dtype: torch.dtype = torch.float32,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    background: tuple[int, int, int] = WHITE,
    progress: bool = True,
    on_failure: Callable[[str, str], None] | None = None,
) -> TokenizeResult:
    """Tokenizes image files in order on the model's device, skipping unreadable ones.

    on_failure(path, reason) is called as each unreadable image is found.
    """
    paths = list(paths)
    device = next(model.parameters()).device
    loader = torch.utils.data.DataLoader(
        ImageFileDataset(paths, image_size, resize, max_pixels=max_pixels, background=background),
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=collate_images,
        pin_memory=device.type == "cuda",
    )
    tokens = None
    kept: list[str] = []
    failures: list[tuple[str, str]] = []
    started = time.perf_counter()
    with torch.inference_mode():
        for batch in read_batches(loader, paths, failures, on_failure, progress):
            if batch.pixels is not None:
                output = model(batch.pixels.to(device, non_blocking=True)).to(dtype)
                if tokens is None:
                    # One buffer for every image, filled in place: no concatenation
                    # copy at the end, which matters at millions of images.
                    tokens = torch.empty((len(paths), *output.shape[1:]), dtype=dtype)
                tokens[len(kept) : len(kept) + len(output)].copy_(output)
                kept.extend(paths[index] for index in batch.indices)
    seconds = time.perf_counter() - started
    if tokens is not None:
        tokens = tokens[: len(kept)]
    return TokenizeResult(tokens, kept, failures, seconds)


def save_tokens_atomically(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Writes the tokens file (tensor "tokens", and for packed output its
    "cu_seqlens" and "grid_hw") so that `path` only ever holds a complete file."""
    write_atomically(path, lambda temporary: safetensors.torch.save_file(tensors, temporary, metadata=metadata))


def best_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def resolve_device(name: str | None) -> torch.device:
    """The device the user asked for, checked to exist here; the best one if none was asked for."""
    if name is None:
        return best_device()
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as error:
        raise UsageError(f"invalid --device {name!r}: {error}") from error
    if device.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"--device {name}: choose cpu, cuda[:N] or mps")
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        raise UsageError(f"--device {name}: no such CUDA device here")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"--device {name}: Apple MPS is not available here")
    return device


def load_model(args: argparse.Namespace) -> tuple[lumenbridge.VisualTokenizer, str]:
    """The model to tokenize with, and how its weights are described in the output metadata."""
    if args.weights is not None:
        try:
            model = lumenbridge.VisualTokenizer.from_pretrained(args.weights, backend=args.backend)
        except Exception as error:  # any failure to read the checkpoint is a bad --weights argument
            raise UsageError(f"cannot load --weights {args.weights}: {error}") from error
        return model, args.weights
    preset = args.preset or "lumenbridge-base"
    seed = 0 if args.seed is None else args.seed
    try:
        config = lumenbridge.TokenizerConfig.preset(preset)
        model = lumenbridge.VisualTokenizer(config, seed=seed, backend=args.backend)
    except ValueError as error:
        raise UsageError(str(error)) from error
    print(
        f"note: no --weights given: {preset} uses seeded random initialization (seed {seed}), "
        "not trained weights; the tokens are only useful for testing",
        file=sys.stderr,
    )
    return model, f"seeded-init:{seed}"


def is_tokens_file(path: str) -> bool:
    """Whether path holds what `tokenize` writes: a safetensors file with a
    tensor 'tokens' (packed output adds 'cu_seqlens' and 'grid_hw') and its
    'paths' and 'config' metadata."""
    try:
        with safetensors.safe_open(path, framework="pt") as file:
            names = file.keys()  # safe_open's method, not a dict's
            return "tokens" in names and {"paths", "config"} <= set(file.metadata() or {})
    except (OSError, safetensors.SafetensorError):
        return False


def check_output_path(path: str, inputs: Sequence[str], overwrite: bool) -> None:
    """Fails early, before any image is decoded, if the output could not or
    should not be written where asked. A symlink is judged by its target,
    which is what gets replaced."""
    target = os.path.realpath(path)
    directory = os.path.dirname(target)
    if os.path.isdir(target):
        raise UsageError(f"--out {path} is a directory")
    if not os.path.isdir(directory):
        raise UsageError(f"--out {path}: directory {directory} does not exist")
    if os.path.exists(target):
        identity = os.stat(target)
        if not stat.S_ISREG(identity.st_mode):
            raise UsageError(f"--out {path} exists and is not a regular file")
        if any(os.path.samestat(identity, os.stat(image)) for image in inputs):
            raise UsageError(f"--out {path} is one of the input images")
        if not overwrite and not is_tokens_file(target):
            raise UsageError(
                f"--out {path} exists and is not a LumenBridge tokens file; pass --overwrite to replace it"
            )
    try:
        with staging_folder(directory):
            pass
    except OSError as error:
        raise UsageError(f"--out {path}: cannot write in {directory}: {error.strerror}") from error


def input_paths(paths: Sequence[str]) -> list[str]:
    """The image files named on the command line, or the sample photos if none were."""
    try:
        if paths:
            return discover_images(paths)
        samples = sample_image_paths()
    except FileNotFoundError as error:
        raise UsageError(str(error)) from error
    print(f"no PATHS given: tokenizing the {len(samples)} sample photos bundled with scikit-image", file=sys.stderr)
    return samples


def preprocessing_sizes(args: argparse.Namespace, model: lumenbridge.VisualTokenizer) -> tuple[int, int]:
    """(image_size, resize) from the command line, defaulting to the model's configuration."""
    image_size = model.config.image_size if args.image_size is None else args.image_size
    try:
        model.feature_size(image_size, image_size)
    except ValueError as error:
        step = model.config.total_stride
        nearby = [size for size in (image_size // step * step, (image_size // step + 1) * step) if size >= step]
        raise UsageError(
            f"--image-size {image_size}: must be a multiple of the model's total stride {step}; "
            f"try --image-size {' or '.join(map(str, nearby))}"
        ) from error
    try:
        return image_size, resolve_resize(image_size, args.resize)
    except ValueError as error:
        raise UsageError(f"--resize: {error}") from error


def background_color(name: str, model: lumenbridge.VisualTokenizer) -> tuple[int, int, int]:
    """The RGB colour for --background: a colour name or #hex, or "mean", the
    model's normalization mean (transparent pixels then normalize to zero)."""
    if name == "mean":
        return tuple(round(255 * channel) for channel in model.config.mean)
    try:
        return ImageColor.getrgb(name)[:3]
    except ValueError as error:
        raise UsageError(f"--background {name!r}: {error}; use a colour name, #rrggbb or 'mean'") from error


def report_skipped(path: str, reason: str) -> None:
    tqdm.write(f"skipped {path}: {reason}", file=sys.stderr)


def selected_backend(device: torch.device, requested: str | None) -> str:
    """The name of the backend that will run the model on device; fails early on an impossible request."""
    try:
        return lumenbridge.select_backend(device, requested).name
    except (ValueError, RuntimeError) as error:
        raise UsageError(f"--backend: {error}") from error


def print_summary(result: TokenizeResult, device: torch.device, backend: str, out: str) -> None:
    count = len(result.paths)
    rate = count / result.seconds if result.seconds > 0 else float("inf")
    dtype = str(result.tokens.dtype).removeprefix("torch.")
    print(f"tokenized {count} images -> tokens {list(result.tokens.shape)} {dtype}")
    print(f"throughput: {rate:.1f} images/s on {device} (backend: {backend})")
    print(f"wrote {out}")


def check_max_tokens(args: argparse.Namespace) -> None:
    if args.max_tokens is None:
        return
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be positive, got {args.max_tokens}")
    if args.image_size is not None or args.resize is not None:
        raise UsageError(
            "--max-tokens keeps each image's aspect ratio, uncropped; it cannot go with --image-size or --resize"
        )


def write_result(args, model, result, weights: str, preprocess: dict, device, backend: str, total: int) -> int:
    """The end of every tokenize run: write the tokens file (packed results
    add cu_seqlens and grid_hw), print the summary, choose the exit code."""
    if result.tokens is None:
        print(f"lumenbridge: error: none of the {total} images could be read; no output written", file=sys.stderr)
        return EXIT_USAGE
    tensors = {"tokens": result.tokens}
    if getattr(result, "cu_seqlens", None) is not None:
        tensors.update(cu_seqlens=result.cu_seqlens, grid_hw=result.grid_hw)
    metadata = {
        "paths": json.dumps([os.path.abspath(path) for path in result.paths]),
        "config": model.config.to_json(),
        "weights": weights,
        "preprocess": json.dumps(preprocess),
    }
    try:
        save_tokens_atomically(args.out, tensors, metadata)
    except (OSError, safetensors.SafetensorError) as error:
        print(f"lumenbridge: error: cannot write {args.out}: {error}", file=sys.stderr)
        return EXIT_USAGE
    print_summary(result, device, backend, args.out)
    if result.failures:
        print(f"skipped {len(result.failures)} of {total} images that could not be read", file=sys.stderr)
        return EXIT_SOME_SKIPPED
    return EXIT_OK


def run_tokenize_packed(
    args: argparse.Namespace,
    model: lumenbridge.VisualTokenizer,
    paths: list[str],
    device: torch.device,
    backend: str,
    weights: str,
    background: tuple[int, int, int],
) -> int:
    """tokenize --max-tokens: native-resolution tokens, packed, with cu_seqlens and grid_hw."""
    result = tokenize_files_packed(
        model,
        paths,
        max_tokens=args.max_tokens,
        batch_size=args.batch_size,
        workers=args.workers,
        dtype=TOKEN_DTYPES[args.dtype],
        max_pixels=args.max_pixels,
        background=background,
        on_failure=report_skipped,
    )
    preprocess = {"max_tokens": args.max_tokens, "background": background, "max_pixels": args.max_pixels}
    return write_result(args, model, result, weights, preprocess, device, backend, len(paths))


def run_tokenize(args: argparse.Namespace) -> int:
    try:
        if args.batch_size < 1:
            raise UsageError(f"--batch-size must be positive, got {args.batch_size}")
        if args.workers < 0:
            raise UsageError(f"--workers must be zero or more, got {args.workers}")
        if args.max_pixels < 1:
            raise UsageError(f"--max-pixels must be positive, got {args.max_pixels}")
        if args.weights is not None and (args.preset is not None or args.seed is not None):
            raise UsageError("--preset and --seed pick a randomly initialized model; they cannot go with --weights")
        check_max_tokens(args)
        paths = input_paths(args.paths)
        check_output_path(args.out, paths, args.overwrite)
        device = resolve_device(args.device)
        backend = selected_backend(device, args.backend)
        model, weights = load_model(args)
        image_size, resize = preprocessing_sizes(args, model)
        background = background_color(args.background, model)
    except UsageError as error:
        print(f"lumenbridge: error: {error}", file=sys.stderr)
        return EXIT_USAGE

    model = model.to(device).eval()
    if args.max_tokens is not None:
        return run_tokenize_packed(args, model, paths, device, backend, weights, background)
    result = tokenize_files(
        model,
        paths,
        image_size=image_size,
        resize=resize,
        batch_size=args.batch_size,
        workers=args.workers,
        dtype=TOKEN_DTYPES[args.dtype],
        max_pixels=args.max_pixels,
        background=background,
        on_failure=report_skipped,
    )
    preprocess = {"image_size": image_size, "resize": resize, "background": background, "max_pixels": args.max_pixels}
    return write_result(args, model, result, weights, preprocess, device, backend, len(paths))


def visible_devices() -> list[str]:
    devices = ["cpu"]
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        devices.append(
            f"cuda:{index} {properties.name} (sm_{properties.major}{properties.minor}, "
            f"{properties.total_memory / 2**30:.1f} GiB)"
        )
    if torch.backends.mps.is_available():
        devices.append("mps")
    return devices


def run_info(args: argparse.Namespace) -> int:
    print(f"lumenbridge {lumenbridge.__version__}")
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda or 'not built in'})")
    print(f"python {platform.python_version()} on {platform.platform()}")
    print("devices: " + ", ".join(visible_devices()))
    print(lumenbridge.backends())
    return EXIT_OK


def run_build(args: argparse.Namespace) -> int:
    try:
        report = lumenbridge.extension.build()
    except lumenbridge.extension.BuildError as error:
        print(f"lumenbridge: build failed: {error}", file=sys.stderr)
        return 1
    print(report)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lumenbridge",
        description="LumenBridge visual tokenizer: images to transformer tokens.",
        epilog="Exit codes of each command are listed in its --help.",
    )
    parser.add_argument("--version", action="version", version=f"lumenbridge {lumenbridge.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    tokenize = commands.add_parser(
        "tokenize",
        help="tokenize images into one safetensors file",
        description=TOKENIZE_HELP,
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tokenize.add_argument(
        "paths",
        nargs="*",
        metavar="PATHS",
        help="image files, folders (searched recursively for .jpg .jpeg .png .webp) or glob patterns; "
        "none: the sample photos bundled with scikit-image",
    )
    tokenize.add_argument("--out", required=True, help="output .safetensors file")
    tokenize.add_argument(
        "--overwrite", action="store_true", help="replace an existing --out file that is not a LumenBridge tokens file"
    )
    tokenize.add_argument("--weights", metavar="DIR", help="checkpoint folder written by save_pretrained")
    tokenize.add_argument(
        "--preset",
        choices=sorted(lumenbridge.PRESETS),
        help="architecture of the randomly initialized model used without --weights (default: lumenbridge-base)",
    )
    tokenize.add_argument("--seed", type=int, help="initialization seed used without --weights (default: 0)")
    tokenize.add_argument("--image-size", type=int, help="side of the square crop (default: the model's image_size)")
    tokenize.add_argument("--resize", type=int, help="shorter side before cropping (default: image size * 256/224)")
    tokenize.add_argument(
        "--max-pixels",
        type=int,
        default=DEFAULT_MAX_PIXELS,
        metavar="N",
        help="skip images with more pixels, counted after a JPEG's reduced-size decoding (default: "
        f"{DEFAULT_MAX_PIXELS}, Pillow's warning threshold; Pillow itself refuses any over {2 * DEFAULT_MAX_PIXELS})",
    )
    tokenize.add_argument(
        "--background",
        default="white",
        metavar="COLOR",
        help="colour that transparent pixels are composited onto: a name, #rrggbb, or 'mean' for the model's "
        "normalization mean (default: white)",
    )
    tokenize.add_argument(
        "--max-tokens",
        type=int,
        metavar="N",
        help="native resolution: resize each image, keeping its aspect ratio and uncropped, to at most N tokens, "
        "and write packed 'tokens' [sum of N_i, D] with 'cu_seqlens' and 'grid_hw'",
    )
    tokenize.add_argument("--batch-size", type=int, default=32, help="images per batch (default: 32)")
    tokenize.add_argument(
        "--workers",
        type=int,
        default=min(4, os.cpu_count() or 1),
        help="image decoding processes; 0 decodes in this process (default: min(4, CPU count))",
    )
    tokenize.add_argument("--device", help="torch device (default: cuda, else mps, else cpu)")
    tokenize.add_argument(
        "--backend", choices=sorted(BACKENDS), help="kernel backend for the model (default: chosen per device)"
    )
    tokenize.add_argument(
        "--dtype", choices=list(TOKEN_DTYPES), default="float32", help="dtype of the stored tokens (default: float32)"
    )
    tokenize.set_defaults(handler=run_tokenize)

    info = commands.add_parser("info", help="print versions, devices and kernel backends")
    info.set_defaults(handler=run_info)

    build = commands.add_parser("build", help="build the C++/CUDA extension now")
    build.set_defaults(handler=run_build)
    return parser


def run_command(argv: Sequence[str] | None) -> int:
    """Parse the command line and run the command; an unexpected error becomes EXIT_CRASH."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit:
        # argparse exits on --help (0) and on usage errors (2); return the code instead.
        return exit.code if isinstance(exit.code, int) else EXIT_USAGE
    try:
        return args.handler(args)
    except BrokenPipeError:
        raise  # not a crash: main reports it
    except Exception:  # noqa: BLE001 - any crash must map to EXIT_CRASH
        # Keep exit code 1 meaning "written, some images skipped": a crash is its own code.
        traceback.print_exc()
        print("lumenbridge: error: the run stopped on an unexpected error; no output was written", file=sys.stderr)
        return EXIT_CRASH


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = run_command(argv)
        sys.stdout.flush()  # inside the try: buffered output meets a closed pipe here
        return code
    except KeyboardInterrupt:
        print("lumenbridge: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # Nothing more can be said on stdout; point it at /dev/null so that the
        # interpreter's final flush does not raise the same error again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OUTPUT_CLOSED
