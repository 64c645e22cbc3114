"""Static SASS instruction counts of LumenBridge's CUDA kernels, on any machine
with nvcc (no GPU needed): compiles a kernel file with the extension's flags
for sm_90a (the H200 machine's builds are 9.0a; torch's default for an H200,
sm_90, has the same instructions but for wgmma and kin), disassembles it with
nvdisasm and prints, per kernel, its instruction count and most frequent
opcodes; --dump DIR writes each kernel's SASS there. A CPU-only build of torch
will do (the CUDA toolkit is then the one nvcc belongs to).

Counting before a GPU call is how the fold's address arithmetic was found
(benchmarks/NOTES.md, seventeenth session). nvdisasm ships with the CUDA
toolkit and, alone, in the `nvidia-cuda-nvdisasm` package.

  python scripts/sass_counts.py src/lumenbridge/csrc/cuda/depthwise_backward_both.cu \
      --kernels 'both.*BFloat16, 3, true' [--top 12] [--dump DIR]
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import NamedTuple

from torch.utils import cpp_extension

from lumenbridge.extension import CSRC, KERNEL_SIZES_DEFINE

# The extension's nvcc flags for Hopper (torch's defaults plus ours; C++20,
# which recent torch headers need and the older ones accept). -lineinfo, as
# the build has it, lets nvdisasm -g name each instruction's source line
# (scripts/ncu_lines.py) and changes no instruction.
NVCC_FLAGS = [
    "-std=c++20",
    "-O3",
    "-lineinfo",
    "-gencode=arch=compute_90a,code=sm_90a",
    "--expt-relaxed-constexpr",
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "-DLUMENBRIDGE_WITH_CUDA",
    KERNEL_SIZES_DEFINE,
]
FUNCTION = re.compile(r"^(_Z\S+):$")
# An instruction's opcode, past its predicate (scripts/ncu_lines.py reads ncu's SASS with it too).
OPCODE = r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)"
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+" + OPCODE)
# nvdisasm -g: the source line of the instructions that follow.
SOURCE_LINE = re.compile(r'^\s*//## File "([^"]*)", line (\d+)')


class Instruction(NamedTuple):
    opcode: str
    text: str
    source: str  # "file.cu:line" where the listing names it (nvdisasm -g), else ""


def find_nvdisasm(given: str | None) -> str:
    """nvdisasm from --nvdisasm, the PATH, or the nvidia-cuda-nvdisasm package."""
    if given:
        return given
    found = shutil.which("nvdisasm")
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for folder in spec.submodule_search_locations if spec else []:
        for candidate in sorted(Path(folder).glob("*/bin/nvdisasm")):
            return str(candidate)
    sys.exit("sass_counts: no nvdisasm (install the CUDA toolkit's, or `pip install nvidia-cuda-nvdisasm`)")


def cuda_include_paths(scratch: Path) -> list[str]:
    """torch's include paths for CUDA sources. A CPU build of torch knows no
    CUDA home and lacks c10's CUDA build-macros header: there the toolkit is
    the one nvcc belongs to, and the header a stub in `scratch` (the
    extension builds c10's CUDA library as a shared one)."""
    try:
        return cpp_extension.include_paths(device_type="cuda")
    except OSError:
        macros = scratch / "stub" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
        macros.parent.mkdir(parents=True, exist_ok=True)
        macros.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        nvcc = shutil.which("nvcc")
        toolkit = [str(Path(nvcc).resolve().parent.parent / "include")] if nvcc else []
        return [*cpp_extension.include_paths(), *toolkit, str(scratch / "stub")]


def compile_cubin(source: Path, cubin: Path) -> None:
    paths = [*cuda_include_paths(cubin.parent), sysconfig.get_paths()["include"], CSRC]
    includes = [f"-I{path}" for path in paths]
    done = subprocess.run(
        ["nvcc", *NVCC_FLAGS, *includes, "-cubin", "-o", str(cubin), str(source)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:  # the build's warnings are left out of a count unless it fails
        sys.exit(f"sass_counts: nvcc failed on {source}:\n{done.stderr}")


def kernels_in(sass: str) -> dict[str, list[Instruction]]:
    """Each kernel's (mangled name's) instructions in order."""
    kernels: dict[str, list[Instruction]] = {}
    current = None
    source = ""
    for line in sass.splitlines():
        if match := FUNCTION.match(line):
            current = kernels.setdefault(match.group(1), [])
            source = ""
        elif match := SOURCE_LINE.match(line):
            source = f"{Path(match.group(1)).name}:{match.group(2)}"
        elif current is not None and (match := INSTRUCTION.match(line)):
            current.append(Instruction(match.group(1), line.strip(), source))
    return kernels


def disassemble(source: Path, nvdisasm: str, line_info: bool = False) -> dict[str, list[Instruction]]:
    """`source` compiled with the build's flags, its kernels' instructions
    (with line_info, each with its source line)."""
    with tempfile.TemporaryDirectory() as scratch:
        cubin = Path(scratch) / "kernels.cubin"
        compile_cubin(source, cubin)
        flags = ["-g"] if line_info else []
        listing = subprocess.run([nvdisasm, *flags, "-c", str(cubin)], capture_output=True, text=True, check=True)
    return kernels_in(listing.stdout)


def demangle(names: list[str]) -> list[str]:
    result = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
    return result.stdout.splitlines()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="a .cu file of the extension")
    parser.add_argument("--kernels", default="", help="regex on the demangled kernel names (default: all)")
    parser.add_argument("--top", type=int, default=10, help="opcodes listed per kernel")
    parser.add_argument("--dump", type=Path, help="write each listed kernel's SASS to DIR/<index>.sass")
    parser.add_argument("--nvdisasm", help="the nvdisasm to use")
    args = parser.parse_args()
    kernels = disassemble(args.source, find_nvdisasm(args.nvdisasm))
    pattern = re.compile(args.kernels)
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
    for index, (mangled, name) in enumerate(zip(kernels, demangle(list(kernels)), strict=True)):
        if not pattern.search(name):
            continue
        instructions = kernels[mangled]
        counts = collections.Counter(instruction.opcode for instruction in instructions)
        common = ", ".join(f"{opcode} {n}" for opcode, n in counts.most_common(args.top))
        print(f"{len(instructions):6d}  {name[:160]}\n        {common}")
        if args.dump:
            lines = [instruction.text for instruction in instructions]
            (args.dump / f"{index}.sass").write_text(f"// {name}\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
