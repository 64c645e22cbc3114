"""Runs every CUDA kernel variant once on small inputs, for compute-sanitizer.

Covers K in {3, 5, 7}, stride 1 and 2, float32/float16/bfloat16, NCHW and
NHWC, vector and scalar paths (C = 32 and C = 13), forward and both
gradients. Shapes are ragged so every tile has a partial edge.
Usage: compute-sanitizer --tool memcheck python scripts/sanitize_kernels.py
"""

import itertools

import torch

from lumenbridge import native

assert native.ready(), "the LumenBridge extension did not build"
ops = torch.ops.lumenbridge
for k, stride, dtype, fmt, channels in itertools.product(
    (3, 5, 7), (1, 2), (torch.float32, torch.float16, torch.bfloat16),
    (torch.contiguous_format, torch.channels_last), (32, 13),
):
    x = torch.randn(2, channels, 21, 38, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
    w = torch.randn(channels, 1, k, k, device="cuda", dtype=dtype)
    b = torch.randn(channels, device="cuda", dtype=dtype)
    y = ops.depthwise_conv2d(x, w, b, stride)
    grad = torch.randn_like(y).contiguous(memory_format=fmt)
    ops.depthwise_conv2d_backward_input(grad, w, stride, [21, 38])
    ops.depthwise_conv2d_backward_weight(grad, x, k, stride)
torch.cuda.synchronize()
print("sanitize_kernels: all variants ran")
