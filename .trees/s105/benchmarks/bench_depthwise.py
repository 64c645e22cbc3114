"""Depthwise 3x3 benchmark: LumenBridge's kernels against cuDNN (PyTorch's
F.conv2d with groups=C, which is also what the reference backend runs on a
GPU) and torch.compile, all in one run, with the device's copy bandwidth
measured in the same run as the ceiling. cuDNN's autotuner is on
(torch.backends.cudnn.benchmark) for every provider.

Reports median milliseconds and achieved bandwidth counting each input read
once and each output written once:
  forward   x + y
  backward  grad_y + x (read) and grad_x (written); dW/db are negligible.
Backward rows also time dx and dW on their own, for LumenBridge and cuDNN.

Usage: python benchmarks/bench_depthwise.py --out DIR   (needs a CUDA GPU)
Writes DIR/depthwise.json, DIR/depthwise.md and DIR/depthwise.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from lumenbridge import native

BATCH = 256
KERNEL = 3
# (channels, side, stride): the shapes; three are lumenbridge-base's stages 2-4.
SHAPES = [(96, 112, 1), (96, 112, 2), (192, 56, 2), (384, 28, 2), (768, 56, 1)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LAYOUTS = {"NCHW": torch.contiguous_format, "NHWC": torch.channels_last}


def median_ms(fn, warmup: int = 5, repeats: int = 25) -> float:
    """Median of CUDA-event timings of fn() after warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 2 GiB, counting bytes read plus written."""
    src = torch.empty(2**31, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def cudnn_backward(grad, x, w, stride, mask=(True, True)):
    """cuDNN's gradients; mask picks (grad_input, grad_weight)."""
    return torch.ops.aten.convolution_backward(
        grad, x, w, None, [stride] * 2, [KERNEL // 2] * 2, [1, 1], False, [0, 0], x.shape[1], [*mask, False]
    )


def lumenbridge_backward_input(grad, x, w, stride):
    return torch.ops.lumenbridge.depthwise_conv2d_backward_input(grad, w, stride, list(x.shape[2:]))


def lumenbridge_backward_weight(grad, x, w, stride):
    return torch.ops.lumenbridge.depthwise_conv2d_backward_weight(grad, x, KERNEL, stride)


def lumenbridge_backward(grad, x, w, stride):
    return lumenbridge_backward_input(grad, x, w, stride), lumenbridge_backward_weight(grad, x, w, stride)


def conv(x, w, stride):
    return F.conv2d(x, w, None, stride, KERNEL // 2, 1, x.shape[1])


def bench_case(channels, side, stride, dtype, layout):
    fmt = LAYOUTS[layout]
    x = torch.randn(BATCH, channels, side, side, device="cuda", dtype=DTYPES[dtype]).contiguous(memory_format=fmt)
    w = torch.randn(channels, 1, KERNEL, KERNEL, device="cuda", dtype=DTYPES[dtype])
    y = conv(x, w, stride)
    grad = torch.randn_like(y).contiguous(memory_format=fmt)
    # A fresh compile per case: Dynamo's cache of a function holds 8 entries, and
    # past them the compiled wrappers run eagerly (cuDNN under the compile label).
    torch.compiler.reset()
    compiled_forward = torch.compile(conv, dynamic=False)
    compiled_backward = torch.compile(cudnn_backward, dynamic=False)
    fwd_bytes = (x.numel() + y.numel()) * x.element_size()
    bwd_bytes = (2 * x.numel() + grad.numel()) * x.element_size()
    timings = {
        ("forward", "lumenbridge"): median_ms(lambda: torch.ops.lumenbridge.depthwise_conv2d(x, w, None, stride)),
        ("forward", "cudnn"): median_ms(lambda: conv(x, w, stride)),
        ("forward", "compile"): median_ms(lambda: compiled_forward(x, w, stride)),
        ("backward", "lumenbridge"): median_ms(lambda: lumenbridge_backward(grad, x, w, stride)),
        ("backward", "cudnn"): median_ms(lambda: cudnn_backward(grad, x, w, stride)),
        ("backward", "compile"): median_ms(lambda: compiled_backward(grad, x, w, stride)),
        # The backward's two parts on their own, to show where its time goes.
        ("dx", "lumenbridge"): median_ms(lambda: lumenbridge_backward_input(grad, x, w, stride)),
        ("dW", "lumenbridge"): median_ms(lambda: lumenbridge_backward_weight(grad, x, w, stride)),
        ("dx", "cudnn"): median_ms(lambda: cudnn_backward(grad, x, w, stride, (True, False))),
        ("dW", "cudnn"): median_ms(lambda: cudnn_backward(grad, x, w, stride, (False, True))),
    }
    breakdown = {
        f"{part}_{impl}_ms": timings[(part, impl)] for part in ("dx", "dW") for impl in ("lumenbridge", "cudnn")
    }
    rows = []
    for direction, nbytes in (("forward", fwd_bytes), ("backward", bwd_bytes)):
        ours, cudnn = timings[(direction, "lumenbridge")], timings[(direction, "cudnn")]
        rows.append(
            dict(
                shape=f"C={channels} {side}x{side} s{stride}",
                dtype=dtype,
                layout=layout,
                direction=direction,
                bytes=nbytes,
                lumenbridge_ms=ours,
                cudnn_ms=cudnn,
                compile_ms=timings[(direction, "compile")],
                lumenbridge_gbs=nbytes / ours / 1e6,
                cudnn_gbs=nbytes / cudnn / 1e6,
                speedup_vs_cudnn=cudnn / ours,
                **(breakdown if direction == "backward" else {}),
            )
        )
    return rows


def environment() -> dict:
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }


def markdown(env: dict, copy_gbs: float, rows: list[dict]) -> str:
    lines = [
        (
            f"GPU {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, "
            f"Python {env['python']}, {env['date']}; B={BATCH}, K={KERNEL}; cuDNN autotuner "
            f"{'on' if env['cudnn_benchmark'] else 'off'}."
        ),
        f"Copy bandwidth measured in the same run: {copy_gbs:.0f} GB/s (read + write).",
        "",
        (
            "| shape | dtype | layout | pass | LumenBridge ms | GB/s | % of copy | cuDNN ms | cuDNN GB/s | compile ms "
            "| speed-up vs cuDNN | dx / dW ms, LumenBridge | dx / dW ms, cuDNN |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        parts = ["", ""]
        if r["direction"] == "backward":
            parts = [f"{r[f'dx_{impl}_ms']:.3f} / {r[f'dW_{impl}_ms']:.3f}" for impl in ("lumenbridge", "cudnn")]
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['layout']} | {r['direction']} | {r['lumenbridge_ms']:.3f} | "
            f"{r['lumenbridge_gbs']:.0f} | {100 * r['lumenbridge_gbs'] / copy_gbs:.0f}% | {r['cudnn_ms']:.3f} | "
            f"{r['cudnn_gbs']:.0f} | {r['compile_ms']:.3f} | {r['speedup_vs_cudnn']:.2f}x | {parts[0]} | {parts[1]} |"
        )
    return "\n".join(lines) + "\n"


def plot(path: Path, copy_gbs: float, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(16, 6), sharey=True)
    for ax, direction in zip(axes, ("forward", "backward")):
        subset = [r for r in rows if r["direction"] == direction]
        labels = [f"{r['shape']}\n{r['dtype']} {r['layout']}" for r in subset]
        positions = range(len(subset))
        ax.bar([p - 0.2 for p in positions], [r["lumenbridge_gbs"] for r in subset], 0.4, label="LumenBridge")
        ax.bar([p + 0.2 for p in positions], [r["cudnn_gbs"] for r in subset], 0.4, label="cuDNN")
        ax.axhline(copy_gbs, color="black", linestyle="--", label=f"copy {copy_gbs:.0f} GB/s")
        ax.axhline(0.9 * copy_gbs, color="grey", linestyle=":", label="90% of copy")
        ax.set_xticks(list(positions), labels, rotation=90, fontsize=6)
        ax.set_title(f"depthwise 3x3 {direction}, B={BATCH}")
        ax.set_ylabel("GB/s (inputs read once + outputs written once)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available() or not native.ready():
        raise SystemExit("needs a CUDA GPU and the built LumenBridge extension")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.backends.cudnn.benchmark = True  # cuDNN's tuned algorithms, what a tuning user gets
    env = environment()
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    for channels, side, stride in SHAPES:
        for dtype in DTYPES:
            for layout in LAYOUTS:
                rows += bench_case(channels, side, stride, dtype, layout)
                print(f"done C={channels} {side} s{stride} {dtype} {layout}", flush=True)
                torch.cuda.empty_cache()
    (args.out / "depthwise.json").write_text(
        json.dumps({"environment": env, "batch": BATCH, "kernel": KERNEL, "copy_gbs": copy_gbs, "rows": rows}, indent=2)
    )
    table = markdown(env, copy_gbs, rows)
    (args.out / "depthwise.md").write_text(table)
    plot(args.out / "depthwise.png", copy_gbs, rows)
    print(table)


if __name__ == "__main__":
    main()
