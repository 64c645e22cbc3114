"""benchmarks/bench_fused.py's own arithmetic, on any machine: the floors
per dtype and input kind, and one CUDA graph per input kind."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import load_script

from lumenbridge import TokenizerConfig

bench_fused = load_script("bench_fused", folder="benchmarks")
BASE = TokenizerConfig.preset("lumenbridge-base")
# lumenbridge-base at 224²: pointwise FLOPs and stage outputs' values per image.
FLOPS = 2 * (112**2 * 3 * 96 + 56**2 * 96 * 192 + 28**2 * 192 * 384 + 14**2 * 384 * 768)
OUTPUTS = (112**2 * 96, 56**2 * 192, 28**2 * 384, 14**2 * 768)
PIXELS = 224 * 224 * 3


def floors(element: int, pixel: int) -> dict:
    return bench_fused.floors_ms(BASE, 256, 224, copy_gbs=4000.0, tflops=800.0, element=element, pixel=pixel)


def test_floors_count_each_dtype_and_input_kind():
    def ms(values_moved: int, pixel: int, element: int) -> float:
        return 256 * (pixel * PIXELS + element * values_moved) / 4000.0 / 1e6

    for element, pixel in ((2, 2), (2, 1), (4, 4), (4, 1)):
        got = floors(element, pixel)
        assert got["arithmetic"] == pytest.approx(256 * FLOPS / 800.0 / 1e9)
        assert got["stages separate"] == pytest.approx(ms(2 * sum(OUTPUTS[:3]) + OUTPUTS[3], pixel, element))
        assert got["1+2 fused"] == pytest.approx(ms(2 * sum(OUTPUTS[1:3]) + OUTPUTS[3], pixel, element))
        assert got["1+2, 3+4 fused"] == pytest.approx(ms(2 * OUTPUTS[1] + OUTPUTS[3], pixel, element))


def test_float_images_replay_a_graph_of_their_own(monkeypatch):
    class Graph:
        def replay(self):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph: contextlib.nullcontext())
    seen = []

    def model(x):
        seen.append(x.dtype)
        return x.float() * 2

    call = bench_fused.graphed(model)
    images = torch.randint(0, 256, (1, 3, 4, 4), dtype=torch.uint8)
    floats = torch.randn(1, 3, 4, 4)
    assert torch.equal(call(images), images.float() * 2)
    assert torch.equal(call(floats), floats * 2)
    assert seen == [torch.uint8, torch.uint8, torch.float32, torch.float32]
