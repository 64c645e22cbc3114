"""LumenBridge inside the models people build on: timm (integrations.timm),
Hugging Face transformers (integrations.hf) and vLLM's precomputed image
embeddings (integrations.vllm). Each module imports its library only when
it is itself imported, so `import lumenbridge` needs none of them."""

from __future__ import annotations

from ..config import IMAGENET_MEAN, IMAGENET_STD, TokenizerConfig
from ..model import PADDING_ADVICE


def tokenizer_config(config: TokenizerConfig | str | None, embed_dim: int, in_chans: int) -> TokenizerConfig:
    """The tokenizer architecture for a host model of width embed_dim.

    config is a TokenizerConfig or a preset name; None gives the presets' shape
    (four stride-2 stages of widths D/8, D/4, D/2, D) at the host's width, which
    is lumenbridge-small at 384, lumenbridge-base at 768, lumenbridge-large at 1024.
    """
    if config is None:
        if embed_dim % 8:
            raise ValueError(
                f"embed_dim {embed_dim} is not a multiple of 8, so there is no default LumenBridge config "
                "for it; pass config=TokenizerConfig(...)"
            )
        # RGB keeps ImageNet's statistics; other channel counts (grayscale, RGB-D,
        # multispectral) take their average for every channel.
        mean, std = (
            (IMAGENET_MEAN, IMAGENET_STD)
            if in_chans == len(IMAGENET_MEAN)
            else tuple((sum(stats) / len(stats),) * in_chans for stats in (IMAGENET_MEAN, IMAGENET_STD))
        )
        config = TokenizerConfig(
            in_chans=in_chans,
            mean=mean,
            std=std,
            embed_dim=embed_dim,
            stage_widths=(embed_dim // 8, embed_dim // 4, embed_dim // 2, embed_dim),
        )
    elif isinstance(config, str):
        config = TokenizerConfig.preset(config)
    elif not isinstance(config, TokenizerConfig):
        raise TypeError(f"config must be a TokenizerConfig or a preset name, got {type(config).__name__}")
    if config.embed_dim != embed_dim:
        raise ValueError(f"the LumenBridge config gives {config.embed_dim}-wide tokens but the model needs {embed_dim}")
    if config.in_chans != in_chans:
        raise ValueError(f"the LumenBridge config takes {config.in_chans} input channels but the model has {in_chans}")
    return config


def with_size_advice(advice: str, call, *args):
    """call(*args), where the tokenizer's advice for an image side off its
    stride (VisualTokenizer's dynamic_pad) becomes `advice`, in the host
    library's words."""
    try:
        return call(*args)
    except ValueError as error:
        raise ValueError(str(error).replace(PADDING_ADVICE, advice)) from error
