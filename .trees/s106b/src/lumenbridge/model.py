"""VisualTokenizer: images [B, C, H, W] in, tokens [B, N, D] out."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import checkpoint, ops
from .config import TokenizerConfig, architecture_fields
from .dispatch import check_backend_name, select_backend
from .layout import is_channels_last, memory_format_of
from .shapes import grid_extent

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# Of every LayerNorm (stage and token norms): nn.LayerNorm's default.
NORM_EPS = 1e-5


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an [N, C, H, W] tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


# The module of each config activation (nn.GELU's default is the erf form).
ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU, "none": nn.Identity}


def _make_activation(name: str) -> nn.Module:
    return ACTIVATIONS[name]()


def _is_config_layer_norm(module: nn.Module, kind: type) -> bool:
    """Whether module is still the LayerNorm the config describes: of `kind`,
    NORM_EPS, with a weight and a bias."""
    return (
        isinstance(module, kind)
        and module.eps == NORM_EPS
        and module.elementwise_affine
        # The table first: nn.Module's attribute lookup costs about a microsecond.
        and (module._parameters.get("bias") is not None or getattr(module, "bias", None) is not None)
    )


def _submodule(module: nn.Module, name: str) -> nn.Module | None:
    """module.<name>, a submodule, read from the module's table: nn.Module's
    attribute lookup costs about a microsecond, and every forward checks a
    dozen submodules (edited_module). The normal lookup where the table lacks it."""
    found = module._modules.get(name)
    return found if found is not None else getattr(module, name)


def _is_config_stage_norm(module: nn.Module, name: str) -> bool:
    """Whether module still computes the config's stage norm `name`: the
    LayerNorm above; a BatchNorm (SyncBatchNorm too, which DDP training swaps
    in) that is affine, tracks running statistics and keeps NORM_EPS; or none."""
    if name == "layernorm":
        return _is_config_layer_norm(module, LayerNorm2d)
    if name == "batchnorm":
        return (
            isinstance(module, (nn.BatchNorm2d, nn.SyncBatchNorm))
            and module.affine
            and module.track_running_stats
            and module.eps == NORM_EPS
        )
    return type(module) is nn.Identity


def _make_stage_norm(name: str, channels: int) -> nn.Module:
    if name == "layernorm":
        return LayerNorm2d(channels, eps=NORM_EPS)
    return {"none": nn.Identity, "batchnorm": nn.BatchNorm2d}[name](channels)


class SeparableStage(nn.Module):
    """Depthwise K x K (stride s) then pointwise 1 x 1, then the stage norm.
    The two convolutions go through ops.separable_conv as one call, so a
    backend can fuse them without this module changing."""

    def __init__(self, in_chans: int, out_chans: int, kernel_size: int, stride: int, norm: str):
        super().__init__()
        self.dw = nn.Conv2d(in_chans, in_chans, kernel_size, stride, kernel_size // 2, groups=in_chans)
        self.pw = nn.Conv2d(in_chans, out_chans, 1)
        self.norm = _make_stage_norm(norm, out_chans)

    def forward(self, x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        x = ops.separable_conv(
            x, self.dw.weight, self.dw.bias, self.pw.weight, self.pw.bias, self.dw.stride[0], backend=backend
        )
        return self.norm(x)


def pixel_statistics(cfg: TokenizerConfig, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The normalization buffers, mean and std on the uint8 scale, shaped [1, C, 1, 1]
    (in the default dtype, or `dtype`)."""
    return tuple(torch.tensor(v, dtype=dtype).view(1, -1, 1, 1) for v in (cfg.pixel_mean, cfg.pixel_std))


# What an image side off the total stride is told to do; integrations name their own option instead.
PADDING_ADVICE = "resize the image or pass dynamic_pad=True"


class VisualTokenizer(nn.Module):
    """Turns images into a token sequence for transformer attention.

    Args:
        config: architecture; defaults to the lumenbridge-base preset.
        backend: force "reference" or "native" (None: chosen per device, see dispatch.py).
        dynamic_pad: pad H and W up to the next multiple of the total stride
            instead of rejecting sizes that are not multiples.
        check_finite: raise ValueError on NaN or Inf in float inputs (costs a device sync).
        seed: initialise the parameters from this seed, reproducibly.

    forward(images) takes uint8 images (0..255; normalized with config.mean/std)
    or float images (already normalized), [B, in_chans, H, W] in any dense layout.
    The backend (dispatch.py) runs the whole tokenizer: the reference in plain
    PyTorch, or the native op torch.ops.lumenbridge.tokenize in one call.
    """

    norm_eps = NORM_EPS

    def __init__(
        self,
        config: TokenizerConfig | None = None,
        *,
        backend: str | None = None,
        dynamic_pad: bool = False,
        check_finite: bool = False,
        seed: int | None = None,
    ):
        super().__init__()
        self.config = TokenizerConfig() if config is None else config
        if backend is not None:
            check_backend_name(backend)  # now, not at the first forward
        self.backend = backend
        self.dynamic_pad = dynamic_pad
        self.check_finite = check_finite
        cfg = self.config
        with torch.random.fork_rng(enabled=seed is not None, devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            widths = (cfg.in_chans, *cfg.stage_widths)
            self.stages = nn.ModuleList(
                SeparableStage(widths[i], widths[i + 1], cfg.kernel_size, cfg.strides[i], cfg.stage_norm)
                for i in range(cfg.num_stages)
            )
            self.act = _make_activation(cfg.activation)
            self.token_norm = nn.LayerNorm(cfg.embed_dim, eps=NORM_EPS) if cfg.token_norm else nn.Identity()
        mean, std = pixel_statistics(cfg)
        self.register_buffer("pixel_mean", mean, persistent=False)
        self.register_buffer("pixel_std", std, persistent=False)

    def __setattr__(self, name, value):
        if name != "config":
            super().__setattr__(name, value)
            return
        if not isinstance(value, TokenizerConfig):
            raise TypeError(
                f"config must be a TokenizerConfig, got {type(value).__name__}; "
                "for a preset use TokenizerConfig.preset(name)"
            )
        built = "pixel_mean" in self._buffers
        if built:
            changed = [f for f in architecture_fields() if getattr(value, f) != getattr(self.config, f)]
            if changed:
                raise ValueError(
                    f"a built model's config cannot change {', '.join(changed)}, which its parameters follow; "
                    "build a new VisualTokenizer from the new config"
                )
        super().__setattr__(name, value)
        if built:  # the native op reads the pixel statistics from the config, the reference from the buffers
            self._refill_pixel_statistics()

    def _apply(self, fn, recurse=True):
        """Every move and cast (to, half, to_empty, ...) also refills the pixel
        statistics from the config, in the buffers' new dtype: a cast would
        otherwise keep a narrower dtype's rounding (bf16 and back to float32),
        and to_empty leaves them uninitialized, since no checkpoint holds them."""
        super()._apply(fn, recurse)
        self._refill_pixel_statistics()
        return self

    def _refill_pixel_statistics(self) -> None:
        mean, std = pixel_statistics(self.config, self.pixel_mean.dtype)
        with torch.no_grad():
            self.pixel_mean.copy_(mean)
            self.pixel_std.copy_(std)

    @property
    def embed_dim(self) -> int:
        return self.config.embed_dim

    def feature_size(self, height: int, width: int) -> tuple[int, int]:
        """The token grid (rows, columns) for an input of height x width."""
        for extent in (height, width):
            if isinstance(extent, bool) or not isinstance(extent, (int, torch.SymInt)):
                raise TypeError(f"image sides must be integers, got {height!r} x {width!r}")
            self._check_extent(extent)
        cfg = self.config
        return tuple(grid_extent(extent, cfg.kernel_size, cfg.strides) for extent in self.padded_size(height, width))

    def padded_size(self, height: int, width: int) -> tuple[int, int]:
        """The input extents after dynamic padding (unchanged without it)."""
        if not self.dynamic_pad:
            return height, width
        return self._padded(height), self._padded(width)

    def _padded(self, extent: int) -> int:
        step = self.config.total_stride
        return -(-extent // step) * step

    def _check_extent(self, extent: int) -> None:
        step = self.config.total_stride
        if extent < step:
            raise ValueError(f"image side {extent} is smaller than the total stride {step}")
        if extent % step and not self.dynamic_pad:
            raise ValueError(f"image side {extent} is not a multiple of the total stride {step}; {PADDING_ADVICE}")

    def _check_images(self, images: torch.Tensor) -> None:
        if not isinstance(images, torch.Tensor):
            raise TypeError(f"images must be a torch.Tensor, got {type(images).__name__}")
        if images.layout != torch.strided:
            raise TypeError(f"images must be a dense tensor, got layout {images.layout}; convert it with .to_dense()")
        if images.dtype != torch.uint8 and images.dtype not in FLOAT_DTYPES:
            raise TypeError(f"images must be uint8 (0..255) or floating point, got {images.dtype}")
        if images.dim() != 4:
            raise ValueError(f"images must be 4-D [B, C, H, W], got {images.dim()}-D with shape {tuple(images.shape)}")
        # From the buffer table: nn.Module's attribute lookup costs about a microsecond a call.
        if images.device != self._buffers["pixel_mean"].device:
            raise ValueError(
                f"images are on {images.device} but the model is on {self.pixel_mean.device}; move one of them"
            )
        if images.shape[1] != self.config.in_chans:
            raise ValueError(f"images have {images.shape[1]} channels but the model expects {self.config.in_chans}")
        for extent in images.shape[2:]:
            self._check_extent(extent)
        if self.check_finite and images.is_floating_point():
            # As the model computes them: a finite value can overflow the model's dtype.
            dtype = self.stages[0].dw.weight.dtype
            if not bool(torch.isfinite(images.to(dtype)).all()):
                raise ValueError(f"images contain NaN or Inf values (in the model's dtype, {dtype})")

    def _prepare(self, images: torch.Tensor) -> torch.Tensor:
        """Normalize uint8 input, cast to the parameters' dtype, pad, make dense."""
        dtype = self.stages[0].dw.weight.dtype
        if images.dtype == torch.uint8:
            x = (images.to(dtype) - self.pixel_mean.to(dtype)) / self.pixel_std.to(dtype)
        else:
            x = images.to(dtype)
        height, width = x.shape[2:]
        padded_height, padded_width = self.padded_size(height, width)
        if (padded_height, padded_width) != (height, width):
            x = F.pad(x, (0, padded_width - width, 0, padded_height - height))
        # The kernels read dense NCHW or NHWC; keep channels-last input channels-last.
        return x.contiguous(memory_format=memory_format_of(x))

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """The final feature map [B, D, h, w], before the token norm, computed layer by layer."""
        self._check_images(images)
        return self._features(images, self.backend)

    def _features(self, images: torch.Tensor, backend: str | None) -> torch.Tensor:
        x = self._prepare(images)
        last = len(self.stages) - 1
        for index, stage in enumerate(self.stages):
            x = stage(x, backend=backend)
            if index != last:
                x = self.act(x)
        return x

    def edited_module(self) -> str | None:
        """Which module no longer computes what the config says (an activation
        or norm replaced, added or removed, an eps changed, a depthwise stride changed), or None.
        The native op takes the architecture from the config, so such a model runs layer by layer."""
        cfg = self.config
        act = self._modules["act"]
        if type(act) is not ACTIVATIONS[cfg.activation] or act.__dict__.get("approximate", "none") != "none":
            return f"act is {act!r}, not the config's activation {cfg.activation!r}"
        token_norm = self._modules["token_norm"]
        if not (_is_config_layer_norm(token_norm, nn.LayerNorm) if cfg.token_norm else type(token_norm) is nn.Identity):
            return f"token_norm is {token_norm!r}, not the config's"
        for index, stage in enumerate(self._modules["stages"]._modules.values()):
            norm, stride = _submodule(stage, "norm"), _submodule(stage, "dw").stride
            if not _is_config_stage_norm(norm, cfg.stage_norm):
                return f"stage {index}'s norm is {norm!r}, not the config's {cfg.stage_norm!r}"
            if stride != (cfg.strides[index],) * 2:
                return f"stage {index}'s depthwise stride is {stride}, not the config's {cfg.strides[index]}"
        return None

    def forward_layers(self, images: torch.Tensor, backend: str) -> torch.Tensor:
        """The tokens of already checked images, layer by layer, each convolution
        through `backend`: the composition the op and its backward must match,
        and the path of the reference backend (and of BatchNorm stage norms in
        training mode on the native one)."""
        tokens = self.token_norm(self._features(images, backend).permute(0, 2, 3, 1))  # [B, h, w, D]
        fmt = self.config.output_fmt
        if fmt == "NHWC":
            return tokens
        if fmt == "NCHW":
            return tokens.permute(0, 3, 1, 2)
        return tokens.flatten(1, 2)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self._check_images(images)
        backend = select_backend(images.device, self.backend, channels_last=is_channels_last(images))
        return backend.tokenize(images, self)

    def save_pretrained(self, directory: str | Path) -> None:
        """Write config.json and model.safetensors into directory."""
        checkpoint.save(self, directory)

    @classmethod
    def from_pretrained(cls, directory: str | Path, **kwargs) -> VisualTokenizer:
        """Build from the config saved with model.safetensors (config.json must
        agree with it) and load the weights in the dtype they were saved in;
        kwargs go to __init__."""
        config = checkpoint.read_config(directory)
        model = cls(config, **kwargs)
        checkpoint.load_weights(model, directory)
        return model

    def forward_packed(self, images: list[torch.Tensor]):
        """Tokenize images of different sizes ([C, H, W] each) into one packed
        sequence: a packing.PackedTokens with the tokens [sum of N_i, D],
        cu_seqlens, grid_hw and 2-D positions. Each image's tokens equal its
        own forward; images of equal size run as one batch. BatchNorm stages
        must use running statistics (eval mode), or the images would share
        theirs."""
        from .packing import pack  # here, so that packing's whole footprint in this file is this method

        return pack(self, images)
