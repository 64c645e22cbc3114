"""Smoke check of the timm and Hugging Face integrations on this machine's best
device (CUDA if there is one): prints the versions, then OK or the error for each.

    python scripts/check_integrations.py            # exits 1 if any check fails
"""

from __future__ import annotations

import sys
import tempfile
import traceback

import timm
import torch
import transformers

import lumenbridge
from lumenbridge.integrations.hf import LumenBridgeVisionConfig, LumenBridgeVisionModel, replace_patch_embedding
from lumenbridge.integrations.timm import PatchEmbed


def check_timm(device: torch.device) -> None:
    model = timm.create_model("vit_small_patch16_224", embed_layer=PatchEmbed, pretrained=False, dynamic_img_size=True)
    model = model.to(device)
    for size in ((224, 224), (320, 256)):
        logits = model(torch.randn(2, 3, *size, device=device))
        logits.square().mean().backward()
        assert logits.shape == (2, 1000), logits.shape
    assert all(p.grad is not None for p in model.patch_embed.parameters())


def check_hf_model(device: torch.device) -> None:
    config = LumenBridgeVisionConfig.from_tokenizer_config(lumenbridge.TokenizerConfig.preset("lumenbridge-small"))
    model = LumenBridgeVisionModel(config).to(device).eval()
    images = torch.randn(2, 3, 224, 320, device=device)
    with tempfile.TemporaryDirectory() as directory, torch.no_grad():
        model.save_pretrained(directory)
        loaded = transformers.AutoModel.from_pretrained(directory).to(device).eval()
        expected = model(images).last_hidden_state
        assert expected.shape == (2, 14 * 20, 384), expected.shape
        torch.testing.assert_close(loaded(images).last_hidden_state, expected)


def check_hf_towers(device: torch.device) -> None:
    for config_class, model_class in (
        (transformers.CLIPVisionConfig, transformers.CLIPVisionModel),
        (transformers.SiglipVisionConfig, transformers.SiglipVisionModel),
    ):
        config = config_class(hidden_size=384, intermediate_size=768, num_hidden_layers=2, num_attention_heads=6)
        model = replace_patch_embedding(model_class(config), "lumenbridge-small").to(device)
        output = model(pixel_values=torch.randn(2, 3, config.image_size, config.image_size, device=device))
        output.pooler_output.square().mean().backward()


def check_packed(device: torch.device) -> None:
    model = lumenbridge.VisualTokenizer(lumenbridge.TokenizerConfig.preset("lumenbridge-small"), seed=0).to(device)
    images = [torch.randn(3, h, w, device=device) for h, w in ((224, 320), (160, 160), (224, 320))]
    with torch.no_grad():
        packed = model.forward_packed(images)
        torch.testing.assert_close(packed.unpack()[1], model(images[1][None])[0], rtol=1e-4, atol=1e-4)
    assert packed.cu_seqlens.tolist() == [0, 280, 380, 660], packed.cu_seqlens


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"lumenbridge {lumenbridge.__version__}, torch {torch.__version__}, timm {timm.__version__}, ", end="")
    print(f"transformers {transformers.__version__}; device {device} ({name})")
    failed = 0
    for check in (check_timm, check_hf_model, check_hf_towers, check_packed):
        try:
            check(device)
            print(f"OK    {check.__name__}")
        except Exception:  # noqa: BLE001 - report every check, then fail at the end
            failed += 1
            print(f"FAIL  {check.__name__}")
            traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
