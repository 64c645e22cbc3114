"""Sample inputs and the tolerance rule shared by the tests, the sanitizer
script and the benchmarks: one list of tokenizer cases, so every check sees
the same configurations."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from .config import TokenizerConfig
from .model import VisualTokenizer

BASE = TokenizerConfig.preset("lumenbridge-base")
# Narrow widths, none a multiple of 16 (two not even of 8), keep CPU runs fast
# and reach the kernels' padded-channel paths.
NARROW = dataclasses.replace(BASE, embed_dim=40, stage_widths=(12, 20, 36, 40))
ODD = dataclasses.replace(BASE, embed_dim=42, stage_widths=(10, 22, 34, 42))


@dataclass(frozen=True)
class TokenizeCase:
    """One call of the tokenizer: a config plus the images it gets."""

    name: str
    config: TokenizerConfig
    batch: int = 3
    size: tuple[int, int] = (64, 64)
    uint8: bool = True
    channels_last: bool = False
    dynamic_pad: bool = False

    def model(self, seed: int = 0) -> VisualTokenizer:
        """Fresh random parameters, including random norm statistics and affine
        terms. The convolutions' weights keep the activations' scale from stage
        to stage (PyTorch's default initialization shrinks it about threefold a
        layer, so its tokens are nearly the biases' alone: those of another
        image then pass the half types' tolerance)."""
        model = VisualTokenizer(self.config, dynamic_pad=self.dynamic_pad, seed=seed).eval()
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.Conv2d):
                    # Depthwise: variance kept; pointwise: doubled, for the activation after it to halve.
                    gain = 1.0 if module.groups > 1 else 2.0
                    fan_in = module.weight[0].numel()
                    module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * (gain / fan_in) ** 0.5)
                    module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=generator))
                if isinstance(module, (torch.nn.LayerNorm, torch.nn.BatchNorm2d)):
                    module.weight.copy_(1 + 0.2 * torch.randn(module.weight.shape, generator=generator))
                    module.bias.copy_(0.2 * torch.randn(module.bias.shape, generator=generator))
                if isinstance(module, torch.nn.BatchNorm2d):
                    module.running_mean.copy_(0.3 * torch.randn(module.running_mean.shape, generator=generator))
                    module.running_var.copy_(torch.rand(module.running_var.shape, generator=generator) + 0.5)
        return model

    def images(self, seed: int = 0) -> torch.Tensor:
        """uint8 pixels, or float images already normalized (roughly unit scale)."""
        generator = torch.Generator().manual_seed(seed + 2)
        shape = (self.batch, self.config.in_chans, *self.size)
        if self.uint8:
            x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
        else:
            x = torch.randn(shape, generator=generator)
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x


def _case(name: str, config: TokenizerConfig = BASE, **kwargs) -> TokenizeCase:
    return TokenizeCase(name, config, **kwargs)


def tokenize_cases() -> list[TokenizeCase]:
    """The cases every tokenize check runs: presets, kernel sizes, strides,
    activations, norms, input kinds, layouts, formats, batches and sizes."""
    rep = dataclasses.replace
    return [
        _case("small", TokenizerConfig.preset("lumenbridge-small")),
        _case("base"),
        _case("large", TokenizerConfig.preset("lumenbridge-large"), batch=1),
        _case("base-float-channels-last", uint8=False, channels_last=True),
        _case("base-uint8-channels-last", channels_last=True),
        _case("k5", rep(NARROW, kernel_size=5)),
        _case("k7", rep(NARROW, kernel_size=7), size=(48, 80)),
        _case("mixed-strides", rep(NARROW, strides=(2, 1, 2, 2)), size=(32, 48)),
        _case("stride-1-first", rep(NARROW, strides=(1, 2, 2, 2)), size=(32, 32)),
        _case("relu-nchw-out", rep(NARROW, activation="relu", output_fmt="NCHW")),
        _case("silu-nhwc-out", rep(NARROW, activation="silu", output_fmt="NHWC"), channels_last=True),
        _case("no-activation", rep(NARROW, activation="none")),
        _case("no-token-norm", rep(NARROW, token_norm=False), uint8=False),
        _case("layernorm-stages", rep(NARROW, stage_norm="layernorm")),
        _case("batchnorm-stages", rep(NARROW, stage_norm="batchnorm")),
        _case("odd-widths", ODD, size=(48, 80)),
        _case("odd-widths-nchw-out", rep(ODD, output_fmt="NCHW"), uint8=False, channels_last=True),
        _case("batch-1", NARROW, batch=1),
        _case("batch-64", NARROW, batch=64, size=(32, 32)),
        _case("non-square", NARROW, size=(48, 112)),
        _case("dynamic-pad", NARROW, size=(50, 70), dynamic_pad=True),
        _case("dynamic-pad-float", NARROW, size=(37, 19), dynamic_pad=True, uint8=False, channels_last=True),
        _case("two-stages", rep(NARROW, embed_dim=20, stage_widths=(12, 20), strides=(2, 2)), size=(24, 40)),
        _case("three-stages", rep(NARROW, embed_dim=36, stage_widths=(12, 20, 36), strides=(2, 2, 2))),
        # On a GPU from sm_90 the first kernel splits the tiles of the base
        # widths in three (stage 2's 3 input channel groups, 24 output units):
        # here at K = 5 with stage 2 at stride 1, and in a two-stage model
        # whose first kernel writes NCHW tokens at K = 7, its token norm's
        # row statistics crossing a cluster of three parts.
        _case("base-k5-stride-1-second", rep(BASE, kernel_size=5, strides=(2, 1, 2, 2))),
        # The benchmark's B = 1: on a GPU from sm_90 the first kernel splits
        # its 49 tiles in three, stage 3 its 13 in clusters of four and, with
        # 132 SMs, the last stage its 4 in clusters of eight.
        _case("base-batch-1", batch=1),
        _case(
            "two-stages-split",
            rep(NARROW, embed_dim=192, stage_widths=(96, 192), strides=(2, 2), kernel_size=7, output_fmt="NCHW"),
            size=(24, 40),
        ),
        # More first-kernel tiles (384) than an H200 keeps blocks resident
        # (264), so the blocks run in more than one wave.
        _case("many-tiles", NARROW, batch=24, size=(128, 128)),
    ]


def many_tile_cases() -> list[TokenizeCase]:
    """CUDA cases whose persistent blocks each take several tiles. An H200
    has 132 SMs: a kernel keeps 264 blocks resident where two fit an SM,
    else 132 (the last stage of base and large, and stage 3 of large at
    K = 7). NARROW at 72 x 256 x 256 has more tiles than blocks in every
    kernel, none split. lumenbridge-large at K = 7 and 72 x 256 x 256: its
    last stage's output tile and taps do not both fit a block's shared
    memory, so that kernel loads its taps again for every tile, and its
    blocks take two tiles each before the last 24 of 288 split four ways. A
    stage kernel runs its whole waves unsplit and splits the tiles of a last
    wave that leaves SMs idle, as a launch of their own, in clusters (from
    sm_90: a tile's parts share its depthwise step and a token norm's row
    statistics), while the split wave keeps to one block an SM; the small
    and base presets run the benchmark's widths: small at 48 splits stage
    3's last 60 of 588 tiles in two, base at 24 stage 3's last 30 of 294 in
    four, base at 64 (the benchmark's batch) the last stage's last 64 of 196
    in two; the last stages of small at 48 (147 tiles for 264 blocks) and
    base at 24 (74 for 132) run unsplit, as split they would put two blocks
    on some SMs. Which path runs is not observable from Python: these counts
    are the launch code's, for an H200 or H100 (132 SMs), and need the
    runtime to report enough resident clusters."""
    large_k7 = dataclasses.replace(TokenizerConfig.preset("lumenbridge-large"), kernel_size=7)
    return [
        _case("many-tiles-every-kernel", NARROW, batch=72, size=(256, 256)),
        _case("taps-reloaded-per-tile", large_k7, batch=72, size=(256, 256)),
        _case("small-split-tail", TokenizerConfig.preset("lumenbridge-small"), batch=48, size=(224, 224)),
        _case("base-split-tail", BASE, batch=24, size=(224, 224)),
        _case("base-clustered-tail", BASE, batch=64, size=(224, 224)),
    ]


# Rounding floors, relative to the largest reference value: a few units of
# the dtype's last place, for outputs that round to zero error in PyTorch.
ROUNDING_FLOOR = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


@dataclass(frozen=True)
class ErrorReport:
    """Max abs errors against float64 of an implementation and of PyTorch's
    own layer-by-layer reference in the same dtype, on the same inputs."""

    error: float
    torch_error: float
    floor: float
    factor: float = 2.0  # how many times PyTorch's own error an implementation may make

    @property
    def limit(self) -> float:
        return self.factor * self.torch_error + self.floor

    @property
    def ok(self) -> bool:
        return self.error <= self.limit


def tensor_report(output: torch.Tensor, reference: torch.Tensor, torch_output: torch.Tensor, dtype) -> ErrorReport:
    """Errors of `output` and of PyTorch's own `torch_output` in dtype against
    the float64 `reference` (any devices), with dtype's floor at the
    reference's scale."""
    return ErrorReport(
        error=(output.cpu().double() - reference.cpu()).abs().max().item(),
        torch_error=(torch_output.cpu().double() - reference.cpu()).abs().max().item(),
        floor=ROUNDING_FLOOR[dtype] * max(reference.abs().max().item(), 1.0),
    )


def float64_model(model: VisualTokenizer) -> VisualTokenizer:
    """A float64 CPU copy of model (the cast refills its pixel statistics
    from the config, exact in float64, as the op takes them)."""
    return copy.deepcopy(model).to("cpu", torch.float64)


def compare_to_float64(
    model: VisualTokenizer, images: torch.Tensor, output: torch.Tensor, dtype: torch.dtype
) -> ErrorReport:
    """Errors of `output` (model(images) in dtype on some device) against a
    float64 CPU reference built from the same dtype-rounded weights and inputs."""
    device = output.device
    model64 = float64_model(model)
    images64 = images.cpu() if images.dtype == torch.uint8 else images.cpu().to(torch.float64)
    model_dtype = copy.deepcopy(model).to(device, dtype)
    images_dtype = images if images.dtype == torch.uint8 else images.to(device, dtype)
    with torch.no_grad():
        reference = model64.forward_layers(images64, "reference")
        torch_output = model_dtype.forward_layers(images_dtype, "reference")
    return tensor_report(output, reference, torch_output, dtype)


# Parameter gradients sum over every pixel of the batch, so their rounding
# depends on the reduction order; they may make 3x PyTorch's error (as
# flash-attention's tests allow for weight gradients), image gradients 2x.
PARAMETER_GRADIENT_FACTOR = 3.0
# Cotangents per comparison. The largest error of one short gradient (a bias
# of a dozen channels, say) varies severalfold from one random cotangent to
# the next, for PyTorch as for the op (ReLU masks flip, long sums cancel), so
# the rule compares errors averaged over several.
COTANGENTS = 4


def _gradients(model: VisualTokenizer, images: torch.Tensor, cotangents: list[torch.Tensor], run) -> list[dict]:
    """For each cotangent, the gradients of sum(run(images) * cotangent) for
    every parameter (and float images), from one forward."""
    if images.is_floating_point():
        images = images.detach().requires_grad_(True)
    out = run(model, images)
    grads = []
    for i, cotangent in enumerate(cotangents):
        model.zero_grad(set_to_none=True)
        images.grad = None
        (out * cotangent.to(out.device, out.dtype)).sum().backward(retain_graph=i + 1 < len(cotangents))
        grads.append({name: p.grad for name, p in model.named_parameters()})
        if images.is_floating_point():
            grads[-1]["images"] = images.grad
    return grads


def exactly_normalized(model64: VisualTokenizer, images: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """uint8 images normalized in float64 and rounded once to dtype: the
    closest a PyTorch program in dtype comes to the fused CUDA kernels, which
    normalize in float and keep the result in float for the first
    depthwise convolution (PyTorch's reference rounds after the subtraction
    and again after the division, in dtype)."""
    return ((images.double() - model64.pixel_mean) / model64.pixel_std).to(device, dtype)


def compare_gradients_to_float64(
    model: VisualTokenizer, images: torch.Tensor, run, dtype: torch.dtype, device: torch.device | str
) -> dict[str, ErrorReport]:
    """Per gradient (every parameter, and the images when they are float): the
    errors against a float64 CPU reference of `run(model, images)` in dtype on
    device, and of PyTorch's layer-by-layer reference in the same dtype and
    device, as the mean over COTANGENTS fresh random cotangents of the tokens
    of each one's largest absolute error.

    For uint8 images PyTorch's error is the larger of its reference's and of
    the same reference on the images normalized exactly and rounded once:
    both are PyTorch's own rounding of the same inputs, and they differ by a
    unit in the last place, which flips ReLU's mask on stage outputs that
    cancel to near zero. One flipped mask moves a stage's parameter gradients
    more than all other rounding (measured on the CPU: the relu-nchw-out
    case's stage-2 gradients in float16 are 24-64x apart between the two,
    and 0.6-1.6x apart for GELU and SiLU), so either one alone is a lottery
    rather than a measure of PyTorch's error."""
    model64 = float64_model(model)
    model_dtype = copy.deepcopy(model).to(device, dtype)
    images64 = images.cpu() if images.dtype == torch.uint8 else images.cpu().to(torch.float64)
    images_dtype = images.to(device) if images.dtype == torch.uint8 else images.to(device, dtype)
    with torch.no_grad():
        shape = model64.forward_layers(images64, "reference").shape
    cotangents = [torch.randn(shape, dtype=torch.float64) for _ in range(COTANGENTS)]

    def reference(m, x):
        return m.forward_layers(x, "reference")

    expected = _gradients(model64, images64, cotangents, reference)
    torch_grads = [_gradients(model_dtype, images_dtype, cotangents, reference)]
    if images.dtype == torch.uint8:
        torch_grads.append(
            _gradients(model_dtype, exactly_normalized(model64, images64, dtype, device), cotangents, reference)
        )
    grads = _gradients(model_dtype, images_dtype, cotangents, run)

    def mean_error(got: list[dict], name: str) -> float:
        return sum((g[name].cpu().double() - e[name]).abs().max().item() for g, e in zip(got, expected)) / COTANGENTS

    reports = {}
    for name in expected[0]:
        scale = sum(e[name].abs().max().item() for e in expected) / COTANGENTS
        reports[name] = ErrorReport(
            error=mean_error(grads, name),
            torch_error=max(mean_error(each, name) for each in torch_grads),
            floor=ROUNDING_FLOOR[dtype] * scale,
            factor=2.0 if name == "images" else PARAMETER_GRADIENT_FACTOR,
        )
    return reports
