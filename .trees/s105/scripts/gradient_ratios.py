"""Where a gradient test fails, which gradients carry it: for shared sample
cases (lumenbridge.testing.tokenize_cases), each parameter's gradient error
against float64 as a multiple of PyTorch's own error in the same dtype, for
the op (native.tokenize: tokenize_for_training and its backward) and for the
per-layer native path, with "!" where the tests' rule fails.

Usage: python scripts/gradient_ratios.py [--device cuda] [--dtypes bf16 fp16]
                                         [--paths op layers] CASE [CASE...]
"""

from __future__ import annotations

import argparse

import torch

from lumenbridge import native
from lumenbridge.testing import compare_gradients_to_float64, tokenize_cases

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PATHS = {
    "op": lambda model, images: native.tokenize(images, model),
    "layers": lambda model, images: model.forward_layers(images, "native"),
}


def ratio_line(reports) -> str:
    """name=ratio for each gradient, '!' marking those that fail the rule."""
    return " ".join(
        f"{name}={report.error / report.torch_error:.2f}{'' if report.ok else '!'}" for name, report in reports.items()
    )


def main(argv: list[str] | None = None) -> None:
    cases = {case.name: case for case in tokenize_cases()}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", choices=sorted(cases), metavar="CASE")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["bf16", "fp16"])
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    args = parser.parse_args(argv)
    if not native.ready():
        raise SystemExit("gradient_ratios needs the native extension, which did not build")
    for name in args.cases:
        case = cases[name]
        for dtype in args.dtypes:
            for path in args.paths:
                reports = compare_gradients_to_float64(
                    case.model(), case.images(), PATHS[path], DTYPES[dtype], args.device
                )
                print(f"{name} {dtype} {path}: {ratio_line(reports)}", flush=True)


if __name__ == "__main__":
    main()
