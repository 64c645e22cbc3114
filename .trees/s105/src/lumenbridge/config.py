"""TokenizerConfig: the architecture and preprocessing of a VisualTokenizer, with named presets."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass

# The common ImageNet statistics, on the 0..1 scale; uint8 images are divided by 255 first.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

ACTIVATIONS = ("gelu", "relu", "silu", "none")
STAGE_NORMS = ("none", "batchnorm", "layernorm")
OUTPUT_FORMATS = ("NLC", "NCHW", "NHWC")
# Kernel sizes the native kernels implement, and the only list of them: extension.py
# builds the C++ and CUDA code for these. Odd so that padding K // 2 keeps the grid aligned.
KERNEL_SIZES = (3, 5, 7)


# The fields that shape no parameter: a built model's config may change these.
PREPROCESSING_FIELDS = ("mean", "std", "output_fmt", "image_size")


def architecture_fields() -> list[str]:
    """The TokenizerConfig fields a model's modules and parameters follow."""
    return [f.name for f in dataclasses.fields(TokenizerConfig) if f.name not in PREPROCESSING_FIELDS]


def is_int(value) -> bool:
    """Whether value is an int and not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class TokenizerConfig:
    """Architecture of the tokenizer: len(stage_widths) stages, each a depthwise
    K x K conv (stride per stage, padding K // 2, with bias) then a pointwise
    1 x 1 conv (with bias) to that stage's width, then the optional stage norm,
    then the activation between stages (none after the last)."""

    in_chans: int = 3
    embed_dim: int = 768
    stage_widths: tuple[int, ...] = (96, 192, 384, 768)
    kernel_size: int = 3
    strides: tuple[int, ...] = (2, 2, 2, 2)
    activation: str = "gelu"
    stage_norm: str = "none"
    token_norm: bool = True
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    output_fmt: str = "NLC"
    image_size: int = 224

    def __post_init__(self) -> None:
        # JSON gives lists; keep tuples so configs compare and hash alike.
        for name in ("stage_widths", "strides", "mean", "std"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)):
                raise TypeError(f"TokenizerConfig: {name} must be a list, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        self._validate()

    def _validate(self) -> None:
        self._validate_types()

        def fail(message: str) -> None:
            raise ValueError(f"TokenizerConfig: {message}")

        if self.in_chans < 1:
            fail(f"in_chans must be >= 1, got {self.in_chans}")
        if not self.stage_widths or any(w < 1 for w in self.stage_widths):
            fail(f"stage_widths must be a non-empty list of positive ints, got {self.stage_widths}")
        if self.stage_widths[-1] != self.embed_dim:
            fail(f"the last stage width ({self.stage_widths[-1]}) must equal embed_dim ({self.embed_dim})")
        if len(self.strides) != len(self.stage_widths):
            fail(f"strides has {len(self.strides)} entries but there are {len(self.stage_widths)} stages")
        if any(s not in (1, 2) for s in self.strides):
            fail(f"each stride must be 1 or 2, got {self.strides}")
        if self.kernel_size not in KERNEL_SIZES:
            fail(f"kernel_size must be one of {KERNEL_SIZES}, got {self.kernel_size}")
        if self.activation not in ACTIVATIONS:
            fail(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.stage_norm not in STAGE_NORMS:
            fail(f"stage_norm must be one of {STAGE_NORMS}, got {self.stage_norm!r}")
        if self.output_fmt not in OUTPUT_FORMATS:
            fail(f"output_fmt must be one of {OUTPUT_FORMATS}, got {self.output_fmt!r}")
        if len(self.mean) != self.in_chans or len(self.std) != self.in_chans:
            fail(f"mean and std need {self.in_chans} entries (one per input channel)")
        if any(not s > 0 for s in self.std):
            fail(f"std entries must be positive, got {self.std}")
        if self.image_size < 1 or self.image_size % self.total_stride:
            fail(
                f"image_size ({self.image_size}) must be a positive multiple of the total stride ({self.total_stride})"
            )

    def _validate_types(self) -> None:
        def is_finite(value) -> bool:
            return is_int(value) or (isinstance(value, float) and math.isfinite(value))

        for name in ("in_chans", "embed_dim", "kernel_size", "image_size"):
            if not is_int(getattr(self, name)):
                raise TypeError(f"TokenizerConfig: {name} must be an int, got {getattr(self, name)!r}")
        for name in ("stage_widths", "strides"):
            if not all(is_int(v) for v in getattr(self, name)):
                raise TypeError(f"TokenizerConfig: {name} must hold ints, got {getattr(self, name)!r}")
        for name in ("mean", "std"):
            if not all(is_finite(v) for v in getattr(self, name)):
                raise TypeError(f"TokenizerConfig: {name} must hold finite numbers, got {getattr(self, name)!r}")
        for name in ("activation", "stage_norm", "output_fmt"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"TokenizerConfig: {name} must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.token_norm, bool):
            raise TypeError(f"TokenizerConfig: token_norm must be true or false, got {self.token_norm!r}")

    # The derived values a forward reads are computed once per (frozen) config:
    # each call's host time counts at small batches.
    @functools.cached_property
    def pixel_mean(self) -> tuple[float, ...]:
        """mean on the 0..255 scale of uint8 pixels."""
        return tuple(255.0 * m for m in self.mean)

    @functools.cached_property
    def pixel_std(self) -> tuple[float, ...]:
        """std on the 0..255 scale of uint8 pixels."""
        return tuple(255.0 * s for s in self.std)

    @functools.cached_property
    def total_stride(self) -> int:
        """How many input pixels one token spans per side."""
        return math.prod(self.strides)

    @property
    def num_stages(self) -> int:
        return len(self.stage_widths)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> TokenizerConfig:
        if not isinstance(data, dict):
            raise TypeError(f"TokenizerConfig: expected a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"TokenizerConfig: unknown keys {unknown}; known keys are {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> TokenizerConfig:
        return cls.from_dict(json.loads(text))

    @classmethod
    def preset(cls, name: str) -> TokenizerConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; presets are {sorted(PRESETS)}")
        return PRESETS[name]


PRESETS: dict[str, TokenizerConfig] = {
    "lumenbridge-small": TokenizerConfig(embed_dim=384, stage_widths=(48, 96, 192, 384)),
    "lumenbridge-base": TokenizerConfig(),
    "lumenbridge-large": TokenizerConfig(embed_dim=1024, stage_widths=(128, 256, 512, 1024)),
}
