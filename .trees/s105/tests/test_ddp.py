"""scripts/ddp_check.py: DistributedDataParallel over two gloo processes on
the CPU (and one NCCL process on a GPU) gives one process's gradients on the
concatenated batch, eager and under torch.compile."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed
from conftest import HAS_CUDA, load_script

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "ddp_check.py"


@pytest.mark.skipif(not torch.distributed.is_available(), reason="this torch has no torch.distributed")
def test_two_gloo_processes_give_one_process_gradients(native_ops):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [str(SCRIPT), "--backend", "gloo", "--compile"]
    run = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    for check in ("eager", "compiled"):
        assert f"DDP {check}, 2 x gloo on cpu, rank 0: largest gradient difference" in run.stdout
    assert run.stdout.count(": OK") == 2, run.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_one_nccl_process_per_gpu(cuda_kernels):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    command += [str(SCRIPT), "--backend", "nccl", "--compile"]
    run = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("1 x nccl on cuda") == 2 and run.stdout.count(": OK") == 2, run.stdout


@pytest.mark.parametrize("argv", [["--size", "40"], ["--size", "0"], ["--batch-per-process", "0"]])
def test_bad_arguments_are_one_usage_line(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_script("ddp_check").parse_args(argv)
    assert exit_info.value.code == 2 and "must be" in capsys.readouterr().err


def test_a_nan_or_a_zero_gradient_gets_a_verdict():
    worst_difference = load_script("ddp_check").worst_difference
    ones, zeros = torch.ones(3), torch.zeros(3)
    assert worst_difference({"a": ones, "b": torch.tensor([1.0, math.nan, 1.0])}, {"a": ones, "b": ones}) == (
        math.inf,
        "b",
    )
    assert worst_difference({"a": zeros}, {"a": zeros}) == (0.0, "a")
    assert worst_difference({"a": torch.full((3,), 1e-3)}, {"a": zeros}) == (pytest.approx(1e-3), "a")
