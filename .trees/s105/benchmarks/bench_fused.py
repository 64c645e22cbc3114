"""Whole-tokenizer forward on a CUDA GPU: LumenBridge (VisualTokenizer, which
calls the fused op torch.ops.lumenbridge.tokenize) against its peers in the
same run, with the floors.

Providers (same architecture, same weights):
  lumenbridge     VisualTokenizer on the native backend (the one fused op)
  eager           the architecture in plain PyTorch (PlainTokenizer below)
  compile-ma      torch.compile(PlainTokenizer, mode="max-autotune-no-cudagraphs")
  compile-ro      torch.compile(PlainTokenizer, mode="reduce-overhead") (CUDA graphs; small batches)
  lumenbridge-graph  the same VisualTokenizer call captured in a CUDA graph and replayed (small batches)
  vit-patch       ViT-B/16's patch embedding (Conv2d 3 -> 768, 16 x 16, stride 16), for scale
Floors, per dtype and input kind: the pointwise FLOPs at the matmul rate
measured in the row's dtype (fp32 with TF32 where cuDNN may use it, as the
op may), and at the measured copy bandwidth the bytes each fusion level
must move at least: the image once (1 byte a pixel value for uint8), each
stage output written and read once where it crosses device memory, and the
tokens written once.
cuDNN's autotuner is on (torch.backends.cudnn.benchmark), so the PyTorch
peers run the algorithms that suit each shape, as a user tuning them would.

Each row also records peak forward memory above the inputs
(torch.cuda.max_memory_allocated). At B=256 bf16 224² it also times one
training step (forward + backward of a fixed cotangent to every parameter)
of LumenBridge (through the op; through the op with float32 parameters
under bf16 autocast, whose target is within 10% of the bf16 step; and layer
by layer), of the eager plain module and of its max-autotune compile. Usage:
  python benchmarks/bench_fused.py --out DIR [--quick | --cases DTYPE:B:SIDE ...] [--providers NAME ...]
--quick times only bf16 at B=1 and B=256 and fp32 at B=256 (for a tight device budget);
--cases times the named cases, in that order (e.g. bf16:256:224 fp16:64:448);
--providers keeps only the named forward providers (the floors always stay; the
training steps at B=256 bf16 224² always run).
Writes DIR/fused.json, DIR/fused.md and DIR/fused.png, rewritten after each
case, so a run cut short keeps every case it finished.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
from bench_depthwise import copy_bandwidth_gbs, environment, median_ms
from torch import nn

from lumenbridge import TokenizerConfig, VisualTokenizer, native

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (batch, side): the cases.
SIZES = [(1, 224), (8, 224), (64, 224), (256, 224), (64, 448)]


class PlainTokenizer(nn.Module):
    """The tokenizer as a user writes it in plain PyTorch, sharing the
    parameters of a VisualTokenizer."""

    def __init__(self, model: VisualTokenizer):
        super().__init__()
        self.stages = nn.ModuleList(nn.Sequential(s.dw, s.pw) for s in model.stages)
        self.act, self.norm = model.act, model.token_norm
        self.register_buffer("mean", model.pixel_mean)
        self.register_buffer("std", model.pixel_std)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images
        if x.dtype == torch.uint8:
            dtype = self.stages[0][0].weight.dtype
            x = (x.to(dtype) - self.mean.to(dtype)) / self.std.to(dtype)
        for i, stage in enumerate(self.stages):
            x = stage(x)
            x = self.act(x) if i + 1 < len(self.stages) else x
        return self.norm(x.flatten(2).transpose(1, 2))


def matmul_tflops(dtype: torch.dtype) -> float:
    """The matmul rate in dtype; fp32 with TF32 exactly where cuDNN may use
    it, since the op's fp32 honours that switch."""
    a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    b = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    matmul = torch.backends.cuda.matmul
    allowed, matmul.allow_tf32 = matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        return 2 * 8192**3 / median_ms(lambda: a @ b) / 1e9
    finally:
        matmul.allow_tf32 = allowed


def floors_ms(
    config: TokenizerConfig, batch: int, side: int, copy_gbs: float, tflops: float, element: int, pixel: int
) -> dict:
    """The arithmetic floor and three byte floors, for activations of
    `element` bytes and images of `pixel` bytes a value."""
    widths = (config.in_chans, *config.stage_widths)
    sides, s = [side], side
    for stride in config.strides:
        s = -(-s // stride)
        sides.append(s)
    flops = sum(2 * sides[i + 1] ** 2 * widths[i] * widths[i + 1] for i in range(len(widths) - 1))
    out = [element * sides[i + 1] ** 2 * widths[i + 1] for i in range(len(widths) - 1)]  # bytes per stage output
    image = pixel * side * side * config.in_chans

    def ms(bytes_per_image):
        return batch * bytes_per_image / copy_gbs / 1e6

    return {
        "arithmetic": batch * flops / tflops / 1e9,
        "stages separate": ms(image + 2 * sum(out[:-1]) + out[-1]),
        "1+2 fused": ms(image + 2 * sum(out[1:-1]) + out[-1]),
        "1+2, 3+4 fused": ms(image + 2 * out[1] + out[-1]),
    }


def peak_mb(fn, inputs: torch.Tensor) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def graphed(model: VisualTokenizer):
    """model as a CUDA graph replay: one graph per input dtype, shape and
    strides, captured on the first call with them (a graph replays only the
    kernels it captured, so float images need a graph of their own)."""
    graphs = {}

    def call(x):
        key = (x.dtype, x.shape, x.stride())
        if key not in graphs:
            static = x.clone()
            model(static)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                output = model(static)
            graphs[key] = (static, graph, output)
        static, graph, output = graphs[key]
        static.copy_(x)
        graph.replay()
        return output

    return call


# Providers replaying CUDA graphs: their memory pool is allocated at capture,
# in the warm-up, so a peak measured afterwards says nothing.
GRAPHED = ("compile-ro", "lumenbridge-graph")


# What providers() may return; --providers takes these names.
PROVIDERS = ("lumenbridge", "eager", "compile-ma", "compile-ro", "lumenbridge-graph", "vit-patch")


def providers(model: VisualTokenizer, batch: int):
    plain = PlainTokenizer(model)
    torch.compiler.reset()
    result = {
        "lumenbridge": model,
        "eager": plain,
        "compile-ma": torch.compile(plain, mode="max-autotune-no-cudagraphs", dynamic=False),
    }
    if batch <= 8:  # CUDA-graph providers (GRAPHED)
        result["compile-ro"] = torch.compile(PlainTokenizer(model), mode="reduce-overhead", dynamic=False)
        result["lumenbridge-graph"] = graphed(model)
    patch = nn.Conv2d(3, 768, 16, 16).to("cuda", model.stages[0].dw.weight.dtype)
    result["vit-patch"] = lambda x: patch(x).flatten(2).transpose(1, 2)
    return result


def training_step(fn, parameters: list[torch.Tensor], x: torch.Tensor, cotangent: torch.Tensor):
    """One training step of fn's parameters: forward, then backward of a fixed
    cotangent to every parameter (gradients reset each time)."""

    def step():
        for p in parameters:
            p.grad = None
        fn(x).backward(cotangent)

    return step


def training_rows(model: VisualTokenizer, batch: int, side: int, dtype_name: str, x: torch.Tensor) -> list[dict]:
    """Training-step time and peak memory (forward + backward) of LumenBridge
    (through the op; through the op with float32 parameters under autocast to
    the row's dtype, as mixed-precision training runs it; and layer by layer
    through the native per-layer kernels, the path the training default could
    take), the eager plain module and its max-autotune compile, same weights,
    float input."""
    model.train()
    plain = PlainTokenizer(model)
    parameters = [p for p in model.parameters() if p.requires_grad]
    master = copy.deepcopy(model).float()
    cotangent = torch.randn_like(model(x))

    def autocast_forward(images: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=x.dtype):
            return master(images)

    rows = []
    torch.compiler.reset()
    compiled = torch.compile(plain, mode="max-autotune-no-cudagraphs", dynamic=False)
    steps = (
        ("lumenbridge train", model, parameters),
        ("lumenbridge autocast train", autocast_forward, list(master.parameters())),
        ("lumenbridge layers train", lambda images: model.forward_layers(images, "native"), parameters),
        ("eager train", plain, parameters),
        ("compile-ma train", compiled, parameters),
    )
    for name, fn, trained in steps:
        step = training_step(fn, trained, x, cotangent)
        ms = median_ms(step, warmup=5, repeats=20)
        rows.append(
            {
                "dtype": dtype_name,
                "batch": batch,
                "side": side,
                "provider": name,
                "input": "float",
                "ms": ms,
                "peak_mb": peak_mb(step, x),
                "path": "",
            }
        )
        print(f"{dtype_name} B={batch} {side} {name}: {ms:.4f} ms", flush=True)
    model.eval()
    return rows


def parse_case(text: str) -> tuple[str, int, int]:
    dtype, batch, side = text.split(":")
    if dtype not in DTYPES:
        raise argparse.ArgumentTypeError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype, int(batch), int(side)


def run(cases: list[tuple[str, int, int]], keep: list[str] | None, out: Path) -> None:
    torch.backends.cudnn.benchmark = True  # before environment(), which records it
    env = environment()
    copy_gbs = copy_bandwidth_gbs()
    tflops = {name: matmul_tflops(DTYPES[name]) for name in dict.fromkeys(d for d, _, _ in cases)}
    config = TokenizerConfig.preset("lumenbridge-base")
    rows = []
    result = {"environment": env, "copy_gbs": copy_gbs, "matmul_tflops": tflops, "rows": rows}
    for dtype_name, batch, side in cases:
        dtype = DTYPES[dtype_name]
        model = VisualTokenizer(config, seed=0).to("cuda", dtype).eval()
        uint8 = torch.randint(0, 256, (batch, 3, side, side), dtype=torch.uint8, device="cuda")
        floats = torch.randn(batch, 3, side, side, device="cuda", dtype=dtype)
        inputs = {
            "uint8": uint8.contiguous(memory_format=torch.channels_last),
            "float": floats.contiguous(memory_format=torch.channels_last),
        }
        path = native.tokenize_path("cuda", config, dtype)
        for name, fn in providers(model, batch).items():
            if keep and name not in keep:
                continue
            for kind, x in inputs.items():
                if name == "vit-patch" and kind == "uint8":
                    continue
                with torch.inference_mode():
                    ms = median_ms(lambda fn=fn, x=x: fn(x), warmup=10, repeats=50)
                    memory = None if name in GRAPHED else peak_mb(lambda fn=fn, x=x: fn(x), x)
                rows.append(
                    {
                        "dtype": dtype_name,
                        "batch": batch,
                        "side": side,
                        "provider": name,
                        "input": kind,
                        "ms": ms,
                        "peak_mb": memory,
                        "path": path if name == "lumenbridge" else "",
                    }
                )
                print(f"{dtype_name} B={batch} {side} {name} {kind}: {ms:.4f} ms, {megabytes(memory)} MB", flush=True)
        if dtype_name == "bf16" and batch == 256 and side == 224:
            rows += training_rows(model, batch, side, dtype_name, inputs["float"])
        element = torch.empty((), dtype=dtype).element_size()
        for kind, x in inputs.items():
            floors = floors_ms(config, batch, side, copy_gbs, tflops[dtype_name], element, x.element_size())
            rows += [
                {
                    "dtype": dtype_name,
                    "batch": batch,
                    "side": side,
                    "provider": f"floor: {k}",
                    "input": kind,
                    "ms": v,
                    "peak_mb": None,
                    "path": "",
                }
                for k, v in floors.items()
            ]
        del model, inputs
        torch.cuda.empty_cache()
        write(result, out)


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "fused.json").write_text(json.dumps(result, indent=1))
    (out / "fused.md").write_text(markdown(result))
    plot(result, out / "fused.png")


def megabytes(peak: float | None) -> str:
    return "n/a" if peak is None else f"{peak:.0f}"


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [
        (
            f"GPU {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, "
            f"Python {env['python']}, {env['date']}; lumenbridge-base, channels-last input. "
            f"Copy {result['copy_gbs']:.0f} GB/s, matmul "
            + ", ".join(f"{d} {t:.0f}" for d, t in result["matmul_tflops"].items())
            + " TFLOP/s (same run). "
            "Median ms; peak MB above the inputs (n/a for floors and for CUDA-graph replays, whose pool "
            "is allocated at capture)."
        ),
        "",
        "| dtype | B | side | provider | input | ms | vs lumenbridge | peak MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = result["rows"]
    for r in rows:
        reference = "lumenbridge train" if r["provider"].endswith(" train") else "lumenbridge"
        ours = next(
            (
                o["ms"]
                for o in rows
                if o["provider"] == reference
                and o["input"] == r["input"]
                and (o["dtype"], o["batch"], o["side"]) == (r["dtype"], r["batch"], r["side"])
            ),
            None,
        )
        ratio = f"{r['ms'] / ours:.2f}x" if ours else ""
        lines.append(
            f"| {r['dtype']} | {r['batch']} | {r['side']} | {r['provider']} | {r['input']} | {r['ms']:.4f} | "
            f"{ratio} | {megabytes(r['peak_mb'])} |"
        )
    paths = sorted({(r["dtype"], r["path"]) for r in rows if r["path"]})
    lines += ["", "LumenBridge path: " + "; ".join(f"{d}: {p}" for d, p in paths)]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        r
        for r in result["rows"]
        if r["dtype"] == "bf16" and r["input"] == "float" and not r["provider"].endswith(" train")
    ]
    cases = sorted({(r["batch"], r["side"]) for r in rows}, key=lambda c: (c[1], c[0]))
    names = [p for p in dict.fromkeys(r["provider"] for r in rows)]
    fig, ax = plt.subplots(figsize=(10, 5))
    for name in names:
        points = [
            (i, r["ms"])
            for i, case in enumerate(cases)
            for r in rows
            if r["provider"] == name and (r["batch"], r["side"]) == case
        ]
        # Floors as dashed lines with a bar at each case, so a run of one case shows them too.
        style = {"linestyle": "--", "marker": "_", "markersize": 24} if name.startswith("floor") else {"marker": "o"}
        ax.plot([p[0] for p in points], [p[1] for p in points], label=name, **style)
    ax.set_xticks(range(len(cases)), [f"B={b}, {s}²" for b, s in cases])
    ax.set_yscale("log")
    ax.set_ylabel("forward ms (bf16, float input)")
    ax.set_title("Tokenizer forward against its floors, " + result["environment"]["gpu"])
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument("--quick", action="store_true", help="three cases: bf16 B=1 and B=256, fp32 B=256 (224²)")
    chosen.add_argument("--cases", nargs="+", type=parse_case, help="cases as DTYPE:BATCH:SIDE, e.g. bf16:64:448")
    parser.add_argument(
        "--providers", nargs="+", choices=PROVIDERS, metavar="NAME", help=f"forward providers to keep: {PROVIDERS}"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available() or not native.ready():
        raise SystemExit("needs a CUDA GPU and the built LumenBridge extension")
    if args.quick:
        cases = [("bf16", 1, 224), ("bf16", 256, 224), ("fp32", 256, 224)]
    else:
        cases = args.cases or [(d, b, s) for d in DTYPES for b, s in SIZES]
    run(cases, args.providers, args.out)
    print((args.out / "fused.md").read_text())


if __name__ == "__main__":
    main()
