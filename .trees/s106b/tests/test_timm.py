"""lumenbridge.integrations.timm.PatchEmbed as timm's embed_layer."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from conftest import import_or_skip

from lumenbridge import TokenizerConfig, VisualTokenizer

timm = import_or_skip("timm")
from lumenbridge.integrations.timm import PatchEmbed

SMALL = dataclasses.replace(TokenizerConfig(), embed_dim=64, stage_widths=(8, 16, 32, 64))


def tiny_vit(**kwargs):
    """A 2-block, 64-wide ViT: the same code paths as the named models, in milliseconds."""
    embed_layer = functools.partial(PatchEmbed, config=SMALL)
    return timm.models.VisionTransformer(
        embed_dim=64, depth=2, num_heads=2, num_classes=10, embed_layer=embed_layer, **kwargs
    )


def assert_trains(model, images):
    logits = model(images)
    logits.square().mean().backward()
    tokenizer = model.patch_embed.tokenizer
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in tokenizer.parameters())
    assert model.head.weight.grad.abs().sum() > 0
    return logits


@pytest.mark.parametrize(
    "name, preset, width",
    [("vit_small_patch16_224", "lumenbridge-small", 384), ("vit_base_patch16_224", "lumenbridge-base", 768)],
)
def test_named_vits_build_and_train_with_the_preset_of_their_width(name, preset, width):
    model = timm.create_model(name, embed_layer=PatchEmbed, pretrained=False)
    assert isinstance(model.patch_embed, PatchEmbed)
    assert model.patch_embed.tokenizer.config == dataclasses.replace(TokenizerConfig.preset(preset), output_fmt="NHWC")
    assert model.patch_embed.num_patches == 196 and model.pos_embed.shape == (1, 197, width)
    logits = assert_trains(model, torch.randn(1, 3, 224, 224))
    assert logits.shape == (1, 1000)


@pytest.mark.parametrize("name", ["vit_small_patch16_224", "vit_base_patch16_224"])
def test_named_vits_take_other_sizes_with_dynamic_img_size(name):
    model = timm.create_model(name, embed_layer=PatchEmbed, pretrained=False, dynamic_img_size=True, num_classes=10)
    for size, tokens in (((224, 224), 196), ((320, 256), 320)):
        images = torch.randn(1, 3, *size)
        assert model.forward_features(images).shape[1] == tokens + 1  # + the class token
        assert assert_trains(model, images).shape == (1, 10)
        model.zero_grad()


def test_the_patch_embedding_is_the_tokenizer_plus_timms_norm():
    model = tiny_vit(dynamic_img_size=True).eval()
    tokenizer = VisualTokenizer(dataclasses.replace(SMALL, output_fmt="NHWC"))
    tokenizer.load_state_dict(model.patch_embed.tokenizer.state_dict())
    images = torch.randn(2, 3, 320, 256)
    with torch.no_grad():
        torch.testing.assert_close(model.patch_embed(images), tokenizer(images), rtol=0, atol=0)
    normed = PatchEmbed(embed_dim=64, config=SMALL, norm_layer=torch.nn.LayerNorm, flatten=True)
    with torch.no_grad():
        tokens = normed.tokenizer(images[:, :, :224, :224]).flatten(1, 2)
        torch.testing.assert_close(normed(images[:, :, :224, :224]), normed.norm(tokens))


def test_config_by_keyword_or_partial():
    by_name = PatchEmbed(embed_dim=384, config="lumenbridge-small")
    by_partial = functools.partial(PatchEmbed, config=TokenizerConfig.preset("lumenbridge-small"))(embed_dim=384)
    default = PatchEmbed(embed_dim=384)
    widths = {e.tokenizer.config.stage_widths for e in (by_name, by_partial, default)}
    assert widths == {(48, 96, 192, 384)}
    assert PatchEmbed(embed_dim=192).tokenizer.config.stage_widths == (24, 48, 96, 192)  # vit_tiny's width


def test_the_attributes_timm_reads():
    embed = PatchEmbed(img_size=(224, 320), embed_dim=64, config=SMALL)
    assert embed.patch_size == (16, 16)
    assert embed.grid_size == (14, 20) and embed.num_patches == 280
    assert embed.feat_ratio() == 16 and embed.feat_ratio(as_scalar=False) == (16, 16)
    assert embed.dynamic_feat_size((320, 256)) == (20, 16)
    padded = PatchEmbed(embed_dim=64, config=SMALL, dynamic_img_pad=True)
    assert padded.dynamic_feat_size((230, 250)) == (15, 16)
    assert PatchEmbed(img_size=None, embed_dim=64, config=SMALL).grid_size is None


@pytest.mark.parametrize(
    "kwargs, shape",
    [
        ({}, (2, 4, 64)),  # flatten: NLC
        ({"flatten": False}, (2, 64, 2, 2)),  # NCHW
        ({"output_fmt": "NHWC", "strict_img_size": False}, (2, 2, 2, 64)),
        ({"output_fmt": "NCL"}, (2, 64, 4)),
    ],
)
def test_output_formats_follow_timms_rules(kwargs, shape):
    embed = PatchEmbed(img_size=32, embed_dim=64, config=SMALL, **kwargs)
    assert embed(torch.randn(2, 3, 32, 32)).shape == shape


def test_dynamic_img_pad_pads_odd_sizes():
    model = tiny_vit(img_size=224, dynamic_img_size=True, dynamic_img_pad=True)
    assert model.forward_features(torch.randn(1, 3, 230, 250)).shape == (1, 15 * 16 + 1, 64)


def test_set_input_size_resizes_the_grid_and_position_embeddings():
    model = tiny_vit(img_size=224)
    model.set_input_size(img_size=(256, 192))
    assert model.patch_embed.grid_size == (16, 12) and model.pos_embed.shape == (1, 16 * 12 + 1, 64)
    assert model(torch.randn(1, 3, 256, 192)).shape == (1, 10)
    with pytest.raises(ValueError, match="total stride 16"):
        model.set_input_size(patch_size=14)


def test_feature_maps_come_out_at_the_token_grid():
    model = tiny_vit(dynamic_img_size=True)
    features = model.forward_intermediates(torch.randn(1, 3, 320, 256), indices=1, intermediates_only=True)
    assert features[0].shape == (1, 64, 20, 16)


def test_a_patch_size_other_than_the_total_stride_is_a_clear_error():
    with pytest.raises(ValueError, match="patch_size 14 does not match the LumenBridge tokenizer's total stride 16"):
        timm.create_model("vit_small_patch14_dinov2", embed_layer=PatchEmbed, pretrained=False)
    with pytest.raises(ValueError, match="patch_size 32 does not match .* total stride 16"):
        PatchEmbed(patch_size=32, embed_dim=64, config=SMALL)
    with pytest.raises(ValueError, match=r"patch_size \(16, 8\) does not match .* \(square only\)"):
        PatchEmbed(patch_size=(16, 8), embed_dim=64, config=SMALL)
    eight = dataclasses.replace(SMALL, strides=(2, 2, 2, 1))
    assert PatchEmbed(patch_size=8, embed_dim=64, config=eight).grid_size == (28, 28)


def test_mismatched_configs_are_clear_errors():
    with pytest.raises(ValueError, match="384-wide tokens but the model needs 768"):
        PatchEmbed(embed_dim=768, config="lumenbridge-small")
    with pytest.raises(ValueError, match="takes 3 input channels but the model has 1"):
        PatchEmbed(in_chans=1, embed_dim=64, config=SMALL)
    with pytest.raises(ValueError, match="not a multiple of 8"):
        PatchEmbed(embed_dim=100)
    with pytest.raises(TypeError, match="TokenizerConfig or a preset name"):
        PatchEmbed(embed_dim=64, config=64)


def test_the_default_tokenizer_takes_the_models_channel_count():
    model = timm.create_model("vit_small_patch16_224", in_chans=1, embed_layer=PatchEmbed, pretrained=False)
    tokenizer = model.patch_embed.tokenizer
    assert tokenizer.config.in_chans == 1 and len(tokenizer.config.mean) == 1
    assert model(torch.randn(1, 1, 224, 224)).shape == (1, 1000)


def test_a_size_that_needs_padding_names_timms_option():
    model = tiny_vit(img_size=224, dynamic_img_size=True)
    with pytest.raises(ValueError, match="build the model with dynamic_img_pad=True"):
        model(torch.randn(1, 3, 230, 224))


def test_an_img_size_off_the_stride_is_refused_when_built_or_padded_up_with_dynamic_img_pad():
    with pytest.raises(ValueError, match="image side 200 is not a multiple of .*build the model with dynamic_img_pad"):
        tiny_vit(img_size=200)
    model = tiny_vit(img_size=224)
    with pytest.raises(ValueError, match="image side 250 is not a multiple"):
        model.set_input_size(img_size=250)
    padded = tiny_vit(img_size=200, dynamic_img_pad=True)  # 13 x 13 tokens, as the tokenizer pads
    assert padded.patch_embed.grid_size == (13, 13) and padded.pos_embed.shape == (1, 13 * 13 + 1, 64)
    assert padded(torch.randn(1, 3, 200, 200)).shape == (1, 10)


def test_a_fixed_size_model_names_the_size_it_takes():
    model = tiny_vit(img_size=224)
    with pytest.raises(ValueError, match=r"input size \(320, 256\) does not match the model's img_size \(224, 224\)"):
        model(torch.randn(1, 3, 320, 256))
