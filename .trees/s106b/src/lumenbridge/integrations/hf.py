"""LumenBridge in Hugging Face transformers.

- LumenBridgeVisionConfig / LumenBridgeVisionModel: the tokenizer as a
  PreTrainedModel (model_type "lumenbridge"), registered with AutoConfig and
  AutoModel when this module is imported; save_pretrained writes config.json
  and model.safetensors.
- replace_patch_embedding: a LumenBridge tokenizer in place of the patch
  embedding of a CLIPVisionModel or SiglipVisionModel.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.clip.modeling_clip import CLIPVisionEmbeddings, CLIPVisionModel
from transformers.models.siglip.modeling_siglip import SiglipVisionEmbeddings, SiglipVisionModel

from ..checkpoint import HF_MODEL_TYPE
from ..config import TokenizerConfig
from ..model import VisualTokenizer, pixel_statistics
from . import tokenizer_config, with_size_advice

# The TokenizerConfig fields the Hugging Face config records: all but output_fmt,
# as the model there always emits [B, N, D].
RECORDED_FIELDS = tuple(f.name for f in dataclasses.fields(TokenizerConfig) if f.name != "output_fmt")


class LumenBridgeVisionConfig(PretrainedConfig):
    """A TokenizerConfig's fields (all but output_fmt) as a Hugging Face config.

    LumenBridgeVisionConfig(embed_dim=384, stage_widths=[48, 96, 192, 384]) or
    LumenBridgeVisionConfig.from_tokenizer_config(TokenizerConfig.preset("lumenbridge-small")).
    """

    model_type = HF_MODEL_TYPE
    attribute_map: ClassVar[dict[str, str]] = {"hidden_size": "embed_dim", "num_channels": "in_chans"}

    def __init__(self, **kwargs):
        # transformers' names (hidden_size, ...) are the fields', so they are validated with them.
        for alias, name in self.attribute_map.items():
            if alias in kwargs:
                value = kwargs.pop(alias)
                if name in kwargs and kwargs[name] != value:
                    raise ValueError(f"{alias}={value!r} and {name}={kwargs[name]!r} name one field and disagree")
                kwargs[name] = value
        defaults = TokenizerConfig().to_dict()
        fields = {name: kwargs.pop(name, defaults[name]) for name in RECORDED_FIELDS}
        TokenizerConfig(**fields)  # validates every field, naming the bad one
        # Lists, as config.json will hold them, so a loaded config equals the saved one.
        fields = {name: list(value) if isinstance(value, tuple) else value for name, value in fields.items()}
        for name, value in fields.items():
            setattr(self, name, value)
        super().__init__(**kwargs)

    @classmethod
    def from_tokenizer_config(cls, config: TokenizerConfig, **kwargs) -> LumenBridgeVisionConfig:
        return cls(**{name: getattr(config, name) for name in RECORDED_FIELDS}, **kwargs)

    @property
    def tokenizer_config(self) -> TokenizerConfig:
        return TokenizerConfig(**{name: getattr(self, name) for name in RECORDED_FIELDS})


class LumenBridgeVisionModel(PreTrainedModel):
    """pixel_values [B, C, H, W] in, BaseModelOutput with last_hidden_state [B, N, D] out.
    It takes a vision tower's usual keywords (None: the config's setting): with
    output_hidden_states, hidden_states holds the tokens alone (the tokenizer has
    no transformer layers, so a LLaVA-style model needs vision_feature_layer=-1,
    and vision_feature_select_strategy="full" as there is no class token to drop);
    return_dict=False gives a tuple; others (output_attentions, say) are accepted
    and ignored."""

    config_class = LumenBridgeVisionConfig
    base_model_prefix = "tokenizer"  # the attribute that holds the VisualTokenizer
    main_input_name = "pixel_values"

    def __init__(self, config: LumenBridgeVisionConfig):
        super().__init__(config)
        self.tokenizer = VisualTokenizer(config.tokenizer_config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # Each layer's PyTorch initialization (what the tokenizer is designed to train
        # from), not transformers' generic normal(0, 0.02). from_pretrained allocates
        # the modules uninitialized and calls this for those the checkpoint lacks, and
        # for the normalization buffers, which no checkpoint holds.
        if isinstance(module, (nn.Conv2d, nn.LayerNorm, nn.BatchNorm2d)):
            module.reset_parameters()
        if isinstance(module, VisualTokenizer):
            mean, std = pixel_statistics(module.config)
            module.pixel_mean.copy_(mean)
            module.pixel_std.copy_(std)

    def forward(
        self,
        pixel_values: torch.Tensor,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutput | tuple:
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        if return_dict is None:
            return_dict = self.config.return_dict
        tokens = without_padding_advice(self.tokenizer, pixel_values)
        hidden_states = (tokens,) if output_hidden_states else None
        if return_dict is False:
            return (tokens,) if hidden_states is None else (tokens, hidden_states)
        return BaseModelOutput(last_hidden_state=tokens, hidden_states=hidden_states)


def without_padding_advice(tokenizer: VisualTokenizer, pixel_values: torch.Tensor) -> torch.Tensor:
    """tokenizer(pixel_values), whose advice on image sizes leaves out dynamic_pad,
    an option of VisualTokenizer that the transformers models here do not take."""
    return with_size_advice("resize the image", tokenizer, pixel_values)


AutoConfig.register(LumenBridgeVisionConfig.model_type, LumenBridgeVisionConfig, exist_ok=True)
AutoModel.register(LumenBridgeVisionConfig, LumenBridgeVisionModel, exist_ok=True)


class LumenBridgePatchEmbedding(nn.Module):
    """Stands where CLIP and SigLIP keep their patch Conv2d: [B, C, H, W] to [B, D, H/s, W/s]."""

    def __init__(self, tokenizer: VisualTokenizer):
        super().__init__()
        self.tokenizer = tokenizer

    @property
    def weight(self) -> torch.Tensor:
        """A parameter of the tokenizer: the vision embeddings read patch_embedding.weight.dtype to cast the pixels."""
        return self.tokenizer.stages[0].dw.weight

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return without_padding_advice(self.tokenizer, pixel_values)


def _vision_embeddings(vision_model: nn.Module) -> CLIPVisionEmbeddings | SiglipVisionEmbeddings:
    if not isinstance(vision_model, (CLIPVisionModel, SiglipVisionModel)):
        raise TypeError(
            f"replace_patch_embedding takes a CLIPVisionModel or SiglipVisionModel, got {type(vision_model).__name__}"
        )
    # transformers 4 keeps the embeddings in an inner vision_model, transformers 5 on the model itself.
    return getattr(vision_model, "vision_model", vision_model).embeddings


def _resize_position_embedding(embeddings: CLIPVisionEmbeddings | SiglipVisionEmbeddings, grid: int) -> None:
    """Resample the square grid of position embeddings to grid x grid (bicubic, as transformers'
    own interpolate_pos_encoding does), keeping CLIP's class-token position as it is."""
    weight = embeddings.position_embedding.weight.detach()
    prefix = embeddings.num_positions - embeddings.num_patches  # 1 (class token) for CLIP, 0 for SigLIP
    old = round(embeddings.num_patches**0.5)
    patch_positions = weight[prefix:].reshape(1, old, old, -1).permute(0, 3, 1, 2)
    patch_positions = F.interpolate(patch_positions.float(), size=(grid, grid), mode="bicubic", align_corners=False)
    patch_positions = patch_positions.to(weight.dtype).permute(0, 2, 3, 1).reshape(grid * grid, -1)
    embeddings.position_embedding = nn.Embedding.from_pretrained(
        torch.cat((weight[:prefix], patch_positions)), freeze=False
    )
    embeddings.num_patches = grid * grid
    embeddings.num_positions = grid * grid + prefix
    embeddings.position_ids = torch.arange(embeddings.num_positions, device=weight.device).expand((1, -1))


def replace_patch_embedding(
    vision_model: nn.Module, config: TokenizerConfig | str | None = None, *, backend: str | None = None
) -> nn.Module:
    """Put a LumenBridge tokenizer in place of the patch embedding of a CLIPVisionModel
    or SiglipVisionModel, in place, and return the model.

    config: a TokenizerConfig or preset name whose embed_dim is the model's hidden_size
    (default: the presets' shape at that width). Where the tokenizer's total stride
    differs from the model's patch_size, the position embeddings are resampled to the
    new token grid and config.patch_size becomes the stride, so the token count, the
    position embeddings and interpolate_pos_encoding stay consistent.
    """
    embeddings = _vision_embeddings(vision_model)
    if isinstance(embeddings.patch_embedding, LumenBridgePatchEmbedding):
        raise TypeError("this model's patch embedding is a LumenBridge tokenizer already")
    config = tokenizer_config(config, embeddings.embed_dim, embeddings.patch_embedding.in_channels)
    stride = config.total_stride
    if embeddings.image_size % stride:
        raise ValueError(
            f"the model's image_size {embeddings.image_size} is not a multiple of the tokenizer's total stride {stride}"
        )
    old_weight = embeddings.patch_embedding.weight
    tokenizer = VisualTokenizer(dataclasses.replace(config, output_fmt="NCHW"), backend=backend)
    embeddings.patch_embedding = LumenBridgePatchEmbedding(tokenizer.to(old_weight.device, old_weight.dtype))
    grid = embeddings.image_size // stride
    if grid * grid != embeddings.num_patches:
        _resize_position_embedding(embeddings, grid)
    embeddings.patch_size = stride
    vision_model.config.patch_size = stride
    return vision_model
