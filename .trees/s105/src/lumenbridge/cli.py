"""The `lumenbridge` command: tokenize images to a safetensors file, report the setup, build the kernels."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import platform
import stat
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

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
    image_loader,
    read_batches,
    resolve_resize,
    sample_image_paths,
)
from lumenbridge.packed_files import tokenize_files_packed
from lumenbridge.shards import OutputError

EXIT_OK = 0
EXIT_SOME_SKIPPED = 1
EXIT_BUILD_FAILED = 1  # build's; its one failure
EXIT_USAGE = 2
EXIT_CRASH = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a job stopped by Ctrl-C
EXIT_OUTPUT_CLOSED = 141  # 128 + SIGPIPE, as for any program whose reader went away

TOKEN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

TOKENIZE_HELP = """\
Tokenize images into a folder of shards (--out DIR) or one file (--out FILE.safetensors).

--out DIR (an existing folder, or a new path not ending in .safetensors; an
existing file is written as one file):
shards DIR/tokens-SSSSS-of-NNNNN.safetensors of --shard-size images each, the
tensor 'tokens' [rows, T, D] in each; DIR/index.jsonl, one JSON line per
image in input order: key (a file's absolute path, or a tar sample's
WebDataset key), source, member (in a tar), shard, row, width and height
(as stored), grid (token rows and columns); DIR/errors.jsonl, one line per
skipped image with the reason. Each shard is written atomically (staged,
fsynced, renamed). Run the same command again after a crash or kill -9 and
it completes what is missing, to the same bytes as an uninterrupted run; a
DIR of a run with other inputs or settings is refused (--overwrite starts it
afresh). Under torchrun (torchrun --nproc_per_node=N -m lumenbridge tokenize
... --out DIR) the shards are split between the ranks, and rank 0 writes the
index once every rank is done. Read it back with lumenbridge.read_tokens(DIR).

--out FILE.safetensors: one file holding 'tokens' [N, T, D] and the metadata
'paths' (JSON list: the absolute path of each row's source, in order),
'config', 'weights' and 'preprocess', written atomically: a failed run never
leaves a partial file or replaces an existing one. --out never names an
input (an image or a file list), and replaces an existing file only if it is
a LumenBridge tokens file or --overwrite is given; a symlink is followed (the
file it points to is replaced). The new file keeps the permissions of the one
it replaces.

Inputs: image files, folders, globs, WebDataset .tar shards (also as brace
patterns, quoted: 'data-{00000..00099}.tar'), and file lists (.txt or .lst: one
path a line; .parquet: a column 'path'; relative paths from the list's folder).
Unreadable images, and images over --max-pixels, are named on stderr with the
reason and skipped. Transparent pixels are composited onto --background.

At the end a summary gives images tokenized and skipped, shards, wall time,
images/s end to end and per process, and where the time went: decode (in the
workers, summed), with --decode gpu GPU decode (of which nvJPEG, and resize
and crop) and nvJPEG's set-up on its first call (once the inputs are listed,
beside the model's loading and the rest of the planning), transfer (host to
GPU and back), tokenize (the model), write (summed over the --open-shards
writers), the model's wait for decoded images, and, for the slowest process,
when its first batch was ready and how long its last writes took.
"""

EXIT_CODES_HELP = """\
exit codes:
  0    every image was tokenized and the output written (under torchrun also
       when some were skipped: torchrun takes any other code as a failure)
  1    the output was written, but some unreadable images were skipped
       (each is named on stderr with the reason, and in DIR/errors.jsonl)
  2    usage error (a refused --out included), no image could be read, or the
       output could not be written; no output is written and an existing
       --out file is left as it was (with --out DIR, finished shards stay; a
       run that could read no image stays as a complete run of no rows, with
       DIR/errors.jsonl saying why)
  3    an unexpected error stopped the run (traceback on stderr); no output
       is written and an existing --out file is left as it was
  130  interrupted (Ctrl-C); the output is written only if it was complete
       (with --out DIR, finished shards stay: run the command again to resume)
  141  standard output was closed early (e.g. piped into head)
"""


DEFAULT_SHARD_SIZE = 10_000
DEFAULT_OPEN_SHARDS = 2
# Options of --out DIR (their argparse names); one file refuses them.
SHARDED_ONLY = {
    "--shard-size": "shard_size",
    "--open-shards": "open_shards",
    "--report": "report",
    "--allow-mixed": "allow_mixed",
}


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
    loader = image_loader(
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
        if model.config.in_chans != 3:
            raise UsageError(
                f"--weights {args.weights} takes {model.config.in_chans}-channel images; tokenize decodes "
                "every image to RGB (3 channels)"
            )
        # Tokens are stored as [N, T, D] whatever format the checkpoint's forward returns.
        model.config = dataclasses.replace(model.config, output_fmt="NLC")
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


def _is_file(identity: os.stat_result, path: str) -> bool:
    """Whether path is the file of `identity`; a missing input is not (a list's
    missing entry is skipped later, like an unreadable image)."""
    try:
        return os.path.samestat(identity, os.stat(path))
    except OSError:
        return False


def file_target(flag: str, path: str) -> tuple[str, str]:
    """(file, folder) that `flag` (--out or --report) names, symlinks followed,
    once the folder is known to exist."""
    target = os.path.realpath(path)
    directory = os.path.dirname(target)
    if os.path.isdir(target):
        raise UsageError(f"{flag} {path} is a directory")
    if not os.path.isdir(directory):
        raise UsageError(f"{flag} {path}: directory {directory} does not exist")
    return target, directory


def check_writable(flag: str, path: str, directory: str) -> None:
    try:
        with staging_folder(directory):
            pass
    except OSError as error:
        raise UsageError(f"{flag} {path}: cannot write in {directory}: {error.strerror}") from error


def named_files(paths: Sequence[str]) -> list[str]:
    """The files named on the command line, which a write must not replace:
    the images, and the file lists too."""
    return [path for path in paths if os.path.isfile(path)]


def check_file_target(
    flag: str,
    path: str,
    inputs: Iterable[str],
    overwrite: bool,
    ours: Callable[[str], bool],
    kind: str,
    overwrite_does: str = "",
) -> None:
    """Fails early, before any image is decoded, if the file `flag` names could
    not or should not be written: never over an input, and over another file
    than one of `kind` (which `ours` recognizes) only with --overwrite (the
    message adds `overwrite_does`, what else that flag would do). A symlink is
    judged by its target, which is what gets replaced."""
    target, directory = file_target(flag, path)
    if os.path.exists(target):
        identity = os.stat(target)
        if not stat.S_ISREG(identity.st_mode):
            raise UsageError(f"{flag} {path} exists and is not a regular file")
        if any(_is_file(identity, image) for image in inputs):
            raise UsageError(f"{flag} {path} is one of the inputs")
        if not overwrite and not ours(target):
            raise UsageError(
                f"{flag} {path} exists and is not {kind}; choose another path, or pass --overwrite to replace it"
                + overwrite_does
            )
    check_writable(flag, path, directory)


def check_output_path(path: str, inputs: Sequence[str], overwrite: bool) -> None:
    check_file_target("--out", path, inputs, overwrite, is_tokens_file, "a LumenBridge tokens file")


def expanded_inputs(paths: Sequence[str]) -> Iterator:
    """The inputs named on the command line (sources.Input), one at a time, or the sample photos if none were."""
    from lumenbridge.sources import Input, expand_inputs

    try:
        if paths:
            yield from expand_inputs(paths)
            return
        samples = sample_image_paths()
    except (FileNotFoundError, ValueError) as error:
        raise UsageError(str(error)) from error
    print(f"no PATHS given: tokenizing the {len(samples)} sample photos bundled with scikit-image", file=sys.stderr)
    yield from (Input("file", path) for path in samples)


def input_paths(paths: Sequence[str]) -> list[str]:
    """The image files named on the command line (list files expanded), for single-file output."""
    inputs = list(expanded_inputs(paths))
    tars = [item.path for item in inputs if item.kind == "tar"]
    if tars:
        raise UsageError(f"WebDataset tar inputs ({tars[0]}) need sharded output: --out DIR")
    return [item.path for item in inputs]


def is_directory_output(out: str) -> bool:
    """--out DIR or --out FILE: an existing folder, or a path not ending in .safetensors that is not an existing file."""
    if os.path.isdir(out) or out.endswith((os.sep, "/")):
        return True
    return not os.path.lexists(out) and not out.lower().endswith(".safetensors")


def default_batch_size(decode: str) -> int:
    """256 with --decode gpu, as the pipeline's benchmarks run: the decoding thread's
    reads of the workers' bytes and the model's launches cost per batch. 32 otherwise,
    where a batch's decoded images (and, with --max-tokens, its native-resolution
    activations) grow with it."""
    return 256 if decode == "gpu" else 32


def default_dtype(device: torch.device) -> str:
    """bfloat16 on CUDA (the fused kernels' dtype, half the bytes on disk), float32 elsewhere."""
    return "bfloat16" if device.type == "cuda" else "float32"


def preprocessing_sizes(args: argparse.Namespace, model: lumenbridge.VisualTokenizer) -> tuple[int, int]:
    """(image_size, resize) from the command line, defaulting to the model's configuration."""
    image_size = model.config.image_size if args.image_size is None else args.image_size
    try:
        model.feature_size(image_size, image_size)
    except ValueError as error:
        step = model.config.total_stride
        nearby = sorted({max(step, image_size // step * step), max(step, (image_size // step + 1) * step)})
        raise UsageError(
            f"--image-size {image_size}: must be a positive multiple of the model's total stride {step}; "
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
        return tuple(round(channel) for channel in model.config.pixel_mean)
    try:
        return ImageColor.getrgb(name)[:3]
    except ValueError as error:
        raise UsageError(f"--background {name!r}: {error}; use a colour name, #rrggbb or 'mean'") from error


def report_skipped(path: str, reason: str) -> None:
    # One line each, and no terminal control sequences from an untrusted file or member name.
    shown = path if path.isprintable() else repr(path)[1:-1]
    tqdm.write(f"skipped {shown}: {reason}", file=sys.stderr)


def selected_backend(device: torch.device, requested: str | None) -> str:
    """The name of the backend that will run the model on device; fails early on an impossible request."""
    try:
        return lumenbridge.select_backend(device, requested).name
    except (ValueError, RuntimeError) as error:
        raise UsageError(f"--backend: {error}" if requested else str(error)) from error


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


def check_common(args: argparse.Namespace) -> None:
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be positive, got {args.batch_size}")
    if args.workers is not None and args.workers < 0:
        raise UsageError(f"--workers must be zero or more, got {args.workers}")
    if args.max_pixels < 1:
        raise UsageError(f"--max-pixels must be positive, got {args.max_pixels}")
    if args.shard_size is not None and args.shard_size < 1:
        raise UsageError(f"--shard-size must be positive, got {args.shard_size}")
    if args.open_shards is not None and args.open_shards < 1:
        raise UsageError(f"--open-shards must be positive, got {args.open_shards}")
    if args.weights is not None and (args.preset is not None or args.seed is not None):
        raise UsageError("--preset and --seed pick a randomly initialized model; they cannot go with --weights")


def prepare_model(args, device: torch.device):
    """(model on device in --dtype, weights description, image_size, resize, background, dtype)."""
    model, weights = load_model(args)
    image_size, resize = preprocessing_sizes(args, model)
    background = background_color(args.background, model)
    dtype_name = args.dtype or default_dtype(device)
    return model, weights, image_size, resize, background, dtype_name


def run_tokenize(args: argparse.Namespace) -> int:
    from lumenbridge.distributed import Group

    if args.batch_size is None:
        args.batch_size = default_batch_size(args.decode)
    if is_directory_output(args.out):
        return run_tokenize_sharded(args, Group())
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        print("lumenbridge: error: under torchrun, --out must be a folder (sharded output)", file=sys.stderr)
        return EXIT_USAGE
    try:
        check_common(args)
        check_max_tokens(args)
        if args.decode != "cpu":
            raise UsageError("--decode gpu writes sharded output: use --out DIR")
        given = [flag for flag, value in SHARDED_ONLY.items() if getattr(args, value) not in (None, False)]
        if given:
            raise UsageError(f"{', '.join(given)} apply to sharded output: use --out DIR")
        paths = input_paths(args.paths)
        check_output_path(args.out, [*paths, *named_files(args.paths)], args.overwrite)
        device = resolve_device(args.device)
        backend = selected_backend(device, args.backend)
        model, weights, image_size, resize, background, dtype_name = prepare_model(args, device)
    except UsageError as error:
        print(f"lumenbridge: error: {error}", file=sys.stderr)
        return EXIT_USAGE

    dtype = TOKEN_DTYPES[dtype_name]
    model = model.to(device=device, dtype=dtype).eval()
    workers = min(4, usable_cpus()) if args.workers is None else args.workers
    if args.max_tokens is not None:
        args.workers = workers
        args.dtype = dtype_name
        return run_tokenize_packed(args, model, paths, device, backend, weights, background)
    result = tokenize_files(
        model,
        paths,
        image_size=image_size,
        resize=resize,
        batch_size=args.batch_size,
        workers=workers,
        dtype=dtype,
        max_pixels=args.max_pixels,
        background=background,
        on_failure=report_skipped,
    )
    preprocess = {"image_size": image_size, "resize": resize, "background": background, "max_pixels": args.max_pixels}
    return write_result(args, model, result, weights, preprocess, device, backend, len(paths))


def usable_cpus() -> int:
    """The CPUs this process may run on (a Slurm or cgroup CPU set, taskset), not the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_workers(group) -> int:
    """Decoding processes per rank: the usable CPUs shared between this machine's ranks, at most 16."""
    return max(1, min(16, usable_cpus() // max(1, group.local_world)))


def check_gpu_decode(device: torch.device) -> None:
    if device.type != "cuda":
        raise UsageError("--decode gpu needs a CUDA device")
    try:
        import torchvision.io
        import torchvision.ops  # noqa: F401
    except ImportError as error:
        raise UsageError(f"--decode gpu needs torchvision (the build for your torch): {error}") from error


def run_tokenize_sharded(args: argparse.Namespace, group) -> int:
    """tokenize --out DIR: sharded, resumable, on one process or every torchrun rank."""
    with contextlib.ExitStack() as held:  # rank 0's folder of the plan, in DIR for the whole run
        return tokenize_sharded(args, group, held)


def tokenize_sharded(args: argparse.Namespace, group, held: contextlib.ExitStack) -> int:
    from lumenbridge import pipeline, planning, shards
    from lumenbridge.distributed import rank_device

    created = not os.path.exists(args.out)

    def fail(error: Exception, this_rank_only: bool = False) -> int:
        """Exit 2 with the message, printed by rank 0 for an error every rank
        shares, by the rank itself for one of its own (its device, backend or
        weights), which the other ranks never see."""
        if this_rank_only and group.distributed:
            print(f"lumenbridge: error (rank {group.rank}): {error}", file=sys.stderr)
        elif group.main:
            print(f"lumenbridge: error: {error}", file=sys.stderr)
        held.close()
        if group.main and created:
            with contextlib.suppress(OSError):
                os.rmdir(args.out)  # only if still empty: nothing of a run was written yet
        group.close()
        return EXIT_USAGE

    try:
        check_common(args)
        if args.max_tokens is not None:
            raise UsageError("--max-tokens writes one file (--out FILE.safetensors); sharded output takes square crops")

        def plan_inputs() -> planning.Planned:
            """Expands the inputs into the plan's folder in DIR, made here, checked first."""
            shards.create_output_dir(args.out)
            shards.check_output_dir(args.out)
            with contextlib.ExitStack() as folder_held:
                folder = str(folder_held.enter_context(staging_folder(args.out, planning.FOLDER_PURPOSE)))
                planned = planning.write_inputs(folder, expanded_inputs(args.paths), shown=True)
                if args.report is not None:
                    own = itertools.chain((item.path for item in planning.read_inputs(folder)), named_files(args.paths))
                    check_report_path(args.report, args.out, own, args.overwrite)
                held.enter_context(folder_held.pop_all())
            return planned

        planned = group.from_main(plan_inputs)
    except (UsageError, OutputError) as error:
        return fail(error)
    except OSError as error:  # writing the expanded inputs in DIR (the expansion's own errors are usage errors)
        return fail(OutputError(f"cannot write {args.out}: {error}"))
    warm_up = None
    try:
        device = rank_device(resolve_device(args.device), group)
        if args.decode == "gpu":
            check_gpu_decode(device)
            # nvJPEG's set-up (about a second) overlaps the model's loading and the rest of the planning; `held` joins it.
            warm_up = held.enter_context(pipeline.decoder_warm_up(device))
        backend = selected_backend(device, args.backend)
        model, weights, image_size, resize, background, dtype_name = prepare_model(args, device)
    except (UsageError, OutputError) as error:
        return fail(error, this_rank_only=True)

    dtype = TOKEN_DTYPES[dtype_name]
    digest = pipeline.weights_digest(model)  # the weights as loaded: --dtype is recorded apart
    model = model.to(device=device, dtype=dtype).eval()
    options = pipeline.Options(
        out=args.out,
        shard_size=args.shard_size or DEFAULT_SHARD_SIZE,
        open_shards=args.open_shards or DEFAULT_OPEN_SHARDS,
        batch_size=args.batch_size,
        workers=default_workers(group) if args.workers is None else args.workers,
        decode=args.decode,
        image_size=image_size,
        resize=resize,
        max_pixels=args.max_pixels,
        background=background,
        dtype=dtype,
        device=device,
        backend=backend,
        grid=list(model.feature_size(image_size, image_size)),
        progress=True,
        on_failure=report_skipped,
    )
    try:
        result = pipeline.run(
            model,
            planned,
            options,
            weights=weights,
            digest=digest,
            overwrite=args.overwrite,
            allow_mixed=args.allow_mixed,
            group=group,
            warm_up=warm_up,
        )
    except OutputError as error:
        return fail(error)
    except OSError as error:
        print(f"lumenbridge: error: cannot write {args.out}: {error}", file=sys.stderr)
        group.close()
        return EXIT_USAGE
    group.close()
    if not group.main:
        return EXIT_OK
    print_sharded_summary(result, args.out, device, backend, dtype_name, args.decode)
    if args.report is not None:
        try:
            write_report(args.report, result, device, backend, dtype_name)
        except OSError as error:
            print(f"lumenbridge: error: the shards are complete, but --report {args.report}: {error}", file=sys.stderr)
            return EXIT_USAGE
    if result.images == 0 and result.skipped:
        print(
            f"lumenbridge: error: none of the {result.skipped} images could be read; listed in "
            f"{os.path.join(args.out, shards.ERRORS)}",
            file=sys.stderr,
        )
        return EXIT_OK if group.distributed else EXIT_USAGE
    if result.skipped:
        print(
            f"skipped {result.skipped} images that could not be read; listed in "
            f"{os.path.join(args.out, shards.ERRORS)}",
            file=sys.stderr,
        )
        return EXIT_OK if group.distributed else EXIT_SOME_SKIPPED
    return EXIT_OK


TIME_PARTS = (
    "decode",
    "gpu_decode",
    "gpu_jpeg",
    "gpu_warmup",
    "gpu_resize",
    "transfer",
    "tokenize",
    "write",
    "input_wait",
    "read_wait",
)
# Delays within each process's run, reported for the slowest process rather than summed.
DELAYS = ("first_batch", "last_writes")


def summary_numbers(result) -> dict:
    """The figures of the summary and the --report file."""
    totals = {part: sum(stats[part] for stats in result.stats) for part in TIME_PARTS}
    rank_seconds = sum(stats["wall"] for stats in result.stats) or float("nan")
    rate = result.images_this_run / result.wall if result.wall > 0 else float("nan")
    return {
        "images": result.images,
        "skipped": result.skipped,
        "images_this_run": result.images_this_run,
        "shards": result.shards,
        "shards_written": result.shards_written,
        "shards_already_done": result.shards_before,
        "processes": result.world,
        "wall_seconds": result.wall,
        "images_per_second": rate,
        "images_per_second_per_process": rate / result.world,
        "seconds": totals,
        "delays": {name: max(stats[name] for stats in result.stats) for name in DELAYS},
        "tokenize_share_of_wall": totals["tokenize"] / rank_seconds,
        "per_rank": result.stats,
        "token_shape": result.row_shape,
    }


def print_sharded_summary(result, out: str, device, backend: str, dtype: str, decode: str) -> None:
    numbers = summary_numbers(result)
    seconds = numbers["seconds"]
    print(
        f"tokenized {result.images} images into {result.shards} shards in {out} "
        f"({result.shards_written} written now, {result.shards_before} already done), "
        f"tokens {result.row_shape} {dtype} each"
    )
    print(
        f"wall time {result.wall:.1f} s: {numbers['images_per_second']:.1f} images/s end to end, "
        f"{numbers['images_per_second_per_process']:.1f} per process ({result.world} on {device.type}, backend: {backend})"
    )
    gpu_parts = (
        f"gpu decode {seconds['gpu_decode']:.1f} (nvJPEG {seconds['gpu_jpeg']:.1f}, "
        f"resize and crop {seconds['gpu_resize']:.1f}), nvJPEG's set-up {seconds['gpu_warmup']:.1f} (beside loading and planning), "
        if decode == "gpu"
        else ""
    )
    print(
        "where the time went (seconds, summed over processes): "
        f"decode {seconds['decode']:.1f} (in the workers), {gpu_parts}"
        f"transfer {seconds['transfer']:.1f}, tokenize {seconds['tokenize']:.1f} "
        f"({100 * numbers['tokenize_share_of_wall']:.0f}% of wall), write {seconds['write']:.1f}; "
        f"waiting for decoded images {seconds['input_wait']:.1f}; in the slowest process, first batch ready "
        f"after {numbers['delays']['first_batch']:.1f}, last writes {numbers['delays']['last_writes']:.1f}"
    )
    print(f"index: {os.path.join(out, 'index.jsonl')}")
    if result.repeated_keys.example is not None:
        key, sources = result.repeated_keys.example
        print(
            f"note: {result.repeated_keys.count} keys name more than one image (such as {key!r}, in "
            f"{' and '.join(sorted(set(sources))[:2])}); read_tokens(DIR).get(key, source=...) picks one",
            file=sys.stderr,
        )


def is_report_file(path: str) -> bool:
    """Whether path holds what --report writes."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and {"images", "shards", "images_per_second"} <= report.keys()


def check_report_path(report: str, out: str, inputs: Iterable[str], overwrite: bool) -> None:
    """--report must name a file that can be written (as check_file_target
    judges it), outside DIR (where the next run of the same command would
    take it for a foreign file)."""
    _, folder = file_target("--report", report)
    out = os.path.realpath(out)
    if os.path.commonpath([folder, out]) == out:
        raise UsageError(f"--report {report} is inside --out {out}; write it elsewhere")
    also = f" (which also deletes a run that --out {out} holds and starts it afresh)"
    check_file_target("--report", report, inputs, overwrite, is_report_file, "a LumenBridge report", also)


def write_report(path: str, result, device, backend: str, dtype: str) -> None:
    report = {**summary_numbers(result), "device": str(device), "backend": backend, "dtype": dtype}
    write_atomically(path, lambda staged: Path(staged).write_text(json.dumps(report, indent=2) + "\n"))


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
    print(lumenbridge.backends(build_missing=False))  # a status report does not compile for minutes
    return EXIT_OK


def run_build(args: argparse.Namespace) -> int:
    try:
        report = lumenbridge.extension.build()
    except lumenbridge.extension.BuildError as error:
        print(f"lumenbridge: build failed: {error}", file=sys.stderr)
        return EXIT_BUILD_FAILED
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
        help="tokenize images into a folder of shards or one safetensors file",
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
    tokenize.add_argument(
        "--out",
        required=True,
        help="output folder of shards (DIR), or one file (a path ending in .safetensors)",
    )
    tokenize.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out file that is not a LumenBridge tokens file; with --out DIR, discard the "
        "run there (another run's, or this one's, to retry the images it skipped) and start again",
    )
    tokenize.add_argument(
        "--shard-size", type=int, metavar="N", help=f"images per shard with --out DIR (default: {DEFAULT_SHARD_SIZE})"
    )
    tokenize.add_argument(
        "--open-shards",
        type=int,
        metavar="N",
        help="shards each process writes at once with --out DIR, each by its own thread, taking batches in turn: "
        "writes to one file do not run in parallel, so more than one keeps a fast disk busy; the shards' bytes "
        f"do not depend on it (default: {DEFAULT_OPEN_SHARDS})",
    )
    tokenize.add_argument(
        "--decode",
        choices=("cpu", "gpu"),
        default="cpu",
        help="cpu: Pillow in --workers processes; gpu: JPEGs decoded, resized and cropped on the GPU in batches "
        "(nvJPEG through torchvision), other images on the CPU; needs --out DIR (default: cpu)",
    )
    tokenize.add_argument(
        "--allow-mixed",
        action="store_true",
        help="continue a DIR whose shards were made with another --batch-size, device type, --backend or "
        "number of CPU threads, or run torchrun ranks whose settings differ from rank 0's (the tokens may then "
        "differ from an uninterrupted one-setting run in the last bits)",
    )
    tokenize.add_argument(
        "--report",
        metavar="FILE",
        help="also write the end-of-run summary as JSON to FILE (--out DIR; FILE outside DIR)",
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
    tokenize.add_argument(
        "--batch-size",
        type=int,
        help="images per batch (default: 256 with --decode gpu, 32 otherwise; a DIR begun with another "
        "batch size continues only with --allow-mixed)",
    )
    tokenize.add_argument(
        "--workers",
        type=int,
        help="image decoding processes (per rank); 0 decodes in this process (default: min(4, usable CPUs) for "
        "one file; with --out DIR the usable CPUs shared between this machine's ranks, at most 16; usable: "
        "the CPU affinity's)",
    )
    tokenize.add_argument("--device", help="torch device (default: cuda, else mps, else cpu)")
    tokenize.add_argument(
        "--backend", choices=sorted(BACKENDS), help="kernel backend for the model (default: chosen per device)"
    )
    tokenize.add_argument(
        "--dtype",
        choices=list(TOKEN_DTYPES),
        help="dtype of the model and of the stored tokens (default: bfloat16 on CUDA, where the fused kernels run "
        "in it and tokens take half the disk; float32 elsewhere)",
    )
    tokenize.set_defaults(handler=run_tokenize)

    info = commands.add_parser(
        "info",
        help="print versions, devices and kernel backends",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"exit codes:\n  0    printed\n  {EXIT_OUTPUT_CLOSED}  standard output was closed early "
        "(as in `lumenbridge info | head -1`)",
    )
    info.set_defaults(handler=run_info)

    build = commands.add_parser(
        "build",
        help="build the C++/CUDA extension now",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"exit codes:\n  0    built (or already built)\n  {EXIT_BUILD_FAILED}    the build failed; stderr says why",
    )
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
        print(f"lumenbridge: error: the run stopped on an unexpected error; {crash_outcome(args)}", file=sys.stderr)
        return EXIT_CRASH


def crash_outcome(args: argparse.Namespace) -> str:
    """What a crash left behind: sharded output keeps every shard finished before it."""
    out = getattr(args, "out", None)
    if out is not None and is_directory_output(out):
        return "the shards finished before it are kept, and the same command resumes the run"
    return "no output was written"


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
