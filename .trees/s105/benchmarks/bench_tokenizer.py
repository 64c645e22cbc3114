"""Whole-tokenizer benchmark on a CUDA GPU: lumenbridge-base with the native
kernels against the reference backend (cuDNN through F.conv2d) and
torch.compile of the reference, in one run. It decides dispatch.DEFAULTS for
CUDA tensors in each layout.

Cases: B=256 images of 224x224, float32 and bfloat16 parameters, NCHW and
channels-last input; inference forward, and a training step (forward, the
loss .float().square().mean(), backward to every parameter and the input).
"native" is VisualTokenizer's native backend as it dispatches today: the
fused op where it covers the configuration (bfloat16), the composed op
otherwise (float32). cuDNN's autotuner is on for every provider.

Usage: python benchmarks/bench_tokenizer.py [--out DIR]   (needs a CUDA GPU)
Prints a Markdown table; with --out also writes DIR/tokenizer.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from bench_depthwise import DTYPES, LAYOUTS, environment, median_ms

from lumenbridge import VisualTokenizer, native

BATCH = 256
SIDE = 224


def timings(model, images) -> tuple[float, float]:
    """(inference forward ms, training step ms)."""

    def train_step():
        model.zero_grad(set_to_none=True)  # each step writes its gradients, none accumulates
        x = images.detach().requires_grad_(True)
        model(x).float().square().mean().backward()

    with torch.no_grad():
        forward = median_ms(lambda: model(images))
    return forward, median_ms(train_step)


def rows():
    result = []
    for dtype_name, dtype in DTYPES.items():
        for layout, fmt in LAYOUTS.items():
            images = torch.randn(BATCH, 3, SIDE, SIDE, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
            models = {name: VisualTokenizer(backend=name, seed=0).to("cuda", dtype) for name in ("native", "reference")}
            torch.compiler.reset()
            models["compile"] = torch.compile(models["reference"], dynamic=False)
            for impl, model in models.items():
                forward, train = timings(model, images)
                result.append(
                    {"dtype": dtype_name, "layout": layout, "impl": impl, "forward_ms": forward, "train_ms": train}
                )
                print(f"done {dtype_name} {layout} {impl}", flush=True)
            torch.cuda.empty_cache()
    return result


def markdown(env: dict, table_rows: list[dict]) -> str:
    lines = [
        (
            f"GPU {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, "
            f"Python {env['python']}, {env['date']}; lumenbridge-base, B={BATCH}, {SIDE}x{SIDE}. Median ms. "
            "native: the native backend's tokenize op (fused in bfloat16, composed in float32); training step: "
            "forward, .float().square().mean(), backward to every parameter and the input; cuDNN autotuner "
            f"{'on' if env['cudnn_benchmark'] else 'off'}."
        ),
        "",
        "| dtype | layout | impl | forward ms | training step ms |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['dtype']} | {r['layout']} | {r['impl']} | {r['forward_ms']:.2f} | {r['train_ms']:.2f} |"
        for r in table_rows
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available() or not native.ready():
        raise SystemExit("needs a CUDA GPU and the built LumenBridge extension")
    torch.backends.cudnn.benchmark = True  # cuDNN's tuned algorithms, what a tuning user gets
    table = markdown(environment(), rows())
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tokenizer.md").write_text(table)


if __name__ == "__main__":
    main()
