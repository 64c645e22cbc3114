"""scripts/phase_clock.py: its tables from stamps everywhere, its refusal
without a GPU, and a run of the clocked build on one (in a process of its
own: the clocked library registers the same ops as the one loaded here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_script

from lumenbridge import extension

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "phase_clock.py"


def _load_phase_clock():
    """The script as a module, leaving this process's build variable as it was."""
    saved = os.environ.get(extension.PHASE_CLOCKS_VARIABLE)
    try:
        return load_script("phase_clock")
    finally:
        if saved is None:
            os.environ.pop(extension.PHASE_CLOCKS_VARIABLE, None)
        else:
            os.environ[extension.PHASE_CLOCKS_VARIABLE] = saved


phase_clock = _load_phase_clock()


def _stamp(stamps, kernel, block, marks, start_ns, ns_step, cycles_step):
    """Stamps of one block at `marks`, evenly spaced: ns_step ns and cycles_step cycles apart."""
    for i, mark in enumerate(marks):
        stamps[kernel, block, mark, 0] = start_ns + i * ns_step
        stamps[kernel, block, mark, 1] = 10_000_000 + i * cycles_step


def test_the_tables_follow_the_stamps():
    stamps = torch.zeros(6, 2048, len(phase_clock.MARKS), 2, dtype=torch.long)
    stage_only = ("tile setup", "own statistics", "statistics")
    first_marks = [i for i, name in enumerate(phase_clock.MARKS) if name not in stage_only]
    stage_marks = [
        phase_clock.MARKS.index(name)
        for name in ("start", "prologue", "earlier tiles", "tile setup", "depthwise", "gemm", "epilogue")
    ]
    # A split first kernel (10 marks), then a stage kernel 3 us after it ends; 1.7 GHz throughout.
    for block in range(3):
        _stamp(stamps, 3, block, first_marks, 1_000_000 + 100 * block, 500, 850)
    _stamp(stamps, 1, 0, stage_marks, 1_007_700, 1000, 1700)
    _stamp(stamps, 1, 1, stage_marks, 1_007_800, 2000, 3400)  # the slowest block, ending last
    text = "\n".join(phase_clock.report(stamps))
    assert "## first kernel, split: 3 blocks, 4.70 us from the first start to the last end (1.70 GHz)" in text
    assert "## stage kernel: 2 blocks, 12.10 us from the first start to the last end (1.70 GHz)" in text
    assert "| exchange | 0.50 | 0.50 | 0.50 |" in text
    assert "| gemm | 1.50 | 2.00 | 2.00 |" in text  # median of 1 and 2 us; block 1's
    assert "block 1 ended last" in text
    order = text.split("## Kernels in order")[1]
    assert re.search(r"\| first kernel, split \| - \| 4\.70 \|", order)
    assert re.search(r"\| stage kernel \| 3\.00 \| 12\.10 \|", order)


def test_the_labels_are_the_headers_enumerators():
    assert phase_clock.KERNELS == ("first kernel", "stage kernel", "wide stage kernel")
    assert phase_clock.MARKS[:2] == ("start", "prologue") and phase_clock.MARKS[-1] == "epilogue"
    assert {"earlier tiles", "tile setup", "stage1 depthwise", "gemm", "own statistics", "statistics"} <= set(
        phase_clock.MARKS
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_without_a_gpu_it_says_so():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        phase_clock.main(["--batch", "1"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_clocked_build_stamps_every_kernel_of_a_forward(cuda_kernels):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--batch", "1", "--forwards", "2"],
        check=False,
        capture_output=True,
        text=True,
        timeout=1800,  # the clocked build compiles the kernels once
    )
    assert run.returncode == 0, run.stderr[-2000:]
    headers = re.findall(r"^## (.+?): (\d+) blocks", run.stdout, re.MULTILINE)
    assert len(headers) == 3, run.stdout  # the first kernel and two stage kernels of lumenbridge-base
    assert all(int(blocks) > 0 for _, blocks in headers)
    assert "| gemm |" in run.stdout and "| epilogue |" in run.stdout
