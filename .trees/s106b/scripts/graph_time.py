"""GPU time of one lumenbridge-base forward at small batches, without the
host's part: --forwards forwards captured in one CUDA graph, the graph
replayed --replays times, each replay timed with CUDA events; prints the
median and the least time a forward, per batch.

bench_fused.py times one call from an idle GPU, as a user's eager call runs,
so its small-batch rows include the host's time before the first launch and
vary between runs on one machine by more than a change of a few us
(benchmarks/NOTES.md, twenty-sixth and twenty-seventh sessions). Here the
kernels run back to back, so what a change to the kernels or to their
launches moves is what shows. A development tool: the same-run comparison
with PyTorch is bench_fused.py's.

Usage: python scripts/graph_time.py [--batches 1 8] [--forwards 20] [--replays 15]
                                    [--dtype bf16|fp16] [--input uint8|float]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch

from lumenbridge import VisualTokenizer, native

# The profiler's sample images, so both tools time the same inputs.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_tokenize import images as sample_images

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def per_forward_us(replay_ms: list[float], forwards: int) -> tuple[float, float]:
    """The median and the least time a forward, in us, from the times (ms)
    of replays of `forwards` forwards each."""
    times = [ms * 1000 / forwards for ms in replay_ms]
    return statistics.median(times), min(times)


def captured_forwards(model: VisualTokenizer, images: torch.Tensor, forwards: int) -> torch.cuda.CUDAGraph:
    """One CUDA graph of `forwards` forwards, replayed once."""
    with torch.inference_mode():
        for _ in range(3):  # the first calls' one-time work stays out of the graph
            model(images)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(forwards):
                model(images)
    graph.replay()
    return graph


def replay_ms(model: VisualTokenizer, images: torch.Tensor, forwards: int, replays: int) -> list[float]:
    """Times of `replays` replays of one graph of `forwards` forwards."""
    graph = captured_forwards(model, images, forwards)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--forwards", type=int, default=20, help="forwards in the graph")
    parser.add_argument("--replays", type=int, default=15)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--input", choices=("uint8", "float"), default="uint8")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("graph_time.py needs a CUDA GPU")
    if not native.ready():
        raise SystemExit("graph_time.py needs the built LumenBridge extension (python -m lumenbridge build)")
    dtype = DTYPES[args.dtype]
    model = VisualTokenizer(backend="native").to("cuda", dtype).eval()
    print(
        f"{torch.cuda.get_device_name()}; torch {torch.__version__}; {datetime.date.today()}; "
        f"lumenbridge-base, {args.dtype}, {args.input} channels-last input, 224 x 224; "
        f"{args.forwards} forwards a graph, {args.replays} replays"
    )
    for batch in args.batches:
        images = sample_images(args.input, batch, dtype)
        median, least = per_forward_us(replay_ms(model, images, args.forwards, args.replays), args.forwards)
        print(f"B={batch}: {median:.1f} us a forward (least {least:.1f})")


if __name__ == "__main__":
    main()
