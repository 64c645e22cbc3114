"""scripts/ncu_lines.py gives each profiled instruction's executed count to
the source line of the compiled kernel whose opcodes match the launch's."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
from conftest import load_script

ncu_lines = load_script("ncu_lines")
sass_counts = sys.modules["sass_counts"]

LISTING = """\
_Z5otherv:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   EXIT ;
_Z6kernelv:
\t//## File "/src/lumenbridge/csrc/cuda/kernel.cu", line 7
        /*0000*/                   LDC R1, c[0x0][0x28] ;
\t//## File "/src/lumenbridge/csrc/cuda/activation.cuh", line 93
        /*0010*/                   FMUL R2, R3, R3 ;
        /*0020*/                   FMNMX R2, R2, 25, PT ;
\t//## File "/src/lumenbridge/csrc/cuda/kernel.cu", line 40
        /*0030*/              @!P0 FFMA R4, R2, R5, R4 ;
        /*0040*/                   EXIT ;
"""
HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"]
PROFILED = [
    ["0x100", "LDC R1, c[0x0][0x28]", "1", "10"],
    ["0x110", "FMUL R2, R3, R3", "5", "300"],
    ["0x120", "FMNMX R2, R2, 25, PT", "5", "300"],
    ["0x130", "@!P0 FFMA R4, R2, R5, R4", "9", "1,380"],
    ["0x140", "EXIT", "0", "10"],
]


def write_profile(path: Path, rows=PROFILED, times=1) -> None:
    with path.open("w", newline="") as f:
        csv.writer(f).writerows([["Kernel Name", "kernel()"], HEADER, *rows] * times)


def run_script(tmp_path: Path, monkeypatch) -> None:
    """ncu_lines.main on tmp_path's stalls-sass.csv, with LISTING as the compiled kernels."""
    monkeypatch.setattr(ncu_lines.sass_counts, "disassemble", lambda *args, **kwargs: sass_counts.kernels_in(LISTING))
    monkeypatch.setattr(
        sys, "argv", ["ncu_lines.py", str(tmp_path / "stalls-sass.csv"), "kernel.cu", "--nvdisasm", "nvdisasm"]
    )
    ncu_lines.main()


def test_the_launch_is_matched_by_its_opcodes_and_counted_by_line(tmp_path):
    write_profile(tmp_path / "stalls-sass.csv")
    (launch,) = ncu_lines.ncu_phases.read_launches(str(tmp_path / "stalls-sass.csv"))
    instructions = ncu_lines.matching_kernel(launch, sass_counts.kernels_in(LISTING))
    assert [i.opcode for i in instructions] == ["LDC", "FMUL", "FMNMX", "FFMA", "EXIT"]
    lines = ncu_lines.by_line(launch, instructions)
    assert lines == {
        "kernel.cu:7": {"LDC": 10},
        "activation.cuh:93": {"FMUL": 300, "FMNMX": 300},
        "kernel.cu:40": {"FFMA": 1380, "EXIT": 10},
    }
    text = ncu_lines.table(launch.name, lines, top=2)
    assert "2,000 warp instructions executed" in text
    assert "| kernel.cu:40 | 69.5% | FFMA 99%, EXIT 1% |" in text
    assert "| activation.cuh:93 | 30.0% | FMUL 50%, FMNMX 50% |" in text
    assert "kernel.cu:7 |" not in text  # past --top


def test_a_profile_of_other_code_matches_no_kernel(tmp_path, monkeypatch, capsys):
    other = [*PROFILED[:3], ["0x130", "FADD R4, R2, R4", "9", "1,380"], PROFILED[4]]
    write_profile(tmp_path / "stalls-sass.csv", other)
    with pytest.raises(SystemExit, match="no kernel of kernel.cu compiled here has the opcodes of kernel()"):
        run_script(tmp_path, monkeypatch)
    assert capsys.readouterr().out == ""


def test_a_launch_the_csv_repeats_is_listed_once(tmp_path, monkeypatch, capsys):
    write_profile(tmp_path / "stalls-sass.csv", times=2)
    run_script(tmp_path, monkeypatch)
    assert capsys.readouterr().out.count("## kernel()") == 1
