"""scripts/graph_time.py: its per-forward arithmetic everywhere, its refusal
without a GPU, and a short run on one."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import load_script

graph_time = load_script("graph_time")


def test_a_replay_is_shared_by_its_forwards():
    median, least = graph_time.per_forward_us([0.9, 0.8, 1.2], forwards=20)
    assert median == pytest.approx(45.0)
    assert least == pytest.approx(40.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_without_a_gpu_it_says_so():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        graph_time.main(["--batches", "1"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_short_run_prints_a_time_per_batch(cuda_kernels, capsys):
    graph_time.main(["--batches", "1", "2", "--forwards", "2", "--replays", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert "2 forwards a graph, 3 replays" in lines[0]
    for batch, line in zip((1, 2), lines[1:], strict=True):
        found = re.fullmatch(rf"B={batch}: ([0-9.]+) us a forward \(least ([0-9.]+)\)", line)
        assert found, line
        median, least = map(float, found.groups())
        assert 0 < least <= median
