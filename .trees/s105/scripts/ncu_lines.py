"""Where a kernel's executed instructions come from, by source line.

Reads the per-instruction CSV that scripts/ncu_sources.sh writes
(stalls-sass.csv) and compiles the kernel file here with the build's flags and
line info (scripts/sass_counts.py: no GPU needed). Each profiled kernel is
matched to the compiled kernel with the same opcodes in the same order, and
each instruction's executed count goes to the source line nvdisasm names for
it. Prints, per profiled launch (once, where the CSV repeats it), the lines
with the largest shares of its executed warp instructions, and their
opcodes. A profile of another tree, or of a build with other flags or
another nvcc, matches no compiled kernel, and the script says so.

Usage: python scripts/ncu_lines.py stalls-sass.csv src/lumenbridge/csrc/cuda/FILE.cu
           [--top N] [--nvdisasm PATH]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

import ncu_phases
import sass_counts

# The opcode of ncu's "Source" column (SASS without its address).
OPCODE = re.compile("^" + sass_counts.OPCODE)


def opcodes(launch: ncu_phases.Launch) -> list[str]:
    return [match.group(1) if (match := OPCODE.match(row["Source"].strip())) else "" for row in launch.rows]


def matching_kernel(
    launch: ncu_phases.Launch, kernels: dict[str, list[sass_counts.Instruction]]
) -> list[sass_counts.Instruction] | None:
    """The compiled kernel whose opcodes are the launch's, in order."""
    wanted = opcodes(launch)
    for instructions in kernels.values():
        if [i.opcode for i in instructions] == wanted:
            return instructions
    return None


def by_line(launch: ncu_phases.Launch, instructions: list[sass_counts.Instruction]) -> dict[str, Counter]:
    """Each source line's executed warp instructions, by opcode."""
    lines: dict[str, Counter] = defaultdict(Counter)
    for row, instruction in zip(launch.rows, instructions, strict=True):
        lines[instruction.source or "(no line)"][instruction.opcode] += ncu_phases.number(
            row.get(ncu_phases.INSTRUCTIONS, "")
        )
    return lines


def table(name: str, lines: dict[str, Counter], top: int) -> str:
    total = sum(sum(c.values()) for c in lines.values()) or 1.0
    rows = [
        f"## {name}",
        "",
        f"{total:,.0f} warp instructions executed",
        "",
        "| source line | share | opcodes (share of the line) |",
        "|---|---|---|",
    ]
    ranked = sorted(lines.items(), key=lambda item: -sum(item[1].values()))
    for source, counts in ranked[:top]:
        executed = sum(counts.values())
        mix = ", ".join(f"{op} {100 * n / executed:.0f}%" for op, n in counts.most_common(4) if executed)
        rows.append(f"| {source} | {100 * executed / total:.1f}% | {mix} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="ncu_sources.sh's stalls-sass.csv")
    parser.add_argument("source", type=Path, help="the .cu file the profiled kernels come from")
    parser.add_argument("--top", type=int, default=30, help="source lines listed per launch")
    parser.add_argument("--nvdisasm", help="the nvdisasm to use")
    args = parser.parse_args()
    launches = ncu_phases.read_launches(args.csv)
    kernels = sass_counts.disassemble(args.source, sass_counts.find_nvdisasm(args.nvdisasm), line_info=True)
    unmatched = []
    for index, launch in enumerate(launches):
        if index and launch == launches[index - 1]:
            continue  # ncu's CSV may hold a launch twice over
        instructions = matching_kernel(launch, kernels)
        if instructions is None:
            unmatched.append(launch.name)
            continue
        print(table(launch.name, by_line(launch, instructions), args.top))
    if unmatched:
        sys.exit(
            f"ncu_lines: no kernel of {args.source} compiled here has the opcodes of "
            + "; ".join(unmatched)
            + " (a profile of another tree, or of a build with other flags or another nvcc?)"
        )


if __name__ == "__main__":
    main()
