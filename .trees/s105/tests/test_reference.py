"""The reference backend against an independent hand computation in plain
Python loops (no torch convolution), on tiny float64 inputs."""

from __future__ import annotations

import math

import pytest
import torch

from lumenbridge import TokenizerConfig, VisualTokenizer, reference


def hand_depthwise(x, w, b, stride):
    """x: [C][H][W] nested lists, w: [C][K][K], b: [C]; zero padding K // 2."""
    k = len(w[0])
    pad = k // 2
    out = []
    for c, plane in enumerate(x):
        h, wd = len(plane), len(plane[0])
        ho, wo = (h + 2 * pad - k) // stride + 1, (wd + 2 * pad - k) // stride + 1
        rows = []
        for oy in range(ho):
            row = []
            for ox in range(wo):
                acc = b[c]
                for i in range(k):
                    for j in range(k):
                        y, xx = oy * stride + i - pad, ox * stride + j - pad
                        if 0 <= y < h and 0 <= xx < wd:
                            acc += w[c][i][j] * plane[y][xx]
                row.append(acc)
            rows.append(row)
        out.append(rows)
    return out


def hand_pointwise(x, w, b):
    """x: [Cin][H][W], w: [Cout][Cin], b: [Cout]."""
    h, wd = len(x[0]), len(x[0][0])
    return [
        [[b[o] + sum(w[o][i] * x[i][y][xx] for i in range(len(x))) for xx in range(wd)] for y in range(h)]
        for o in range(len(w))
    ]


def gelu(v):
    return 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0)))


def layer_norm(vec, gamma, beta, eps=1e-5):
    mean = sum(vec) / len(vec)
    var = sum((v - mean) ** 2 for v in vec) / len(vec)
    return [(v - mean) / math.sqrt(var + eps) * g + bt for v, g, bt in zip(vec, gamma, beta)]


@pytest.mark.parametrize("kernel_size, stride, size", [(3, 2, (7, 6)), (3, 1, (5, 4)), (5, 2, (6, 9)), (7, 1, (4, 5))])
def test_depthwise_matches_hand_computation(kernel_size, stride, size):
    x = torch.randn(1, 3, *size, dtype=torch.float64)
    w = torch.randn(3, 1, kernel_size, kernel_size, dtype=torch.float64)
    b = torch.randn(3, dtype=torch.float64)
    expected = hand_depthwise(x[0].tolist(), w[:, 0].tolist(), b.tolist(), stride)
    got = reference.depthwise_conv2d(x, w, b, stride)[0]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_pointwise_matches_hand_computation():
    x = torch.randn(1, 3, 4, 5, dtype=torch.float64)
    w = torch.randn(6, 3, 1, 1, dtype=torch.float64)
    b = torch.randn(6, dtype=torch.float64)
    expected = hand_pointwise(x[0].tolist(), w[:, :, 0, 0].tolist(), b.tolist())
    torch.testing.assert_close(reference.pointwise_conv2d(x, w, b)[0], torch.tensor(expected, dtype=torch.float64))


def test_tiny_model_matches_hand_computation():
    cfg = TokenizerConfig(
        in_chans=2, embed_dim=4, stage_widths=(3, 4), strides=(2, 2), mean=(0.5, 0.4), std=(0.2, 0.3), image_size=8
    )
    model = VisualTokenizer(cfg, backend="reference", seed=3).double()
    with torch.no_grad():  # non-trivial norm parameters, so the affine part is exercised
        model.token_norm.weight.uniform_(0.5, 1.5)
        model.token_norm.bias.uniform_(-0.5, 0.5)
    images = torch.randint(0, 256, (1, 2, 8, 8), dtype=torch.uint8)

    x = [
        [[(v / 255.0 - cfg.mean[c]) / cfg.std[c] for v in row] for row in plane]
        for c, plane in enumerate(images[0].double().tolist())
    ]
    for index, stage in enumerate(model.stages):
        x = hand_depthwise(x, stage.dw.weight[:, 0].tolist(), stage.dw.bias.tolist(), cfg.strides[index])
        x = hand_pointwise(x, stage.pw.weight[:, :, 0, 0].tolist(), stage.pw.bias.tolist())
        if index == 0:
            x = [[[gelu(v) for v in row] for row in plane] for plane in x]
    h, w = len(x[0]), len(x[0][0])
    gamma, beta = model.token_norm.weight.tolist(), model.token_norm.bias.tolist()
    tokens = [layer_norm([x[c][y][xx] for c in range(4)], gamma, beta) for y in range(h) for xx in range(w)]

    with torch.no_grad():
        got = model(images)[0]
    torch.testing.assert_close(got, torch.tensor(tokens, dtype=torch.float64), rtol=1e-10, atol=1e-10)


def test_backward_references_match_autograd():
    x = torch.randn(2, 3, 9, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 1, 5, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    out = reference.depthwise_conv2d(x, w, b, 2)
    grad = torch.randn_like(out)
    gx, gw, gb = torch.autograd.grad(out, (x, w, b), grad)
    torch.testing.assert_close(reference.depthwise_conv2d_backward_input(grad, w, 2, [9, 8]), gx)
    ref_gw, ref_gb = reference.depthwise_conv2d_backward_weight(grad, x, 5, 2)
    torch.testing.assert_close(ref_gw, gw)
    torch.testing.assert_close(ref_gb, gb)
