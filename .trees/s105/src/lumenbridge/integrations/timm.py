"""A LumenBridge tokenizer as timm's patch embedding.

    import timm
    from lumenbridge.integrations.timm import PatchEmbed

    model = timm.create_model("vit_base_patch16_224", embed_layer=PatchEmbed, pretrained=False)

PatchEmbed takes the arguments timm's VisionTransformer passes to its
`embed_layer` and has the attributes timm reads from its own PatchEmbed, so
dynamic_img_size, feature extraction and set_input_size work unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from timm.layers import Format, nhwc_to, to_2tuple
from torch import nn

from ..config import TokenizerConfig
from ..model import VisualTokenizer
from . import tokenizer_config, with_size_advice


class PatchEmbed(nn.Module):
    """timm's `embed_layer` calling convention, on a LumenBridge VisualTokenizer.

    Args beyond timm's:
        config: the tokenizer, a TokenizerConfig or a preset name; by default the
            presets' shape at embed_dim. Choose it with
            functools.partial(PatchEmbed, config="lumenbridge-small").
        backend: the tokenizer's kernel backend (None: chosen per device).

    patch_size must equal the tokenizer's total stride (16 for the presets).
    `bias` is accepted for the calling convention only: the tokenizer's
    convolutions always have biases (timm passes False for pre-norm models,
    where a bias before the norm changes nothing).
    """

    def __init__(
        self,
        img_size: int | tuple[int, int] | None = 224,
        patch_size: int | tuple[int, int] = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        norm_layer: Callable[..., nn.Module] | None = None,
        flatten: bool = True,
        output_fmt: str | None = None,
        bias: bool = True,
        strict_img_size: bool = True,
        dynamic_img_pad: bool = False,
        device=None,
        dtype=None,
        *,
        config: TokenizerConfig | str | None = None,
        backend: str | None = None,
    ):
        super().__init__()
        config = tokenizer_config(config, embed_dim, in_chans)
        stride = config.total_stride
        patch = to_2tuple(patch_size)
        if patch != (stride, stride):
            square = f"or a config whose strides multiply to {patch[0]}" if patch[0] == patch[1] else "(square only)"
            raise ValueError(
                f"patch_size {patch_size} does not match the LumenBridge tokenizer's total stride {stride}: "
                f"use a patch-{stride} model (such as vit_base_patch{stride}_224) {square}"
            )
        self.patch_size = (stride, stride)
        # timm's rule: an explicit output_fmt wins; otherwise flatten picks NLC over NCHW.
        self.flatten = flatten and output_fmt is None
        self.output_fmt = Format(output_fmt) if output_fmt is not None else Format.NLC if flatten else Format.NCHW
        self.strict_img_size = strict_img_size
        self.dynamic_img_pad = dynamic_img_pad
        self.tokenizer = VisualTokenizer(
            dataclasses.replace(config, output_fmt="NHWC"), backend=backend, dynamic_pad=dynamic_img_pad
        ).to(device=device, dtype=dtype)
        self.norm = norm_layer(embed_dim, device=device, dtype=dtype) if norm_layer else nn.Identity()
        self.img_size, self.grid_size, self.num_patches = self._grid(img_size)

    def _grid(self, img_size):
        """img_size as a pair, the token grid the tokenizer gives it (padded up
        with dynamic_img_pad), and its token count. An img_size the tokenizer
        cannot take is refused here, not at every forward."""
        if img_size is None:
            return None, None, None
        img_size = to_2tuple(img_size)
        grid_size = in_timm_words(self.tokenizer.feature_size, *img_size)
        return img_size, grid_size, grid_size[0] * grid_size[1]

    def set_input_size(self, img_size=None, patch_size=None) -> None:
        """What timm's VisionTransformer.set_input_size calls: a new image size; the patch size is fixed."""
        if patch_size is not None and to_2tuple(patch_size) != self.patch_size:
            raise ValueError(
                f"patch_size {patch_size} does not match the LumenBridge tokenizer's total stride {self.patch_size[0]}"
            )
        if img_size is not None:
            self.img_size, self.grid_size, self.num_patches = self._grid(img_size)

    def feat_ratio(self, as_scalar: bool = True) -> int | tuple[int, int]:
        return max(self.patch_size) if as_scalar else self.patch_size

    def dynamic_feat_size(self, img_size: tuple[int, int]) -> tuple[int, int]:
        """The token grid for an input of img_size, padded up when dynamic_img_pad is set."""
        return self.tokenizer.feature_size(*img_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.img_size is not None and self.strict_img_size and tuple(x.shape[-2:]) != self.img_size:
            raise ValueError(
                f"input size {tuple(x.shape[-2:])} does not match the model's img_size {self.img_size}; "
                "build the model with dynamic_img_size=True for other sizes"
            )
        tokens = in_timm_words(self.tokenizer, x)
        return self.norm(nhwc_to(tokens, self.output_fmt))


def in_timm_words(call, *args):
    """call(*args), with the tokenizer's advice on image sizes in timm's words."""
    return with_size_advice("resize the image or build the model with dynamic_img_pad=True", call, *args)
