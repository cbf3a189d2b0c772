"""Llama 4's vision side as transformers' ``modeling_llama4`` computes it: ``Llama4VisionModel``
(each tile's patches unfolded and embedded by one linear map, a class token appended *after*
them, learned positions, a pre-norm, encoder layers whose attention rotates q/k by a 2D
(column, row) rotary embedding on interleaved pairs, a post-norm, the class token dropped, the
pixel-shuffle adapter MLP) and ``Llama4MultiModalProjector`` (one linear map to the text width).
Checkpoint names are transformers' (``vision_model.*``, ``multi_modal_projector.*``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trillm.model_executor.llama4_vision_config import vision_fields


def _rotary_frequencies(side: int, head_dim: int, theta: float) -> torch.Tensor:
    """[side^2 + 1, head_dim / 2] complex: patch (row y, column x) turns its pair i by
    ``(x + 1) * f_i`` in the first half of the pairs and ``(y + 1) * f_i`` in the second;
    the class token (last) is not turned."""
    half = head_dim // 2
    freqs = 1.0 / theta ** (torch.arange(0, half, 2)[: half // 2].float() / half)  # [D / 4]
    index = torch.arange(side * side)
    x = (index % side + 1).float()[:, None] * freqs  # [P, D / 4]
    y = (index // side + 1).float()[:, None] * freqs
    angles = torch.cat([torch.cat([x, y], dim=-1), torch.zeros(1, half)])  # [P + 1, D / 2]
    return torch.polar(torch.ones_like(angles), angles)


def _rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:  # [B, N, h, D]
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs[None, :, None]).flatten(3).type_as(x)


class Llama4VisionAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.o_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:  # [B, N, C]
        b, n, c = x.shape
        shape = (b, n, self.heads, self.head_dim)
        q = _rotate(self.q_proj(x).view(shape), freqs).transpose(1, 2)  # [B, h, N, D]
        k = _rotate(self.k_proj(x).view(shape), freqs).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.head_dim**-0.5
        out = torch.matmul(F.softmax(scores, dim=-1), v)  # no mask: every patch sees all
        return self.o_proj(out.transpose(1, 2).reshape(b, n, c))


class Llama4VisionMLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, inter)
        self.fc2 = nn.Linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Llama4VisionEncoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, inter: int) -> None:
        super().__init__()
        self.self_attn = Llama4VisionAttention(hidden, heads)
        self.mlp = Llama4VisionMLP(hidden, inter)
        self.input_layernorm = nn.LayerNorm(hidden)
        self.post_attention_layernorm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), freqs)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama4VisionEncoder(nn.Module):
    def __init__(self, count: int, hidden: int, heads: int, inter: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            Llama4VisionEncoderLayer(hidden, heads, inter) for _ in range(count)
        )


class Llama4UnfoldConvolution(nn.Module):
    def __init__(self, channels: int, patch: int, hidden: int) -> None:
        super().__init__()
        self.patch = patch
        self.linear = nn.Linear(channels * patch * patch, hidden, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [B, 3, S, S] -> [B, P, C]
        return self.linear(F.unfold(pixels, self.patch, stride=self.patch).transpose(1, 2))


class Llama4VisionMLP2(nn.Module):
    def __init__(self, inter: int, proj_in: int, proj_out: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(inter, proj_in, bias=False)
        self.fc2 = nn.Linear(proj_out, proj_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc2(F.gelu(self.fc1(x))))


class Llama4VisionPixelShuffleMLP(nn.Module):
    def __init__(self, ratio: float, inter: int, proj_in: int, proj_out: int) -> None:
        super().__init__()
        self.ratio = ratio
        self.mlp = Llama4VisionMLP2(inter, proj_in, proj_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, P, C] -> [B, P * r^2, C / r^2]
        return self.mlp(pixel_shuffle(x, self.ratio))


def pixel_shuffle(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """transformers' pixel shuffle: the patch grid's columns, then (after a transpose) its
    rows, folded into the channels by ``1 / ratio`` each."""
    b, n, c = x.shape
    side = int(n**0.5)
    grid = x.view(b, side, int(side * ratio), int(c / ratio)).permute(0, 2, 1, 3)
    grid = grid.reshape(b, int(side * ratio), int(side * ratio), int(c / ratio**2))
    return grid.permute(0, 2, 1, 3).reshape(b, -1, grid.shape[-1])


class Llama4VisionModel(nn.Module):
    def __init__(self, mm_config: dict) -> None:
        super().__init__()
        f = vision_fields(mm_config)
        hidden, heads, inter = f["hidden_size"], f["num_attention_heads"], f["intermediate_size"]
        side = f["image_size"] // f["patch_size"]
        self.tile = f["image_size"]
        self.patch_embedding = Llama4UnfoldConvolution(f["num_channels"], f["patch_size"], hidden)
        self.class_embedding = nn.Parameter(torch.zeros(hidden))
        self.positional_embedding_vlm = nn.Parameter(torch.zeros(side * side + 1, hidden))
        self.layernorm_pre = nn.LayerNorm(hidden)
        self.layernorm_post = nn.LayerNorm(hidden)
        self.model = Llama4VisionEncoder(f["num_hidden_layers"], hidden, heads, inter)
        self.vision_adapter = Llama4VisionPixelShuffleMLP(
            float(f["pixel_shuffle_ratio"]), inter, f["projector_input_dim"],
            f["projector_output_dim"],
        )  # fmt: skip
        # NOTE: the rotary table is made per call (a few hundred values), not held: the loader
        # builds the model on the meta device and re-allocates what it holds.
        self.rotary = (side, hidden // heads, float(f["rope_theta"]))

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:  # [B, 3, S, S] -> [B, n, out]
        x = self.patch_embedding(tiles.to(self.patch_embedding.linear.weight.dtype))
        cls = self.class_embedding.expand(x.shape[0], 1, -1)
        x = self.layernorm_pre(torch.cat([x, cls], dim=1) + self.positional_embedding_vlm)
        freqs = _rotary_frequencies(*self.rotary).to(x.device)
        for layer in self.model.layers:
            x = layer(x, freqs)
        return self.vision_adapter(self.layernorm_post(x)[:, :-1])


class Llama4MultiModalProjector(nn.Module):
    def __init__(self, vision_out: int, text_hidden: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_out, text_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_1(x)
