"""A timeline of one `lumenbridge tokenize` run, for finding where its threads wait.

Runs the command in this process under torch.profiler, recording every thread
(and, on CUDA, the GPU's kernels and copies), writes a Chrome trace (open it in
Perfetto or chrome://tracing) and prints each thread's time in the pipeline's
marks: the `lumenbridge.*` ranges of `pipeline.timed` and the waits between
threads (copy_wait, buffer_wait, hand_over). The decoding thread is the one
with gpu_jpeg, the model's the one with input_wait, the writers those with
write_rows. A development tool: the throughput figures are bench_pipeline.py's.

    python scripts/trace_pipeline.py --trace trace.json -- IMAGES --out DIR --decode gpu
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from lumenbridge import cli

MARK = "lumenbridge."


def every_thread_config():
    """The profiler's setting that records threads besides the one that starts
    it; None (with a note) on a torch without it."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        print("note: this torch's profiler records only the main thread", file=sys.stderr)
        return None


def marks_by_thread(events) -> dict[int, dict[str, float]]:
    """{thread: {mark: seconds}} of the pipeline's marks, each thread's in the order first seen."""
    threads: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for event in events:
        if event.name.startswith(MARK):
            threads[event.thread][event.name[len(MARK) :]] += event.time_range.elapsed_us() / 1e6
    return threads


def print_marks(threads: dict[int, dict[str, float]]) -> None:
    for thread, marks in threads.items():
        parts = ", ".join(f"{mark} {seconds:.2f}" for mark, seconds in sorted(marks.items(), key=lambda kv: -kv[1]))
        print(f"thread {thread}: {parts} (seconds)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", required=True, help="the Chrome trace to write (JSON; gzipped if it ends in .gz)")
    parser.add_argument("tokenize", nargs=argparse.REMAINDER, help="-- then tokenize's arguments")
    args = parser.parse_args(argv)
    arguments = args.tokenize[1:] if args.tokenize[:1] == ["--"] else args.tokenize
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, experimental_config=every_thread_config()) as profiler:
        code = cli.main(["tokenize", *arguments])
    profiler.export_chrome_trace(args.trace)
    print_marks(marks_by_thread(profiler.events()))
    print(f"trace: {args.trace}")
    return code


if __name__ == "__main__":
    sys.exit(main())
