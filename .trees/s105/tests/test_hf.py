"""lumenbridge.integrations.hf: the tokenizer as a Hugging Face model, and as
the patch embedding of CLIP and SigLIP vision towers."""

from __future__ import annotations

import dataclasses
import json

import pytest
import safetensors.torch
import torch
from conftest import import_or_skip

from lumenbridge import TokenizerConfig, VisualTokenizer

transformers = import_or_skip("transformers")
from lumenbridge.integrations.hf import (
    LumenBridgeVisionConfig,
    LumenBridgeVisionModel,
    replace_patch_embedding,
)

SMALL = dataclasses.replace(TokenizerConfig(), embed_dim=32, stage_widths=(8, 16, 16, 32))
TOWERS = {
    "clip": (transformers.CLIPVisionConfig, transformers.CLIPVisionModel),
    "siglip": (transformers.SiglipVisionConfig, transformers.SiglipVisionModel),
}


def small_config(**kwargs):
    return LumenBridgeVisionConfig.from_tokenizer_config(SMALL, **kwargs)


def tower(kind, patch_size, image_size=64):
    config_class, model_class = TOWERS[kind]
    config = config_class(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
    )
    return model_class(config)


def embeddings_of(model):
    return getattr(model, "vision_model", model).embeddings


def test_the_model_returns_tokens_as_last_hidden_state():
    model = LumenBridgeVisionModel(small_config()).eval()
    images = torch.randn(2, 3, 64, 48)
    reference = VisualTokenizer(SMALL)
    reference.load_state_dict(model.tokenizer.state_dict())
    with torch.no_grad():
        output = model(pixel_values=images)
        assert isinstance(output, transformers.modeling_outputs.BaseModelOutput)
        assert output.last_hidden_state.shape == (2, 12, 32)
        torch.testing.assert_close(output.last_hidden_state, reference(images), rtol=0, atol=0)


def test_the_config_carries_the_tokenizer_architecture():
    config = small_config()
    assert config.model_type == "lumenbridge"
    assert config.tokenizer_config == SMALL
    assert config.hidden_size == 32 and config.num_channels == 3
    assert LumenBridgeVisionConfig().tokenizer_config == TokenizerConfig.preset("lumenbridge-base")
    with pytest.raises(ValueError, match="kernel_size must be one of"):
        LumenBridgeVisionConfig(kernel_size=4)


def test_transformers_names_are_validated_as_the_fields_they_name():
    """hidden_size is embed_dim: given with the matching widths it builds,
    alone with a width the stages do not end in it is refused at once, and
    given beside embed_dim it must agree."""
    config = LumenBridgeVisionConfig(hidden_size=384, stage_widths=[48, 96, 192, 384])
    assert config.embed_dim == config.hidden_size == 384
    with pytest.raises(ValueError, match=r"the last stage width \(768\) must equal embed_dim \(100\)"):
        LumenBridgeVisionConfig(hidden_size=100)
    with pytest.raises(ValueError, match="hidden_size=384 and embed_dim=768 name one field and disagree"):
        LumenBridgeVisionConfig(hidden_size=384, embed_dim=768)


def test_save_and_load_in_the_hugging_face_layout_through_the_auto_classes(tmp_path):
    model = LumenBridgeVisionModel(small_config()).eval()
    model.save_pretrained(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "lumenbridge" and saved["stage_widths"] == [8, 16, 16, 32]

    assert isinstance(transformers.AutoConfig.from_pretrained(tmp_path), LumenBridgeVisionConfig)
    loaded = transformers.AutoModel.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, LumenBridgeVisionModel)
    assert loaded.config.tokenizer_config == SMALL
    # Normalization buffers are not in the checkpoint: they must be rebuilt, not left empty.
    torch.testing.assert_close(loaded.tokenizer.pixel_mean, model.tokenizer.pixel_mean)
    torch.testing.assert_close(loaded.tokenizer.pixel_std, model.tokenizer.pixel_std)
    images = torch.randint(0, 256, (2, 3, 32, 48), dtype=torch.uint8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(images).last_hidden_state, model(images).last_hidden_state, rtol=0, atol=0)


def test_the_keywords_of_a_vision_tower():
    model = LumenBridgeVisionModel(small_config()).eval()
    images = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        tokens = model(images).last_hidden_state
        output = model(pixel_values=images, output_hidden_states=True, output_attentions=False)
        assert len(output.hidden_states) == 1 and torch.equal(output.hidden_states[0], tokens)
        plain = model(images, return_dict=False)
    assert isinstance(plain, tuple) and torch.equal(plain[0], tokens)


def test_the_config_decides_the_keywords_left_out():
    """As transformers' own models: LLaVA-style models set them on the config."""
    config = small_config()
    config.output_hidden_states, config.return_dict = True, False
    model = LumenBridgeVisionModel(config).eval()
    with torch.no_grad():
        tokens, hidden_states = model(torch.randn(1, 3, 32, 32))
    assert len(hidden_states) == 1 and torch.equal(hidden_states[0], tokens)


def test_a_size_off_the_stride_gets_advice_it_can_follow():
    model = LumenBridgeVisionModel(small_config()).eval()
    with pytest.raises(ValueError, match="not a multiple of the total stride 16; resize the image$"):
        model(torch.randn(1, 3, 40, 32))


def test_a_hugging_face_folder_given_to_visual_tokenizer_says_how_to_load_it(tmp_path):
    LumenBridgeVisionModel(small_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"holds a Hugging Face LumenBridgeVisionModel: .*tokenizer.save_pretrained"):
        VisualTokenizer.from_pretrained(tmp_path)


def test_weights_a_checkpoint_lacks_get_pytorch_initialization(tmp_path):
    """transformers allocates a loaded model's modules uninitialized: a weight
    the checkpoint lacks must still be initialized, not left as garbage."""
    LumenBridgeVisionModel(small_config()).save_pretrained(tmp_path)
    tensors = safetensors.torch.load_file(tmp_path / "model.safetensors")
    tensors = {name: t for name, t in tensors.items() if not name.startswith("tokenizer.token_norm.")}
    safetensors.torch.save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = LumenBridgeVisionModel.from_pretrained(tmp_path)
    assert torch.equal(loaded.tokenizer.token_norm.weight, torch.ones(32))
    assert torch.equal(loaded.tokenizer.token_norm.bias, torch.zeros(32))


def test_a_visual_tokenizer_checkpoint_loads_as_the_hugging_face_model(tmp_path):
    """VisualTokenizer.save_pretrained writes the same two file names; its
    tensors are the HF model's own, without the `tokenizer.` prefix."""
    tokenizer = VisualTokenizer(SMALL, seed=3).eval()
    tokenizer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "lumenbridge"}))
    loaded = LumenBridgeVisionModel.from_pretrained(tmp_path).eval()
    images = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(images).last_hidden_state, tokenizer(images), rtol=0, atol=0)


def test_new_models_keep_pytorch_initialization():
    """Not transformers' generic normal(0, 0.02), which would shrink the signal at every stage."""
    model = LumenBridgeVisionModel(small_config())
    weight = model.tokenizer.stages[1].pw.weight  # 1x1 conv, 8 inputs: kaiming-uniform std is 1/sqrt(3 * 8)
    assert 0.1 < weight.std().item() < 0.3
    assert torch.equal(model.tokenizer.token_norm.weight, torch.ones(32))


def test_auto_classes_know_the_model_type():
    config = transformers.AutoConfig.for_model("lumenbridge", embed_dim=32, stage_widths=[8, 16, 16, 32])
    assert isinstance(transformers.AutoModel.from_config(config), LumenBridgeVisionModel)


@pytest.mark.parametrize("kind, patch_size", [("clip", 16), ("clip", 32), ("siglip", 16), ("siglip", 14)])
def test_replace_patch_embedding_trains_and_keeps_positions_on_the_token_grid(kind, patch_size):
    image_size = 112 if patch_size == 14 else 64  # 112: 8 patches of 14, 7 tokens of 16
    model = tower(kind, patch_size, image_size)
    replace_patch_embedding(model, SMALL)
    embeddings = embeddings_of(model)
    prefix = 1 if kind == "clip" else 0  # CLIP's class token
    grid = image_size // 16
    assert model.config.patch_size == 16 and embeddings.patch_size == 16
    assert embeddings.num_patches == grid * grid
    assert embeddings.position_embedding.weight.shape == (grid * grid + prefix, 32)
    assert embeddings.position_ids.tolist() == [list(range(grid * grid + prefix))]

    output = model(pixel_values=torch.randn(2, 3, image_size, image_size))
    assert output.last_hidden_state.shape == (2, grid * grid + prefix, 32)
    output.pooler_output.square().mean().backward()
    tokenizer = embeddings.patch_embedding.tokenizer
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in tokenizer.parameters())
    assert embeddings.position_embedding.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_replaced_towers_interpolate_positions_for_other_sizes(kind):
    model = replace_patch_embedding(tower(kind, 16), SMALL).eval()
    prefix = 1 if kind == "clip" else 0
    with torch.no_grad():
        output = model(pixel_values=torch.randn(1, 3, 80, 64), interpolate_pos_encoding=True)
    assert output.last_hidden_state.shape == (1, 5 * 4 + prefix, 32)


def test_matching_patch_size_keeps_the_position_embeddings_and_the_tokens_are_the_tokenizers():
    model = tower("clip", 16)
    positions = embeddings_of(model).position_embedding.weight.detach().clone()
    replace_patch_embedding(model, SMALL)
    embeddings = embeddings_of(model)
    assert torch.equal(embeddings.position_embedding.weight, positions)
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = embeddings.patch_embedding.tokenizer(images).flatten(2).transpose(1, 2)
        tokens = embeddings(images)[:, 1:] - embeddings.position_embedding.weight[1:]
    torch.testing.assert_close(tokens, expected)


@pytest.mark.parametrize("kind", ["siglip", "clip"])
def test_resampled_positions_follow_the_old_grid(kind):
    """Channel 0 of each position holds its row and channel 1 its column: resampled
    2 x 2 -> 4 x 4, they still do (no transpose, mirror or shift), and CLIP's
    class-token position stays as it was."""
    model = tower(kind, 32)
    embeddings = embeddings_of(model)
    prefix = embeddings.num_positions - embeddings.num_patches
    with torch.no_grad():
        weight = embeddings.position_embedding.weight
        weight.fill_(0.5)
        weight[prefix:, 0] = torch.tensor([0.0, 0.0, 1.0, 1.0])  # row-major: (0,0) (0,1) (1,0) (1,1)
        weight[prefix:, 1] = torch.tensor([0.0, 1.0, 0.0, 1.0])
        weight[:prefix] = 7.0
    replace_patch_embedding(model, SMALL)
    resampled = embeddings_of(model).position_embedding.weight.detach()
    assert torch.equal(resampled[:prefix], torch.full((prefix, 32), 7.0))
    grid = resampled[prefix:].reshape(4, 4, 32)
    torch.testing.assert_close(grid[..., 2:], torch.full((4, 4, 30), 0.5))
    rows, columns = grid[..., 0], grid[..., 1]
    torch.testing.assert_close(rows, rows[:, :1].expand(4, 4))  # constant along each row
    torch.testing.assert_close(columns, columns[:1].expand(4, 4))
    assert (rows[1:, 0] > rows[:-1, 0]).all() and (columns[0, 1:] > columns[0, :-1]).all()


def test_the_default_tokenizer_matches_the_hidden_size():
    model = replace_patch_embedding(tower("siglip", 16))
    assert embeddings_of(model).patch_embedding.tokenizer.config.stage_widths == (4, 8, 16, 32)


def test_replace_patch_embedding_rejects_what_it_cannot_replace():
    with pytest.raises(TypeError, match="takes a CLIPVisionModel or SiglipVisionModel, got Linear"):
        replace_patch_embedding(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="384-wide tokens but the model needs 32"):
        replace_patch_embedding(tower("clip", 16), "lumenbridge-small")
    with pytest.raises(ValueError, match="image_size 56 is not a multiple of the tokenizer's total stride 16"):
        replace_patch_embedding(tower("clip", 14, image_size=56), SMALL)
    replaced = replace_patch_embedding(tower("clip", 16), SMALL)
    with pytest.raises(TypeError, match="patch embedding is a LumenBridge tokenizer already"):
        replace_patch_embedding(replaced, SMALL)
