"""Runs every CUDA kernel variant once on small inputs, for compute-sanitizer.

Covers every K in config.KERNEL_SIZES, stride 1 and 2, float32/float16/bfloat16,
NCHW and NHWC, and the tile paths the sizes select:
  21 x 38  NCHW rows in 8-byte chunks (fp32) or single elements (half types);
           64-wide forward tiles at stride 1, 32-wide at stride 2
  70 x 64  16-byte NCHW chunks, several tile rows
  20 x 24  32-wide forward tiles at stride 1, 16-wide at stride 2
  9 x 13   odd W: single-element chunks, one narrow tile
C = 32 takes 16-byte channel chunks in NHWC, C = 6 8-byte (fp32) ones, C = 13
single elements. A last batch of 96 x 64 x 32 x 32 problems gives every
resident block of the pipelined kernels several tiles, so the hand-over
between a block's tile buffers runs under the tools too.
Then the fused tokenize kernels, on the shared sample cases
(lumenbridge.testing.tokenize_cases: every K, stride pattern, activation,
input kind, layout, output format and odd width) in bfloat16, the base
preset in float16, and the cases whose persistent blocks walk several tiles
(many_tile_cases), each through tokenize and through tokenize_for_training
(which also writes every stage's depthwise rows and the later stages'
outputs). Last, the tokenize backward (composed over the depthwise kernels,
in the tokenizer's channels-last shapes, 3-channel images included) on the
same cases in bfloat16, with what tokenize_for_training saved and
recomputing everything after tokenize.
Then (kernels-backward) the backward, from what tokenize_for_training saved,
of two-stage shapes whose every GEMM is one of LumenBridge's kernels (stage
2's in the wide pointwise backward kernel: 96 -> 192 channels), for
racecheck, which stops at the backward's first cuBLAS GEMM ("failed to
handle a hardware exception").
Then crop_resize (the --decode gpu resize) over images of many sizes.
--parts picks which of the five groups run
(default: all), so a tool's report can be traced to one of them.
Usage: compute-sanitizer --tool memcheck python scripts/sanitize_kernels.py
       [--parts depthwise fused backward kernels-backward crop]
"""

import argparse
import dataclasses
import itertools

import torch

from lumenbridge import native
from lumenbridge.config import KERNEL_SIZES
from lumenbridge.testing import NARROW, TokenizeCase, many_tile_cases, tokenize_cases

PARTS = ("depthwise", "fused", "backward", "kernels-backward", "crop")
parser = argparse.ArgumentParser()
parser.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS)
parts = parser.parse_args().parts
assert native.ready(), "the LumenBridge extension did not build"
ops = torch.ops.lumenbridge
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FORMATS = (torch.contiguous_format, torch.channels_last)
DEPTHWISE_CASES = itertools.product(
    ((21, 38), (70, 64), (20, 24), (9, 13)), KERNEL_SIZES, (1, 2), DTYPES, FORMATS, (32, 6, 13)
)
for (h, w), k, stride, dtype, fmt, channels in DEPTHWISE_CASES if "depthwise" in parts else ():
    x = torch.randn(2, channels, h, w, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
    weight = torch.randn(channels, 1, k, k, device="cuda", dtype=dtype)
    bias = torch.randn(channels, device="cuda", dtype=dtype)
    y = ops.depthwise_conv2d(x, weight, bias, stride)
    grad = torch.randn_like(y).contiguous(memory_format=fmt)
    ops.depthwise_conv2d_backward_input(grad, weight, stride, [h, w])
    ops.depthwise_conv2d_backward_weight(grad, x, k, stride)
for stride, dtype, fmt in itertools.product((1, 2), DTYPES, FORMATS) if "depthwise" in parts else ():
    x = torch.randn(96, 64, 32, 32, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
    weight = torch.randn(64, 1, 3, 3, device="cuda", dtype=dtype)
    grad = torch.randn_like(ops.depthwise_conv2d(x, weight, None, stride))
    ops.depthwise_conv2d_backward_input(grad, weight, stride, [32, 32])
    ops.depthwise_conv2d_backward_weight(grad, x, 3, stride)
# Every case in bfloat16; float16 differs only in its conversions and mma
# variant, so the base preset covers it. Then the cases whose blocks walk
# several tiles (the persistent loops and the taps reloaded per tile).
FUSED_CASES = (
    [(case, torch.bfloat16) for case in tokenize_cases()]
    + [(tokenize_cases()[1], torch.float16)]
    + [(case, torch.bfloat16) for case in many_tile_cases()]
)
for case, dtype in FUSED_CASES if "fused" in parts else ():
    if case.config.stage_norm != "none":
        continue  # composed from the kernels above, not fused
    model = case.model().to("cuda", dtype)
    images = case.images().to("cuda")
    args = native.tokenize_arguments(images if images.dtype == torch.uint8 else images.to(dtype), model)
    with torch.inference_mode():
        ops.tokenize(*args)
        ops.tokenize_for_training(*args)


def backward_from_saved(case, dtype):
    """The backward of tokenize_for_training on the case in dtype (float
    images in dtype too, with a gradient); returns the model and images."""
    model = case.model().to("cuda", dtype)
    images = case.images().to("cuda")
    images = images if images.dtype == torch.uint8 else images.to(dtype).requires_grad_(True)
    # Arguments built per call: an eval-mode BatchNorm's are computed from its
    # parameters, a graph that one backward frees.
    ops.tokenize_for_training(*native.tokenize_arguments(images, model))[0].float().sum().backward()
    return model, images


for case in tokenize_cases() if "backward" in parts else ():
    model, images = backward_from_saved(case, torch.bfloat16)
    ops.tokenize(*native.tokenize_arguments(images, model)).float().sum().backward()
# Stage 2 of 96 -> 192 channels over 4.4 GEMM tiles of 64 rows (the last
# ragged), in both half types, uint8 NCHW and float channels-last images.
WIDE = dataclasses.replace(NARROW, embed_dim=192, stage_widths=(96, 192), strides=(2, 2))
KERNELS_BACKWARD_CASES = itertools.product(
    (
        TokenizeCase("wide", WIDE, batch=2, size=(40, 56)),
        TokenizeCase("wide-float", WIDE, batch=2, size=(40, 56), uint8=False, channels_last=True),
    ),
    (torch.bfloat16, torch.float16),
)
for case, dtype in KERNELS_BACKWARD_CASES if "kernels-backward" in parts else ():
    backward_from_saved(case, dtype)
if "crop" in parts:
    # crop_resize over images of many sizes (views among them), downscales with
    # boxes at the edges and upscales: every read lies inside its image.
    from lumenbridge.gpu_decode import crop_resize

    generator = torch.Generator().manual_seed(0)
    sizes = [(300, 200), (64, 90), (37, 37), (20, 30), (1000, 700), (33, 700)]
    pictures = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=generator).cuda() for w, h in sizes]
    pictures.append(pictures[0].transpose(1, 2))
    for resize in (37, 32, 90):
        crop_resize(pictures, 32, resize)
torch.cuda.synchronize()
print("sanitize_kernels: ran", ", ".join(parts))
