"""A LLaVA-style vision-language model around LumenBridge, trained for one step.

images (any sizes) -> LumenBridge tokens, packed at native resolution
-> a 2-layer MLP projector (LLaVA-1.5's connector)
-> spliced into a causal language model's input embeddings at the image
   placeholder tokens -> next-token loss on the text tokens only
-> one AdamW step through the language model, the projector and the tokenizer.

Everything is built locally from configs; no weights are downloaded.

    python examples/vlm_connector.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from lumenbridge import TokenizerConfig, VisualTokenizer
from lumenbridge.packing import resize_to_token_budget

PAD_ID, BOS_ID, IMAGE_TOKEN_ID = 0, 1, 2  # special ids of this toy vocabulary
IGNORE_INDEX = -100  # label value the loss skips: image and padding positions
MAX_IMAGE_TOKENS = 24


class Projector(nn.Sequential):
    """Linear, GELU, Linear: from the tokenizer's width to the language model's."""

    def __init__(self, vision_dim: int, text_dim: int):
        super().__init__(nn.Linear(vision_dim, text_dim), nn.GELU(), nn.Linear(text_dim, text_dim))


class VisionLanguageModel(nn.Module):
    def __init__(self, vision: VisualTokenizer, language_model: LlamaForCausalLM):
        super().__init__()
        self.vision = vision
        self.projector = Projector(vision.embed_dim, language_model.config.hidden_size)
        self.language_model = language_model

    def forward(self, images: list[torch.Tensor], input_ids, attention_mask, labels):
        """Sample i holds image i: its placeholders take that image's tokens, in order."""
        packed = self.vision.forward_packed(images)
        slots = input_ids == IMAGE_TOKEN_ID
        placeholders, lengths = slots.sum(1).tolist(), packed.cu_seqlens.diff().tolist()
        if placeholders != lengths:  # a count off anywhere would shift every later image's tokens
            raise ValueError(
                f"sample i must hold one placeholder per token of image i: the prompts hold {placeholders} "
                f"placeholders for {len(images)} images of {lengths} tokens"
            )
        image_embeds = self.projector(packed.tokens)  # [sum of N_i, hidden]
        embeds = self.language_model.get_input_embeddings()(input_ids)
        embeds = embeds.masked_scatter(slots[..., None], image_embeds.to(embeds.dtype))
        return self.language_model(inputs_embeds=embeds, attention_mask=attention_mask, labels=labels)


def build_batch(image_lengths: list[int], texts: list[torch.Tensor]):
    """Per sample: BOS, one placeholder per image token, the text; right-padded.
    Labels are the text tokens only."""
    rows = [
        torch.cat((torch.tensor([BOS_ID]), torch.full((n,), IMAGE_TOKEN_ID), text))
        for n, text in zip(image_lengths, texts)
    ]
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), PAD_ID)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX)
    for i, (row, text) in enumerate(zip(rows, texts)):
        input_ids[i, : len(row)] = row
        attention_mask[i, : len(row)] = 1
        labels[i, len(row) - len(text) : len(row)] = text
    return input_ids, attention_mask, labels


def build_model() -> VisionLanguageModel:
    vision = VisualTokenizer(TokenizerConfig.preset("lumenbridge-small"), seed=0)
    text_config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
    )
    return VisionLanguageModel(vision, LlamaForCausalLM(text_config))


@dataclass
class StepResult:
    model: VisionLanguageModel  # after the step, with the step's gradients still on it
    image_tokens: list[int]  # per sample
    loss_before: float
    loss_after: float


def main() -> StepResult:
    torch.manual_seed(0)
    model = build_model().train()
    # Two photos of different shapes, each resized (aspect ratio kept) into the token budget.
    photos = [
        torch.randint(0, 256, (3, 300, 200), dtype=torch.uint8),
        torch.randint(0, 256, (3, 180, 400), dtype=torch.uint8),
    ]
    stride = model.vision.config.total_stride
    images = [resize_to_token_budget(photo, stride, max_tokens=MAX_IMAGE_TOKENS) for photo in photos]
    image_tokens = [math.prod(model.vision.feature_size(*image.shape[1:])) for image in images]
    texts = [torch.randint(3, 128, (n,)) for n in (7, 5)]
    batch = build_batch(image_tokens, texts)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(images, *batch).loss
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        loss_after = model(images, *batch).loss.item()
    print(f"image tokens per sample: {image_tokens}; loss {loss.item():.4f} before the step, {loss_after:.4f} after")
    return StepResult(model, image_tokens, loss.item(), loss_after)


if __name__ == "__main__":
    main()
