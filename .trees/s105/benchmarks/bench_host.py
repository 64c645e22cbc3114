"""Host time of one VisualTokenizer forward before its op runs: the input
checks, the backend's choice, the check that the modules are still the
config's and the op's argument list. At small batches the GPU waits for
this part of every eager call, so it is measured alone, with
torch.ops.lumenbridge.tokenize replaced by a stub that returns at once; and
then the op's own host part without a kernel (`_check_tokenize`: its
arguments bound to the schema and the gateway's checks).

Runs on any machine with the built extension (the CPU build is enough):
lumenbridge-base, one uint8 channels-last image of 224², inference mode.

Usage: python benchmarks/bench_host.py [--repeats N]   (prints a Markdown table)
"""

from __future__ import annotations

import argparse
import datetime
import functools
import platform
import statistics
import time
import types

import torch

from lumenbridge import VisualTokenizer, native
from lumenbridge.dispatch import NativeBackend, select_backend
from lumenbridge.layout import is_channels_last


def median_us(fn, repeats: int, inner: int = 200) -> float:
    """Median over `repeats` rounds of the mean time of `inner` calls."""
    for _ in range(inner):
        fn()
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        rounds.append((time.perf_counter() - start) / inner * 1e6)
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    if not native.ready():
        raise SystemExit("needs the built LumenBridge extension (python -m lumenbridge build)")
    model = VisualTokenizer(backend="native").eval()
    images = torch.randint(0, 256, (1, 3, 224, 224), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    parts = {
        "whole forward, op stubbed": lambda: model(images),
        "input checks (_check_images)": lambda: model._check_images(images),
        "backend choice (select_backend)": lambda: select_backend(
            images.device, model.backend, channels_last=is_channels_last(images)
        ),
        "layer check (NativeBackend.layer_reason)": lambda: NativeBackend.layer_reason(images, model),
        "op arguments (native.tokenize_arguments)": lambda: native.tokenize_arguments(images, model),
        # The op's C++ entry without a kernel: the call's binding and the gateway's checks.
        "op binding and checks (_check_tokenize)": functools.partial(
            torch.ops.lumenbridge._check_tokenize.default, *native.tokenize_arguments(images, model)
        ),
    }
    real_ops = native.ops
    native.ops = types.SimpleNamespace(tokenize=lambda images, *rest: images)
    try:
        with torch.inference_mode():
            rows = [(name, median_us(fn, args.repeats)) for name, fn in parts.items()]
    finally:
        native.ops = real_ops
    print(
        f"{platform.machine()}, {torch.get_num_threads()} threads; torch {torch.__version__}; "
        f"Python {platform.python_version()}; {datetime.date.today()}. Median us per call.\n"
    )
    print("| part | us |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
