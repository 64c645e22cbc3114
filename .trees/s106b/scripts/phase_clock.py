"""Where each fused kernel's time goes, block by block, at small batches.

A development build of the extension (LUMENBRIDGE_PHASE_CLOCKS=1, which this
script sets before it loads one, building it in its own cache if needed) has
thread 0 of every block of the fused kernels stamp the global timer and its
SM's cycle counter at each phase boundary (phase_clocks.cuh, whose
enumerators label the tables). One lumenbridge-base forward is replayed from
a CUDA graph after --forwards others, as scripts/graph_time.py replays them,
and its stamps are read back. For each kernel it prints when its blocks
started against its first, each phase's time on the median and on the
slowest block, and which block ended last with its phases: at small batches
a launch is one wave, so that block's phases are the kernel's time, which
ncu's stall samples (a share of every waiting warp) do not show. Then the
gaps between kernels.

A block's stamps are those of its last tile; where a block takes several
tiles (larger batches), the `earlier tiles` phase holds all before it.
Phase times come from the SM's cycle counter, converted at the clock rate
that the stamps give (cycles over nanoseconds on each block); block starts
and kernel gaps from the global timer. A development tool: the stamps add a
few instructions a phase, so use graph_time.py's builds for times to report.

Usage: python scripts/phase_clock.py [--batch 1] [--forwards 20] [--dtype bf16|fp16]
                                     [--input uint8|float]
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import sys
from pathlib import Path

# Imported before torch, the package loads no build; with the variable set,
# the first use loads (or builds) the clocked one.
from lumenbridge import extension

os.environ[extension.PHASE_CLOCKS_VARIABLE] = "1"

import torch

from lumenbridge import VisualTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_time import captured_forwards
from profile_tokenize import images as sample_images

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CLOCKS_HEADER = extension.CSRC / "cuda" / "phase_clocks.cuh"


def enumerators(enum: str) -> tuple[str, ...]:
    """The labels of `enum`'s enumerators in phase_clocks.cuh, in order, less
    the last (their count): kStage1Depthwise -> "stage1 depthwise"."""
    body = re.search(rf"enum {enum} \{{(.*?)\}};", CLOCKS_HEADER.read_text(), re.DOTALL).group(1)
    names = [name.strip() for name in re.sub(r"//[^\n]*", "", body).split(",") if name.strip()]
    return tuple(re.sub(r"(?<!^)(?=[A-Z])", " ", name[1:]).lower() for name in names[:-1])


KERNELS = enumerators("ClockKernel")
MARKS = enumerators("PhaseMark")


def kernel_name(index: int) -> str:
    kind, split = index % len(KERNELS), index >= len(KERNELS)
    return KERNELS[kind] + (", split" if split else "")


def stamps_of_one_forward(batch: int, forwards: int, dtype: torch.dtype, kind: str) -> torch.Tensor:
    """The stamps [kernels, blocks, marks, (ns, cycles)] of the last forward
    of a replayed graph of `forwards` forwards."""
    model = VisualTokenizer(backend="native").to("cuda", dtype).eval()
    graph = captured_forwards(model, sample_images(kind, batch, dtype), forwards)
    torch.ops.lumenbridge.phase_clocks()  # clears
    graph.replay()
    return torch.ops.lumenbridge.phase_clocks()


def us(cycles: float, ghz: float) -> str:
    return f"{cycles / ghz / 1000:.2f}"


def report(stamps: torch.Tensor) -> list[str]:
    """Markdown tables of the stamped kernels, in the order they started."""
    lines: list[str] = []
    spans = []
    for k in range(stamps.shape[0]):
        blocks = [b for b in range(stamps.shape[1]) if stamps[k, b, 0, 0] != 0]
        if not blocks:
            continue
        marks = [m for m in range(stamps.shape[2]) if any(stamps[k, b, m, 0] != 0 for b in blocks)]
        ns = {b: [int(stamps[k, b, m, 0]) for m in marks] for b in blocks}
        cycles = {b: [int(stamps[k, b, m, 1]) for m in marks] for b in blocks}
        ghz = statistics.median((cycles[b][-1] - cycles[b][0]) / max(ns[b][-1] - ns[b][0], 1) for b in blocks)
        first_start = min(ns[b][0] for b in blocks)
        last = max(blocks, key=lambda b: ns[b][-1])
        spans.append((first_start, ns[last][-1], kernel_name(k)))
        starts = [(ns[b][0] - first_start) / 1000 for b in blocks]
        lines += [
            (
                f"## {kernel_name(k)}: {len(blocks)} blocks, {(ns[last][-1] - first_start) / 1000:.2f} us "
                f"from the first start to the last end ({ghz:.2f} GHz)"
            ),
            "",
            (
                f"Blocks started {statistics.median(starts):.2f} us (median) and {max(starts):.2f} us (last) "
                f"after the first; block {last} ended last."
            ),
            "",
            "| phase (ends at) | median block us | slowest block us | block that ended last us |",
            "|---|---|---|---|",
        ]
        for i in range(1, len(marks)):
            times = [cycles[b][i] - cycles[b][i - 1] for b in blocks]
            lines.append(
                f"| {MARKS[marks[i]]} | {us(statistics.median(times), ghz)} | {us(max(times), ghz)} "
                f"| {us(cycles[last][i] - cycles[last][i - 1], ghz)} |"
            )
        lines.append("")
    spans.sort()
    lines += [
        "## Kernels in order",
        "",
        "| kernel | starts after the one before ended, us | runs, us |",
        "|---|---|---|",
    ]
    for i, (start, end, name) in enumerate(spans):
        gap = f"{(start - spans[i - 1][1]) / 1000:.2f}" if i else "-"
        lines.append(f"| {name} | {gap} | {(end - start) / 1000:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--forwards", type=int, default=20, help="forwards in the graph before the stamped one")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--input", choices=("uint8", "float"), default="uint8")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("phase_clock.py needs a CUDA GPU")
    build = extension.build(verbose=False)
    if not build.with_cuda or not hasattr(torch.ops.lumenbridge, "phase_clocks"):
        raise SystemExit("phase_clock.py needs the extension built with CUDA and its phase clocks")
    stamps = stamps_of_one_forward(args.batch, args.forwards, DTYPES[args.dtype], args.input)
    print(
        f"{torch.cuda.get_device_name()}; torch {torch.__version__}; {datetime.date.today()}; "
        f"lumenbridge-base, B={args.batch}, {args.dtype}, {args.input} channels-last input, 224 x 224\n"
    )
    print("\n".join(report(stamps)))


if __name__ == "__main__":
    main()
