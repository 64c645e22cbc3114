"""scripts/gradient_ratios.py: a line per case, dtype and path, naming every
gradient with its ratio to PyTorch's error and marking failures."""

from __future__ import annotations

import re

from conftest import load_script

from lumenbridge.testing import ErrorReport

gradient_ratios = load_script("gradient_ratios")


def test_a_failing_gradient_is_marked():
    reports = {
        "stages.0.dw.bias": ErrorReport(error=4.0, torch_error=1.0, floor=0.5, factor=3.0),
        "images": ErrorReport(error=1.0, torch_error=1.0, floor=0.1),
    }
    assert gradient_ratios.ratio_line(reports) == "stages.0.dw.bias=4.00! images=1.00"


def test_a_run_names_every_parameter(native_ops, capsys):
    gradient_ratios.main(["batch-1", "--dtypes", "bf16", "--paths", "op", "layers"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["batch-1 bf16 op", "batch-1 bf16 layers"]
    for line in lines:
        names = [m.group(1) for m in re.finditer(r"(\S+)=\d+\.\d\d!?", line)]
        assert len(names) == 18 and names[0] == "stages.0.dw.weight" and names[-1] == "token_norm.bias"
