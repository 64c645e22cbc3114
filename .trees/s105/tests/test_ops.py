"""The native ops (torch.ops.lumenbridge.*) on every device present, against
PyTorch's convolution computed in float64 on fresh random inputs.

Outputs are poisoned with NaN before each kernel runs (the gateway fills them
when poisoning is on), so an element a kernel fails to write fails the test."""

from __future__ import annotations

import itertools
import random
import re

import pytest
import torch
from conftest import HAS_CUDA, device_params

from lumenbridge import reference
from lumenbridge.config import KERNEL_SIZES
from lumenbridge.layout import memory_format_of

# (N, C, H, W, K, stride), each there for a reason.
SHAPES = [
    (2, 8, 37, 29, 3, 1),  # odd H and W, H != W, not a multiple of any tile
    (2, 8, 37, 29, 3, 2),
    (1, 13, 20, 34, 3, 2),  # B = 1; C not a multiple of 8 (scalar channel path)
    (3, 1, 23, 40, 3, 1),  # C = 1
    (2, 16, 70, 45, 5, 2),  # several tiles in both directions
    (2, 24, 33, 66, 5, 1),
    (2, 8, 19, 21, 7, 1),
    (2, 16, 41, 30, 7, 2),
    (2, 8, 1, 1, 3, 1),  # single-pixel input and output
    (2, 8, 2, 2, 7, 2),  # single-pixel output at stride 2, kernel wider than the image
    (2, 32, 16, 16, 3, 2),  # 8 x 8 output: the narrow-tile path
    (1, 40, 66, 131, 3, 1),  # wide rows: several 64-column tiles plus a ragged one
    (2, 12, 30, 36, 3, 2),  # W = 36, C = 12: half types load 8-byte chunks, fp32 16-byte ones
    (2, 10, 36, 28, 3, 1),  # C = 10: 8-byte fp32 channel chunks in NHWC
]
LAYOUTS = {"nchw": torch.contiguous_format, "nhwc": torch.channels_last}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def shape_id(shape):
    return "N{}C{}H{}W{}K{}s{}".format(*shape)


@pytest.fixture(autouse=True)
def poisoned_outputs(native_ops):
    native_ops._set_poison_outputs(True)
    yield
    native_ops._set_poison_outputs(False)


def fresh_seed():
    """New random inputs on every run; the seed is in any failure message to reproduce it."""
    return random.randrange(2**31)


def make_inputs(shape, dtype, layout, device, seed):
    n, c, h, w, k, _stride = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=g, dtype=torch.float64)
    weight = torch.randn(c, 1, k, k, generator=g, dtype=torch.float64) / k
    bias = torch.randn(c, generator=g, dtype=torch.float64)
    to = {"device": device, "dtype": dtype}
    return x.to(**to).contiguous(memory_format=LAYOUTS[layout]), weight.to(**to), bias.to(**to)


def max_error(got, exact):
    return (got.double().cpu() - exact.cpu()).abs().max().item()


def assert_matches(got, exact, lowp_baseline, what, spread=0.0):
    """fp32: within 1e-5 of the output's scale (float32 rounding over <= 50
    terms, with margin), or of `spread` where an output sums many terms of
    either sign (a weight gradient: its float32 partial sums grow like the
    root of the summed squares, while the sum itself may land near zero).
    Half types: at most 2x the error of PyTorch's own computation in that
    dtype on the same inputs."""
    assert torch.isfinite(got).all(), f"{what}: non-finite values (unwritten output?)"
    error = max_error(got, exact)
    if got.dtype in (torch.float32, torch.float64):
        scale = exact.abs().max().item()
        tolerance = 1e-5 * max(scale, spread, 1.0)
    else:
        tolerance = 2 * max_error(lowp_baseline, exact)
    where = (got.double().cpu() - exact.cpu()).abs().argmax().item()
    assert error <= tolerance, f"{what}: max error {error:.3g} > {tolerance:.3g} at flat index {where}"


def weight_gradient_spreads(grad, x, k, stride):
    """The root of the summed squared terms of each weight and bias gradient
    (their largest over the channels and taps): assert_matches's spread."""
    squares_w, squares_b = reference.depthwise_conv2d_backward_weight(
        grad.double().cpu() ** 2, x.double().cpu() ** 2, k, stride
    )
    return squares_w.max().sqrt().item(), squares_b.max().sqrt().item()


CASES = [
    pytest.param(shape, dtype, layout, id=f"{shape_id(shape)}-{str(dtype)[6:]}-{layout}")
    for shape, dtype, layout in itertools.product(SHAPES, DTYPES, LAYOUTS)
]


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("shape, dtype, layout", CASES)
def test_forward(native_ops, device, shape, dtype, layout):
    seed = fresh_seed()
    x, w, b = make_inputs(shape, dtype, layout, device, seed)
    stride = shape[-1]
    out = native_ops.depthwise_conv2d(x, w, b, stride)
    exact = reference.depthwise_conv2d(x.double().cpu(), w.double().cpu(), b.double().cpu(), stride)
    assert out.shape == exact.shape
    assert out.dtype == dtype and out.device == x.device
    assert out.is_contiguous(memory_format=memory_format_of(x))
    assert_matches(out, exact, reference.depthwise_conv2d(x, w, b, stride), f"forward, seed {seed}")


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("shape, dtype, layout", CASES)
def test_backward_input(native_ops, device, shape, dtype, layout):
    n, c, h, wd, _k, stride = shape
    seed = fresh_seed()
    x, w, _ = make_inputs(shape, dtype, layout, device, seed)
    grad = reference.depthwise_conv2d(x, w, None, stride)  # right shape and layout
    grad = torch.randn(grad.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    grad = grad.to(x).contiguous(memory_format=LAYOUTS[layout])
    got = native_ops.depthwise_conv2d_backward_input(grad, w, stride, [h, wd])
    exact = reference.depthwise_conv2d_backward_input(grad.double().cpu(), w.double().cpu(), stride, [h, wd])
    assert got.shape == (n, c, h, wd)
    assert got.is_contiguous(memory_format=memory_format_of(grad))
    baseline = reference.depthwise_conv2d_backward_input(grad, w, stride, [h, wd])
    assert_matches(got, exact, baseline, f"grad_input, seed {seed}")


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("shape, dtype, layout", CASES)
def test_backward_weight(native_ops, device, shape, dtype, layout):
    k, stride = shape[-2:]
    seed = fresh_seed()
    x, _, _ = make_inputs(shape, dtype, layout, device, seed)
    grad = reference.depthwise_conv2d(x, torch.ones(shape[1], 1, k, k).to(x), None, stride)
    grad = torch.randn(grad.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    grad = grad.to(x).contiguous(memory_format=LAYOUTS[layout])
    grad_w, grad_b = native_ops.depthwise_conv2d_backward_weight(grad, x, k, stride)
    exact_w, exact_b = reference.depthwise_conv2d_backward_weight(grad.double().cpu(), x.double().cpu(), k, stride)
    base_w, base_b = reference.depthwise_conv2d_backward_weight(grad, x, k, stride)
    spread_w, spread_b = weight_gradient_spreads(grad, x, k, stride)
    assert grad_w.shape == exact_w.shape and grad_b.shape == exact_b.shape
    assert_matches(grad_w, exact_w, base_w, f"grad_weight, seed {seed}", spread_w)
    assert_matches(grad_b, exact_b, base_b, f"grad_bias, seed {seed}", spread_b)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("layout", LAYOUTS)
def test_backward_weight_is_bitwise_deterministic(native_ops, device, layout):
    shape = (8, 24, 61, 47, 3, 2)
    x, _, _ = make_inputs(shape, torch.float32, layout, device, seed=3)
    grad = torch.randn(8, 24, 31, 24, device=device).contiguous(memory_format=LAYOUTS[layout])
    first = native_ops.depthwise_conv2d_backward_weight(grad, x, 3, 2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # on the CPU, the result must not depend on the thread count
        for _ in range(3):
            again = native_ops.depthwise_conv2d_backward_weight(grad, x, 3, 2)
            assert all(torch.equal(a, b) for a, b in zip(first, again))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("device", device_params())
def test_empty_batch(native_ops, device):
    x = torch.randn(0, 4, 9, 9, device=device)
    w = torch.randn(4, 1, 3, 3, device=device)
    assert native_ops.depthwise_conv2d(x, w, None, 2).shape == (0, 4, 5, 5)
    grad = torch.randn(0, 4, 5, 5, device=device)
    assert native_ops.depthwise_conv2d_backward_input(grad, w, 2, [9, 9]).shape == (0, 4, 9, 9)
    grad_w, grad_b = native_ops.depthwise_conv2d_backward_weight(grad, x, 3, 2)
    assert torch.equal(grad_w, torch.zeros_like(grad_w)) and torch.equal(grad_b, torch.zeros(4, device=device))


# --- torch.library integration -------------------------------------------------


def opcheck_samples(device):
    """Sample inputs shared by opcheck: both layouts, both strides, with and without bias."""
    for layout, stride, with_bias in itertools.product(LAYOUTS, (1, 2), (True, False)):
        x, w, b = make_inputs((2, 6, 11, 9, 3, stride), torch.float32, layout, device, seed=stride)
        yield x, w, (b if with_bias else None), stride


@pytest.mark.parametrize("device", device_params())
def test_opcheck(native_ops, device):
    for x, w, b, stride in opcheck_samples(device):
        x.requires_grad_(True)
        w.requires_grad_(True)
        torch.library.opcheck(native_ops.depthwise_conv2d, (x, w, b, stride))
        out = native_ops.depthwise_conv2d(x.detach(), w.detach(), b, stride)
        grad = torch.randn_like(out)
        torch.library.opcheck(native_ops.depthwise_conv2d_backward_input, (grad, w.detach(), stride, list(x.shape[2:])))
        torch.library.opcheck(native_ops.depthwise_conv2d_backward_weight, (grad, x.detach(), 3, stride))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("stride", [1, 2])
def test_first_and_second_order_gradients_float64_cpu(native_ops, layout, stride):
    """Every op has an autograd formula, so gradients of any order are exact."""
    x, w, b = make_inputs((2, 3, 7, 6, 3, stride), torch.float64, layout, "cpu", seed=5)
    inputs = tuple(t.requires_grad_(True) for t in (x, w, b))
    forward = lambda x, w, b: native_ops.depthwise_conv2d(x, w, b, stride)
    assert torch.autograd.gradcheck(forward, inputs)
    assert torch.autograd.gradgradcheck(forward, inputs)
    grad = reference.depthwise_conv2d(x.detach(), w.detach(), None, stride)
    grad = torch.randn_like(grad).contiguous(memory_format=LAYOUTS[layout]).requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda g, w: native_ops.depthwise_conv2d_backward_input(g, w, stride, [7, 6]), (grad, w)
    )
    assert torch.autograd.gradcheck(
        lambda g, x: native_ops.depthwise_conv2d_backward_weight(g, x, 3, stride), (grad, x)
    )


def test_gradcheck_without_bias(native_ops):
    x, w, _ = make_inputs((1, 2, 6, 5, 5, 2), torch.float64, "nchw", "cpu", seed=9)
    inputs = (x.requires_grad_(True), w.requires_grad_(True))
    assert torch.autograd.gradcheck(lambda x, w: native_ops.depthwise_conv2d(x, w, None, 2), inputs)


@pytest.mark.parametrize("device", device_params())
def test_compile_fullgraph(native_ops, device):
    def stage(x, w, b, pw):
        hidden = native_ops.depthwise_conv2d(x, w, b, 2)
        return torch.nn.functional.gelu(torch.nn.functional.conv2d(hidden, pw))

    x, w, b = make_inputs((2, 8, 20, 18, 3, 2), torch.float32, "nhwc", device, seed=1)
    pw = torch.randn(16, 8, 1, 1, device=device)
    compiled = torch.compile(stage, fullgraph=True)
    torch.testing.assert_close(compiled(x, w, b, pw), stage(x, w, b, pw))


# --- the gateway's checks, each triggered from Python ----------------------------

# The build hands config.KERNEL_SIZES to the gateway, so its message lists exactly them.
KERNEL_SIZE_MESSAGE = re.escape(f"kernel_size must be one of [{', '.join(map(str, KERNEL_SIZES))}]")
TOO_LARGE_K = max(KERNEL_SIZES) + 2


def bad_calls(device):
    """(description, call, message) for every check in the gateway."""
    ops = torch.ops.lumenbridge
    x = torch.randn(2, 4, 8, 8, device=device)
    w = torch.randn(4, 1, 3, 3, device=device)
    b = torch.randn(4, device=device)
    g = torch.randn(2, 4, 4, 4, device=device)
    return [
        ("int input", lambda: ops.depthwise_conv2d(x.int(), w.int(), None, 1), "input has dtype Int"),
        (
            "weight dtype",
            lambda: ops.depthwise_conv2d(x, w.half(), None, 1),
            "weight has dtype Half but input has dtype Float",
        ),
        ("bias dtype", lambda: ops.depthwise_conv2d(x, w, b.half(), 1), "bias has dtype Half"),
        ("3-D input", lambda: ops.depthwise_conv2d(x[0], w, None, 1), "input must be 4-D"),
        ("weight rank", lambda: ops.depthwise_conv2d(x, w[:, 0], None, 1), r"weight must have shape \[C, 1, K, K\]"),
        (
            "grouped weight",
            lambda: ops.depthwise_conv2d(x, torch.randn(4, 2, 3, 3, device=device), None, 1),
            r"\[C, 1, K, K\]",
        ),
        (
            "channel mismatch",
            lambda: ops.depthwise_conv2d(x, w[:3], None, 1),
            "weight has 3 channels but the input has 4",
        ),
        (
            "even kernel",
            lambda: ops.depthwise_conv2d(x, torch.randn(4, 1, 4, 4, device=device), None, 1),
            KERNEL_SIZE_MESSAGE,
        ),
        (
            "kernel past the largest",
            lambda: ops.depthwise_conv2d(x, torch.randn(4, 1, TOO_LARGE_K, TOO_LARGE_K, device=device), None, 1),
            f"got {TOO_LARGE_K}",
        ),
        ("stride 3", lambda: ops.depthwise_conv2d(x, w, None, 3), "stride must be 1 or 2, got 3"),
        (
            "non-dense input",
            lambda: ops.depthwise_conv2d(x[..., ::2], w, None, 1),
            "input must be contiguous NCHW or channels-last",
        ),
        (
            "non-contiguous weight",
            lambda: ops.depthwise_conv2d(x, w.transpose(2, 3), None, 1),
            "weight must be contiguous",
        ),
        ("bias shape", lambda: ops.depthwise_conv2d(x, w, b[:3], 1), r"bias must have shape \[4\]"),
        (
            "non-contiguous bias",
            lambda: ops.depthwise_conv2d(x, w, torch.randn(8, device=device)[::2], 1),
            "bias must be contiguous",
        ),
        (
            "grad_output dtype",
            lambda: ops.depthwise_conv2d_backward_weight(g.half(), x, 3, 2),
            "grad_output has dtype Half",
        ),
        (
            "grad_output shape",
            lambda: ops.depthwise_conv2d_backward_input(g, w, 1, [8, 8]),
            r"grad_output has shape \[2, 4, 4, 4\] but expected \[2, 4, 8, 8\]",
        ),
        ("input_size", lambda: ops.depthwise_conv2d_backward_input(g, w, 2, [0, 8]), "input_size must be"),
        (
            "mixed layouts",
            lambda: ops.depthwise_conv2d_backward_weight(g, x.contiguous(memory_format=torch.channels_last), 3, 2),
            "share one memory layout",
        ),
        (
            "backward kernel size",
            lambda: ops.depthwise_conv2d_backward_weight(g, x, 4, 2),
            KERNEL_SIZE_MESSAGE,
        ),
        ("empty channels", lambda: ops.depthwise_conv2d(x[:, :0], w[:0], None, 1), "at least one channel"),
    ]


@pytest.mark.parametrize("device", [*device_params(), "meta"])  # meta: the fakes run the gateway's checks
@pytest.mark.parametrize("index", range(len(bad_calls("cpu"))), ids=[case[0] for case in bad_calls("cpu")])
def test_gateway_rejects_bad_arguments(native_ops, device, index):
    _, call, message = bad_calls(device)[index]
    with pytest.raises(RuntimeError, match="LumenBridge: .*" + message):
        call()


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gateway_rejects_mixed_devices_and_gpu_double(cuda_kernels):
    x = torch.randn(1, 4, 8, 8, device="cuda")
    with pytest.raises(RuntimeError, match="LumenBridge: weight is on cpu but input is on cuda"):
        cuda_kernels.depthwise_conv2d(x, torch.randn(4, 1, 3, 3), None, 1)
    with pytest.raises(RuntimeError, match="LumenBridge: input has dtype Double"):
        cuda_kernels.depthwise_conv2d(x.double(), torch.randn(4, 1, 3, 3, device="cuda", dtype=torch.float64), None, 1)


# --- CUDA-only properties ------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_graph_capture(cuda_kernels, layout):
    x, w, b = make_inputs((4, 32, 40, 40, 3, 2), torch.float32, layout, "cuda", seed=2)
    grad = torch.randn(4, 32, 20, 20, device="cuda").contiguous(memory_format=LAYOUTS[layout])

    def step():
        out = cuda_kernels.depthwise_conv2d(x, w, b, 2)
        gx = cuda_kernels.depthwise_conv2d_backward_input(grad, w, 2, [40, 40])
        gw, gb = cuda_kernels.depthwise_conv2d_backward_weight(grad, x, 3, 2)
        return out, gx, gw, gb

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager = step()  # warm-up on the side stream, as graph capture requires
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x.copy_(torch.randn_like(x))  # new data, same buffers: the replay must see it
    graph.replay()
    torch.cuda.synchronize()
    fresh = step()
    for got, want in zip(captured, fresh):
        assert torch.equal(got, want)
    assert not torch.equal(captured[0], eager[0])


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_many_tiles_per_block(cuda_kernels, layout, dtype, stride):
    """Thousands of tiles, many per resident block, in every pipelined kernel
    (forward, NHWC stride-2 input gradient, NHWC weight gradient): every
    hand-over between a block's tile buffers is exercised."""
    seed = fresh_seed()
    x, w, b = make_inputs((256, 64, 32, 32, 3, stride), dtype, layout, "cuda", seed)
    out = cuda_kernels.depthwise_conv2d(x, w, b, stride)
    exact = reference.depthwise_conv2d(x.double(), w.double(), b.double(), stride)
    assert_matches(out, exact, reference.depthwise_conv2d(x, w, b, stride), f"forward, seed {seed}")
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out)
    grad = grad.contiguous(memory_format=LAYOUTS[layout])
    got = cuda_kernels.depthwise_conv2d_backward_input(grad, w, stride, [32, 32])
    exact = reference.depthwise_conv2d_backward_input(grad.double(), w.double(), stride, [32, 32])
    baseline = reference.depthwise_conv2d_backward_input(grad, w, stride, [32, 32])
    assert_matches(got, exact, baseline, f"grad_input, seed {seed}")
    got_w, got_b = cuda_kernels.depthwise_conv2d_backward_weight(grad, x, 3, stride)
    exact_w, exact_b = reference.depthwise_conv2d_backward_weight(grad.double(), x.double(), 3, stride)
    base_w, base_b = reference.depthwise_conv2d_backward_weight(grad, x, 3, stride)
    spread_w, spread_b = weight_gradient_spreads(grad, x, 3, stride)
    assert_matches(got_w, exact_w, base_w, f"grad_weight, seed {seed}", spread_w)
    assert_matches(got_b, exact_b, base_b, f"grad_bias, seed {seed}", spread_b)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_extent_past_32_bits_is_refused(cuda_kernels):
    """A single extent of 2^31 is legal in PyTorch but not in the kernels'
    32-bit coordinates: every op refuses it with a message, before any launch."""
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs 24 GB of GPU memory")
    x = torch.empty(1, 1, 1, 2**31, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(1, 1, 3, 3, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"LumenBridge: the CUDA kernels take .* \[C, H, W\] = \[1, 1, 2147483648\]"):
        cuda_kernels.depthwise_conv2d(x, weight, None, 1)
    with pytest.raises(RuntimeError, match="LumenBridge: the CUDA kernels take"):
        cuda_kernels.depthwise_conv2d_backward_input(x, weight, 1, [1, 2**31])
    with pytest.raises(RuntimeError, match="LumenBridge: the CUDA kernels take"):
        cuda_kernels.depthwise_conv2d_backward_weight(x, x, 3, 1)
    del x
    torch.cuda.empty_cache()


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_nchw_gradients_refuse_channels_past_the_grid(cuda_kernels):
    """The NCHW gradient kernels give each channel a row of the grid, which
    the hardware caps at 65535 rows; the forward has no such limit."""
    x = torch.randn(1, 65536, 4, 4, device="cuda")
    weight = torch.randn(65536, 1, 3, 3, device="cuda")
    grad = torch.randn_like(cuda_kernels.depthwise_conv2d(x, weight, None, 2))
    with pytest.raises(RuntimeError, match="LumenBridge: the CUDA kernels cover at most 65535 channels, got 65536"):
        cuda_kernels.depthwise_conv2d_backward_weight(grad, x, 3, 2)
    with pytest.raises(RuntimeError, match="LumenBridge: the CUDA kernels cover at most 65535 channels, got 65536"):
        cuda_kernels.depthwise_conv2d_backward_input(grad, weight, 2, [4, 4])


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_more_than_2_to_the_31_elements(cuda_kernels, layout):
    """64-bit indexing: the last rows of a 2^31+ element tensor are right."""
    n, c, h, w = 1, 16, 11600, 11600  # 2.15e9 elements, 4.3 GB in bf16
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs 24 GB of GPU memory")
    x = torch.empty(n, c, h, w, device="cuda", dtype=torch.bfloat16, memory_format=LAYOUTS[layout]).normal_()
    weight = torch.randn(c, 1, 3, 3, device="cuda", dtype=torch.bfloat16)
    out = cuda_kernels.depthwise_conv2d(x, weight, None, 1)
    assert x.numel() > 2**31
    window = x[:, :, -8:, -64:].double()  # bottom-right corner: the largest offsets
    exact = reference.depthwise_conv2d(window, weight.double(), None, 1)[:, :, 1:, 1:]
    assert_matches(
        out[:, :, -7:, -63:],
        exact,
        reference.depthwise_conv2d(x[:, :, -8:, -64:], weight, None, 1)[:, :, 1:, 1:],
        "corner",
    )
    del x, out
    torch.cuda.empty_cache()
