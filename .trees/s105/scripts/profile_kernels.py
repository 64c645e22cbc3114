"""Runs a few representative kernels once each (after a warm-up), for ncu.
Usage: ncu --clock-control none -k regex:depthwise python scripts/profile_kernels.py"""

import torch

from lumenbridge import native

assert native.ready()
ops = torch.ops.lumenbridge
CASES = [  # (C, side, stride, dtype, memory format)
    (96, 112, 1, torch.float32, torch.contiguous_format),
    (768, 56, 1, torch.float32, torch.contiguous_format),
    (384, 28, 2, torch.bfloat16, torch.contiguous_format),
    (192, 56, 2, torch.bfloat16, torch.channels_last),
]
for c, side, stride, dtype, fmt in CASES:
    x = torch.randn(256, c, side, side, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
    w = torch.randn(c, 1, 3, 3, device="cuda", dtype=dtype)
    y = ops.depthwise_conv2d(x, w, None, stride)
    g = torch.randn_like(y).contiguous(memory_format=fmt)
    ops.depthwise_conv2d_backward_input(g, w, stride, [side, side])
    ops.depthwise_conv2d_backward_weight(g, x, 3, stride)
torch.cuda.synchronize()
