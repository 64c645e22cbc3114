"""CPU benchmark: LumenBridge's C++ kernels against the PyTorch reference
(oneDNN through F.conv2d) and torch.compile of the reference, in one run.
It decides dispatch.DEFAULTS["cpu"].

Cases: the depthwise convolutions of lumenbridge-base's four stages at B=8
(forward, and forward + all gradients), and the whole tokenizer (forward, and
a training step: forward + the gradients of every parameter), each in NCHW and
channels-last. The tokenizer part also gives its floors, from this machine's
float32 matmul rate and copy bandwidth measured in the same run: the
arithmetic floor (the pointwise convolutions' FLOPs; a training step's three
times that, for the two products of the backward) and the byte floor of
stages run separately (each stage output written and read once).

Usage: python benchmarks/bench_cpu.py [--parts depthwise tokenizer] [--out DIR]
(prints a Markdown table)
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import statistics
import time
from pathlib import Path

import torch

from lumenbridge import VisualTokenizer, native, reference

BATCH = 8
# (channels, input side) of lumenbridge-base's depthwise convs (all 3x3, stride 2) at 224.
STAGES = [(3, 224), (96, 112), (192, 56), (384, 28)]
FORMATS = {"NCHW": torch.contiguous_format, "NHWC": torch.channels_last}


def median_ms(fn, repeats: int = 7, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def depthwise_rows():
    rows = []
    for channels, side in STAGES:
        for layout, fmt in FORMATS.items():
            x = torch.randn(BATCH, channels, side, side).contiguous(memory_format=fmt)
            w = torch.randn(channels, 1, 3, 3)
            b = torch.randn(channels)
            impls = {
                "native": lambda x, w, b: torch.ops.lumenbridge.depthwise_conv2d(x, w, b, 2),
                "reference": lambda x, w, b: reference.depthwise_conv2d(x, w, b, 2),
            }
            torch.compiler.reset()  # a fresh compile per case, not a recompile-limited cache
            impls["compile"] = torch.compile(impls["reference"], dynamic=False)
            for name, fn in impls.items():
                xg, wg, bg = (t.detach().requires_grad_(True) for t in (x, w, b))

                def train_step(fn=fn, xg=xg, wg=wg, bg=bg):
                    return torch.autograd.grad(fn(xg, wg, bg).sum(), (xg, wg, bg))

                with torch.no_grad():
                    forward = median_ms(lambda fn=fn, x=x, w=w, b=b: fn(x, w, b))
                rows.append(
                    {
                        "case": f"dw C={channels} {side}² s2",
                        "layout": layout,
                        "impl": name,
                        "forward": forward,
                        "train": median_ms(train_step),
                    }
                )
    return rows


def copy_gbs() -> float:
    """Copy of 512 MiB, counting bytes read plus written."""
    source = torch.empty(2**29, dtype=torch.uint8).random_()
    target = torch.empty_like(source)
    return 2 * source.numel() / median_ms(lambda: target.copy_(source)) / 1e6


def matmul_tflops() -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return 2 * 2048**3 / median_ms(lambda: a @ b) / 1e9


def floor_rows(config) -> list[dict]:
    from bench_fused import floors_ms

    floors = floors_ms(config, BATCH, 224, copy_gbs(), matmul_tflops(), element=4, pixel=4)
    return [
        {"case": "tokenizer 224²", "layout": "", "impl": f"floor: {name}", "forward": ms, "train": train}
        for name, ms, train in (
            ("arithmetic", floors["arithmetic"], 3 * floors["arithmetic"]),
            ("stages separate", floors["stages separate"], float("nan")),
        )
    ]


def model_rows():
    rows = []
    images = torch.randn(BATCH, 3, 224, 224)
    for layout, fmt in FORMATS.items():
        x = images.contiguous(memory_format=fmt)
        models = {name: VisualTokenizer(backend=name, seed=0).eval() for name in ("native", "reference")}
        torch.compiler.reset()  # a fresh compile per layout, not a recompile-limited cache
        models["compile"] = torch.compile(models["reference"], dynamic=False)
        for name, model in models.items():
            parameters = list(model.parameters())

            def train_step(model=model, x=x, parameters=parameters):
                return torch.autograd.grad(model(x).sum(), parameters)

            # Two warm-up calls: the compiled model compiles on the first of each mode.
            with torch.no_grad():
                forward = median_ms(lambda model=model, x=x: model(x), repeats=5, warmup=2)
            train = median_ms(train_step, repeats=5, warmup=2)
            rows.append({"case": "tokenizer 224²", "layout": layout, "impl": name, "forward": forward, "train": train})
    return rows + floor_rows(models["native"].config)


def markdown(rows) -> str:
    lines = [
        (
            f"CPU: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; torch {torch.__version__}; "
            f"Python {platform.python_version()}; {datetime.date.today().isoformat()}; B={BATCH}. Median ms."
        ),
        "",
        "| case | layout | impl | forward ms | forward + backward ms |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        forward, train = ("n/a" if math.isnan(ms) else f"{ms:.2f}" for ms in (r["forward"], r["train"]))
        lines.append(f"| {r['case']} | {r['layout']} | {r['impl']} | {forward} | {train} |")
    return "\n".join(lines) + "\n"


PARTS = {"depthwise": depthwise_rows, "tokenizer": model_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not native.ready():
        raise SystemExit("the LumenBridge extension did not build")
    table = markdown([row for part in args.parts for row in PARTS[part]()])
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cpu.md").write_text(table)


if __name__ == "__main__":
    main()
