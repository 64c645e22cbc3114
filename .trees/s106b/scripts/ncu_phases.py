"""Splits an ncu source profile into the phases between a kernel's barriers.

Reads the per-instruction CSV that scripts/ncu_sources.sh writes
(stalls-sass.csv: `ncu --page source --csv --print-source sass`) and cuts each
kernel's SASS at every barrier instruction (BAR.SYNC, BAR.ARV, EXIT), in
address order. For each phase it prints its share of the kernel's stall
samples and of its executed warp instructions, and its three largest stall
reasons. A warp-specialized kernel's roles occupy separate address ranges, so
the same table also splits the samples by role.

Usage: python scripts/ncu_phases.py stalls-sass.csv [--min-share PERCENT]
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter
from dataclasses import dataclass, field

SAMPLES = "Warp Stall Sampling (All Samples)"
INSTRUCTIONS = "Instructions Executed"
BOUNDARIES = ("BAR.", "EXIT")


@dataclass
class Phase:
    start: str
    end: str = "end of kernel"
    samples: float = 0.0
    instructions: float = 0.0
    stalls: Counter = field(default_factory=Counter)


@dataclass
class Kernel:
    name: str
    phases: list[Phase]


@dataclass
class Launch:
    """One profiled launch: its kernel's name and its instructions' rows."""

    name: str
    rows: list[dict[str, str]] = field(default_factory=list)


def number(text: str) -> float:
    return float(text.replace(",", "")) if text.strip() else 0.0


def read_launches(path: str) -> list[Launch]:
    """The CSV holds one block per profiled launch: a "Kernel Name" row (which
    ncu may leave out), a header row, then its instructions; each header
    starts a launch, and ncu's own messages before a header are skipped."""
    launches: list[Launch] = []
    header: list[str] | None = None
    name: str | None = None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                name = row[1] if len(row) > 1 else "?"
            elif "Address" in row and "Source" in row:
                header = row
                launches.append(Launch(name or "the profiled kernel"))
                name = None
            elif header is not None:
                launches[-1].rows.append(dict(zip(header, row, strict=False)))
    return launches


def read_kernels(path: str) -> list[Kernel]:
    """Each launch's phases."""
    kernels = []
    for launch in read_launches(path):
        kernel = Kernel(launch.name, [])
        for value in launch.rows:
            add_instruction(kernel, value)
        kernels.append(kernel)
    return kernels


def add_instruction(kernel: Kernel, value: dict[str, str]) -> None:
    if not kernel.phases:
        kernel.phases.append(Phase(start=value["Address"]))
    phase = kernel.phases[-1]
    phase.samples += number(value.get(SAMPLES, ""))
    phase.instructions += number(value.get(INSTRUCTIONS, ""))
    for column, text in value.items():
        if column.startswith("stall_") and "Not Issued" not in column:
            phase.stalls[column.removeprefix("stall_")] += number(text)
    source = value["Source"].strip()
    if any(marker in source for marker in BOUNDARIES):
        phase.end = f"{value['Address']} {source}"
        kernel.phases.append(Phase(start=value["Address"]))


def table(kernel: Kernel, min_share: float) -> str:
    samples = sum(p.samples for p in kernel.phases) or 1.0
    instructions = sum(p.instructions for p in kernel.phases) or 1.0
    lines = [
        f"## {kernel.name}",
        "",
        "| phase (start -> barrier that ends it) | samples | instructions | top stalls |",
        "|---|---|---|---|",
    ]
    for p in kernel.phases:
        share = 100 * p.samples / samples
        if share < min_share:
            continue
        top = ", ".join(f"{name} {100 * v / p.samples:.0f}%" for name, v in p.stalls.most_common(3) if p.samples)
        lines.append(f"| {p.start} -> {p.end} | {share:.1f}% | {100 * p.instructions / instructions:.1f}% | {top} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv")
    parser.add_argument("--min-share", type=float, default=0.5, help="hide phases below this share of samples")
    args = parser.parse_args()
    for kernel in read_kernels(args.csv):
        print(table(kernel, args.min_share))


if __name__ == "__main__":
    main()
