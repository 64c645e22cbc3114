"""Runs every CUDA kernel variant once on small inputs, for compute-sanitizer.

Covers K in {3, 5, 7}, stride 1 and 2, float32/float16/bfloat16, NCHW and
NHWC, and the tile paths the sizes select:
  21 x 38  scalar NCHW loads (W % 4 != 0), 32 x 32 tiles, ragged edges
  70 x 64  4-wide NCHW loads, tall 32 x 64 tiles at stride 1
  20 x 24  the 16 x 16 tile (two rows per warp) at stride 2
C = 32 takes the vector channel path in NHWC, C = 13 the scalar one.
Usage: compute-sanitizer --tool memcheck python scripts/sanitize_kernels.py
"""

import itertools

import torch

from lumenbridge import native

assert native.ready(), "the LumenBridge extension did not build"
ops = torch.ops.lumenbridge
for (h, w), k, stride, dtype, fmt, channels in itertools.product(
    ((21, 38), (70, 64), (20, 24)), (3, 5, 7), (1, 2), (torch.float32, torch.float16, torch.bfloat16),
    (torch.contiguous_format, torch.channels_last), (32, 13),
):
    x = torch.randn(2, channels, h, w, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
    weight = torch.randn(channels, 1, k, k, device="cuda", dtype=dtype)
    bias = torch.randn(channels, device="cuda", dtype=dtype)
    y = ops.depthwise_conv2d(x, weight, bias, stride)
    grad = torch.randn_like(y).contiguous(memory_format=fmt)
    ops.depthwise_conv2d_backward_input(grad, weight, stride, [h, w])
    ops.depthwise_conv2d_backward_weight(grad, x, k, stride)
torch.cuda.synchronize()
print("sanitize_kernels: all variants ran")
