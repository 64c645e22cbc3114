"""Per-kernel GPU times of lumenbridge-base (torch.profiler) at B=256 bf16
channels-last: of one forward, for uint8 and float input (where the fused op
spends its time), or with --train of one training step (forward and backward
to every parameter, float input, as bench_fused.py times it: where the
backward spends its time). --train first times the step on its own (the
"timing loop" of benchmarks/NOTES.md: best and median of 5 runs of 20 steps,
CUDA events, and the peak memory), then lists one step's kernels in launch
order, then times steps one at a time, synchronized, as bench_fused.py
does, with where the GPU waited for the host within one such step (the gaps
between its kernels, largest first). Both modes end with the host's side:
its timeline up to the op's return (profiled) and the plain host times of
the op's arguments, the op and the model's call. A development tool: the
same-run comparison with PyTorch is bench_fused.py's.
Usage: python scripts/profile_tokenize.py [--batch B] [--train] [--no-profiler]"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from lumenbridge import VisualTokenizer, native
from lumenbridge.dispatch import select_backend
from lumenbridge.layout import is_channels_last
from lumenbridge.shapes import stage_extents

# The benchmarks' own per-call timing, so synchronized steps here are timed as bench_fused.py times them.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_depthwise import median_ms


def images(kind: str, batch: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A CUDA batch of 224 x 224 channels-last images: uint8, or float in `dtype`."""
    shape = (batch, 3, 224, 224)
    x = (
        torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")
        if kind == "uint8"
        else torch.randn(shape, device="cuda", dtype=dtype)
    )
    return x.contiguous(memory_format=torch.channels_last)


def run(call, warmups: int, calls: int, profiled: bool):
    """call() warmups times, then calls times: under the profiler if
    profiled, else plainly, so that ncu (which skips the first launches its
    kernel filter matches and profiles the next few) sees the same calls."""
    for _ in range(warmups):
        call()
    torch.cuda.synchronize()
    if not profiled:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
        return None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    return prof


def step_kernels(step) -> list:
    """One step's CUDA kernel events (torch.profiler), in launch order."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )


def time_steps(step, batch: int, runs: int = 5, steps: int = 20) -> None:
    """The timing loop: `runs` runs of `steps` steps timed with CUDA events
    (best and median a step), the peak memory over them, and one step's
    kernels in launch order with their GPU times."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / steps)
    peak = torch.cuda.max_memory_allocated() / 2**20
    kernels = step_kernels(step)
    print(f"== one training step's kernels, in launch order (us), B={batch}")
    for e in kernels:
        print(f"{e.time_range.elapsed_us():8.1f}  {e.name[:110]}")
    gpu = sum(e.time_range.elapsed_us() for e in kernels) / 1000
    print(
        f"step: best {min(times):.3f} ms, median {statistics.median(times):.3f} ms "
        f"({runs} runs of {steps}); GPU time {gpu:.3f} ms; peak {peak:.0f} MB"
    )


def kernel_gaps(kernels: list[tuple[float, float, str]]) -> tuple[float, float, list[tuple[float, str]]]:
    """From kernels (start us, end us, name) sorted by start: their span and
    the GPU's idle time within it (ms), and each kernel's wait (us, negative
    where it overlapped one before it) with its name."""
    waits, busy_until = [], kernels[0][1]
    for start, end, name in kernels[1:]:
        waits.append((start - busy_until, name))
        busy_until = max(busy_until, end)
    span = (busy_until - kernels[0][0]) / 1000
    return span, sum(max(wait, 0.0) for wait, _ in waits) / 1000, waits


def synchronized_steps(step, steps: int = 20, gaps: int = 8) -> float:
    """Steps timed one at a time, each synchronized (bench_fused.py's timing,
    median_ms): the median (returned, ms), and within one such step the GPU's
    idle time between its first and last kernel, with the largest gaps and
    the kernel each one preceded."""
    median = median_ms(step, repeats=steps)
    kernels = step_kernels(step)
    span, idle, waits = kernel_gaps([(e.time_range.start, e.time_range.end, e.name) for e in kernels])
    print(
        f"synchronized step: median {median:.3f} ms ({steps} steps); one step's kernels span {span:.3f} ms "
        f"(about {median - span:.3f} ms before the first and after the last), of which the GPU idled "
        f"{idle:.3f} ms between kernels; largest gaps (us):"
    )
    for wait, name in sorted(waits, reverse=True)[:gaps]:
        print(f"{wait:8.1f}  before {name[:100]}")
    return median


def held_steps(step, synchronized: float, steps: int = 20, sleep_cycles: int = 10_000_000) -> None:
    """Steps timed as in synchronized_steps, but each queued behind a sleep
    kernel (about 5 ms) that keeps the GPU busy while the host queues the
    step: the events then time the GPU's work alone, and the difference from
    `synchronized`, a synchronized step's median (ms), is the host's share of
    it (the GPU idle before the first kernel and after the last)."""
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep_cycles)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    held = statistics.median(times)
    print(
        f"step behind a sleep: median {held:.3f} ms against {synchronized:.3f} synchronized: "
        f"host share {synchronized - held:.3f} ms"
    )


def host_timeline(step, rows: int = 60) -> None:
    """Within one step (a training step, or a forward) under the profiler,
    what the host ran from the step's start until the forward op returned:
    CPU ops and CUDA runtime calls in start order, with their offsets from
    the step's start and their durations (us), and where the first kernel
    started. The profiler's first step sets up its buffers, so the second of
    two profiled steps is the one read. With the GPU idle until the first
    kernel, the host's time before it is the host's share of a synchronized
    step (the profiler slows the host: host_times has the plain figures)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for index in range(2):
            with torch.profiler.record_function(f"lumenbridge-step-{index}"):
                step()
            torch.cuda.synchronize()
    events = prof.events()
    start = next(e.time_range.start for e in events if e.name == "lumenbridge-step-1")
    op = next(e for e in events if e.name.startswith("lumenbridge::tokenize") and e.time_range.start >= start)
    first = min(
        e.time_range.start
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.start >= start
    )
    shown = sorted(
        (
            e
            for e in events
            if e.device_type == torch.autograd.DeviceType.CPU
            and start <= e.time_range.start <= op.time_range.end
            and not e.name.startswith("lumenbridge-step")
        ),
        key=lambda e: e.time_range.start,
    )
    print(
        f"host timeline (profiled): first kernel at {first - start:.1f} us, {op.name} from "
        f"{op.time_range.start - start:.1f} to {op.time_range.end - start:.1f} us; CPU events (offset, duration, us):"
    )
    for e in shown[:rows]:
        print(f"{e.time_range.start - start:8.1f} {e.time_range.elapsed_us():8.1f}  {e.name[:100]}")


def host_us(call, repeats: int = 50) -> float:
    """Median host time of call() in us (perf_counter), the GPU idle at each
    start as in a synchronized step."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def forward_outputs(model, x: torch.Tensor) -> list[torch.Tensor]:
    """Tensors the size of the fused forward's outputs (every stage's but the
    first, NHWC), allocated as the op allocates them: what allocation costs."""
    cfg = model.config
    sides = stage_extents(x.shape[-1], cfg.kernel_size, cfg.strides)
    return [
        torch.empty((x.shape[0], side, side, width), device=x.device, dtype=model.stages[0].dw.weight.dtype)
        for side, width in zip(sides[1:], cfg.stage_widths[1:], strict=True)
    ]


def no_grad_call(op, args):
    with torch.no_grad():
        return op(*args)


def host_times(model, x: torch.Tensor, step=None) -> None:
    """The host's time (no profiler) for the parts of a call: the op's
    arguments, the op alone, the model's forward, and given a training step,
    the whole step (forward and backward)."""
    args = native.tokenize_arguments(x, model)
    op = torch.ops.lumenbridge.tokenize_for_training if step is not None else torch.ops.lumenbridge.tokenize
    stage = forward_outputs(model, x)[0]
    parts = {
        "the model's checks and backend choice": lambda: (
            model._check_images(x),
            select_backend(x.device, model.backend, channels_last=is_channels_last(x)),
        ),
        "the forward's outputs allocated alone": lambda: forward_outputs(model, x),
        # One allocation and one launch alone, against the op's first ones in
        # host_timeline (which cost several times its later ones there).
        "one stage output allocated alone": lambda: torch.empty(stage.shape, device=stage.device, dtype=stage.dtype),
        "one launch of a sleeping kernel": lambda: torch.cuda._sleep(1),
        "tokenize_arguments": lambda: native.tokenize_arguments(x, model),
        "the op alone": lambda: op(*args),
        "the op alone, no autograd": lambda: no_grad_call(op, args),
        "model(x)": lambda: model(x),
    }
    if step is not None:
        parts["the training step"] = step
    print("host time (us, median of 50, GPU idle at each start):")
    for name, call in parts.items():
        print(f"{host_us(call):9.1f}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--no-profiler", action="store_true", help="only run the calls (for ncu)")
    parser.add_argument("--train", action="store_true", help="a training step instead of a forward")
    args = parser.parse_args()
    assert native.ready()
    model = VisualTokenizer(seed=0).to("cuda", torch.bfloat16)
    if args.train:
        x = images("float", args.batch)
        cotangent = torch.randn_like(model(x))

        def step():
            model.zero_grad(set_to_none=True)
            model(x).backward(cotangent)

        prof = run(step, 3, 5, not args.no_profiler)
        if prof is not None:
            print(f"== training step, float input, B={args.batch}, 5 steps")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90))
            time_steps(step, args.batch)
            held_steps(step, synchronized_steps(step))
            host_timeline(step)
            host_times(model, x, step)
        return
    model.eval()
    for kind in ("uint8", "float"):
        x = images(kind, args.batch)
        with torch.inference_mode():
            prof = run(lambda x=x: model(x), 3, 10, not args.no_profiler)
        if prof is not None:
            print(f"== {kind} input, B={args.batch}, 10 calls")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=90))
            with torch.inference_mode():
                host_timeline(lambda x=x: model(x))
                host_times(model, x, None)


if __name__ == "__main__":
    main()
