"""scripts/ncu_phases.py cuts each kernel's SASS at its barriers and sums the
stall samples and instructions of each phase."""

from __future__ import annotations

import csv
from pathlib import Path

from conftest import load_script

ncu_phases = load_script("ncu_phases")

HEADER = [
    "Address",
    "Source",
    "Warp Stall Sampling (All Samples)",
    "Instructions Executed",
    "stall_wait",
    "stall_barrier",
    "stall_barrier (Not Issued)",
]


def write_profile(path: Path) -> None:
    rows = [
        ["Kernel Name", "first_kernel"],
        HEADER,
        ["0x10", "IMAD R1, R2, R3", "30", "1,000", "30", "0", "7"],
        ["0x20", "BAR.SYNC.DEFER_BLOCKING 0x1, 0x100", "10", "100", "0", "10", "5"],
        ["0x30", "FFMA R1, R2, R3", "", "900", "", "", ""],
        ["0x40", "EXIT", "60", "0", "20", "40", "1"],
        ["Kernel Name", "second_kernel"],
        HEADER,
        ["0x50", "HMMA R1, R2, R3", "5", "50", "5", "0", "0"],
    ]
    with path.open("w", newline="") as f:
        csv.writer(f).writerows(rows)


def test_phases_end_at_each_barrier_with_their_own_sums(tmp_path):
    write_profile(tmp_path / "stalls-sass.csv")
    first, second = ncu_phases.read_kernels(str(tmp_path / "stalls-sass.csv"))
    assert [first.name, second.name] == ["first_kernel", "second_kernel"]
    ends = [p.end for p in first.phases]
    assert ends == ["0x20 BAR.SYNC.DEFER_BLOCKING 0x1, 0x100", "0x40 EXIT", "end of kernel"]
    assert [(p.samples, p.instructions) for p in first.phases] == [(40, 1100), (60, 900), (0, 0)]
    assert first.phases[0].stalls == {"wait": 30, "barrier": 10}  # the "Not Issued" columns are left out
    assert [(p.samples, p.instructions) for p in second.phases] == [(5, 50)]


def test_table_gives_shares_and_top_stalls(tmp_path):
    write_profile(tmp_path / "stalls-sass.csv")
    first = ncu_phases.read_kernels(str(tmp_path / "stalls-sass.csv"))[0]
    text = ncu_phases.table(first, min_share=0.5)
    assert "| 0x10 -> 0x20 BAR.SYNC.DEFER_BLOCKING 0x1, 0x100 | 40.0% | 55.0% | wait 75%, barrier 25% |" in text
    assert "| 0x20 -> 0x40 EXIT | 60.0% | 45.0% | barrier 67%, wait 33% |" in text
    assert "end of kernel" not in text  # the empty phase after EXIT is below the threshold


def test_a_single_kernel_without_a_name_row_after_ncu_messages(tmp_path):
    rows = [
        ["==WARNING== Note: Running with unmodified GPU clocks."],
        HEADER,
        ["0x10", "IMAD R1, R2, R3", "30", "1,000", "30", "0", "7"],
        ["0x20", "EXIT", "10", "100", "0", "10", "5"],
    ]
    with (tmp_path / "stalls-sass.csv").open("w", newline="") as f:
        csv.writer(f).writerows(rows)
    (kernel,) = ncu_phases.read_kernels(str(tmp_path / "stalls-sass.csv"))
    assert kernel.name == "the profiled kernel"
    assert [(p.samples, p.instructions) for p in kernel.phases] == [(40, 1100), (0, 0)]


def test_each_header_without_a_name_row_starts_a_kernel(tmp_path):
    launch = [
        HEADER,
        ["0x10", "IMAD R1, R2, R3", "30", "1,000", "30", "0", "7"],
        ["0x20", "EXIT", "10", "100", "0", "10", "5"],
    ]
    with (tmp_path / "stalls-sass.csv").open("w", newline="") as f:
        csv.writer(f).writerows(launch + launch)
    kernels = ncu_phases.read_kernels(str(tmp_path / "stalls-sass.csv"))
    assert [k.phases[0].instructions for k in kernels] == [1100, 1100]
