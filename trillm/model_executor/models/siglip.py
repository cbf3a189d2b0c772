"""The SigLIP vision tower (transformers' ``SiglipVisionModel`` up to ``last_hidden_state``),
as Gemma 3 reads it: patches by a biased convolution, learned positions (no CLS vector), the
CLIP encoder layer (``llava.py``), the post-layernorm. The attention-pooling head
(``vision_use_head``) makes the pooled output, which Gemma 3 does not read: its weights are
skipped."""

from __future__ import annotations

import torch
from torch import nn

from trillm.model_executor.models.llava import CLIPEncoder

_SIGLIP_DEFAULTS = {"hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}


class SiglipEmbeddings(nn.Module):
    def __init__(self, vc: dict) -> None:
        super().__init__()
        hidden, patch = int(vc["hidden_size"]), int(vc.get("patch_size", 16))
        self.image_size = int(vc.get("image_size", 224))
        self.num_patches = (self.image_size // patch) ** 2
        channels = int(vc.get("num_channels", 3))
        self.patch_embedding = nn.Conv2d(channels, hidden, patch, stride=patch)
        self.position_embedding = nn.Embedding(self.num_patches, hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [B, 3, H, W] -> [B, P, C]
        if tuple(pixels.shape[-2:]) != (self.image_size, self.image_size):
            raise ValueError(
                f"An image of {tuple(pixels.shape[-2:])} pixels; the vision tower takes "
                f"{self.image_size}x{self.image_size}."
            )
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipVisionTower(nn.Module):
    def __init__(self, vc: dict) -> None:
        super().__init__()
        vc = {**_SIGLIP_DEFAULTS, **vc}  # SigLIP's defaults, not CLIP's
        self.embeddings = SiglipEmbeddings(vc)
        self.encoder = CLIPEncoder(vc)
        eps = float(vc["layer_norm_eps"])
        self.post_layernorm = nn.LayerNorm(int(vc["hidden_size"]), eps=eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [B, 3, H, W] -> [B, P, C]
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
