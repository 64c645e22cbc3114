"""Packed native-resolution tokens: what forward_packed costs on 64 mixed-size images.

forward_packed batches images of one size together, so it should cost little
more than running those same-size batches directly. Measured in one run, on
the same 64 images (8 sizes x 8 images, shuffled, about 256 tokens each):

- packed: model.forward_packed(images);
- same-size batches: model(stacked batch) for each of the 8 sizes, back to back;
- one by one: model(image[None]) for each image;
- padded batch: every image zero-padded to the largest height and width,
  then one model(batch) (the usual alternative to packing).

Usage: python benchmarks/bench_packed.py [--preset lumenbridge-base] [--backends native reference] [--repeats 5]
(prints a Markdown table)
"""

from __future__ import annotations

import argparse
import datetime
import platform
import random
import statistics
import time

import torch
import torch.nn.functional as F

from lumenbridge import TokenizerConfig, VisualTokenizer

# (rows, columns) of tokens: aspect ratios from 1:1 to 1:4 at about 256 tokens.
GRIDS = [(16, 16), (14, 18), (18, 14), (12, 21), (21, 12), (10, 26), (26, 10), (8, 32)]
PER_SIZE = 8


def median_ms(paths: dict, repeats: int) -> dict[str, float]:
    """Median time of each path; the paths take turns in every repeat, so a change
    in the machine's load during the run affects them alike."""
    times = {name: [] for name in paths}
    for fn in paths.values():
        fn()
    for _ in range(repeats):
        for name, fn in paths.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def make_images(stride: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    images = [
        torch.randn(3, rows * stride, columns * stride, generator=generator)
        for rows, columns in GRIDS
        for _ in range(PER_SIZE)
    ]
    random.Random(0).shuffle(images)
    return images


def measure(model: VisualTokenizer, images: list[torch.Tensor], repeats: int) -> dict[str, float]:
    sizes = sorted({tuple(image.shape[1:]) for image in images})
    batches = [torch.stack([image for image in images if tuple(image.shape[1:]) == size]) for size in sizes]
    height, width = max(s[0] for s in sizes), max(s[1] for s in sizes)
    padded = torch.stack([F.pad(image, (0, width - image.shape[2], 0, height - image.shape[1])) for image in images])
    paths = {
        "packed (forward_packed)": lambda: model.forward_packed(images),
        "same-size batches, summed": lambda: [model(batch) for batch in batches],
        "one by one": lambda: [model(image[None]) for image in images],
        f"padded batch ({height}x{width})": lambda: model(padded),
    }
    with torch.inference_mode():
        return median_ms(paths, repeats)


def markdown(results: dict[str, dict[str, float]], preset: str, tokens: int) -> str:
    lines = [
        (
            f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; "
            f"torch {torch.__version__}; Python {platform.python_version()}; {datetime.date.today().isoformat()}; "
            f"{preset}; {len(GRIDS) * PER_SIZE} images in {len(GRIDS)} sizes, {tokens} tokens in all. Median ms."
        ),
        "",
        "| backend | path | ms | vs same-size batches |",
        "|---|---|---|---|",
    ]
    for backend, rows in results.items():
        baseline = rows["same-size batches, summed"]
        lines += [f"| {backend} | {name} | {ms:.1f} | {ms / baseline:.2f}x |" for name, ms in rows.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="lumenbridge-base")
    parser.add_argument("--backends", nargs="+", default=["native", "reference"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    config = TokenizerConfig.preset(args.preset)
    images = make_images(config.total_stride)
    results = {
        backend: measure(VisualTokenizer(config, backend=backend, seed=0).eval(), images, args.repeats)
        for backend in args.backends
    }
    tokens = sum(rows * columns for rows, columns in GRIDS) * PER_SIZE
    print(markdown(results, args.preset, tokens))


if __name__ == "__main__":
    main()
