"""The Qwen2-VL and Qwen2.5-VL vision towers (transformers' ``Qwen2VisionTransformerPretrainedModel``
and ``Qwen2_5_VisionTransformerPretrainedModel``), one image at a time.

An image arrives as the image processor made it: [t, h, w, C * temporal_patch * patch * patch],
its patches in merge-block order (each ``merge x merge`` block of neighbouring patches
consecutive). A Conv3d embeds each patch; the blocks attend with a 2-D rotary embedding (the
patch's row rotates the first half of each head's frequencies, its column the second); the
merger concatenates each block's ``merge**2`` vectors and projects them to the decoder's width:
one row per placeholder token. Attention spans one frame (Qwen2-VL), or in Qwen2.5-VL a window
of ``window_size`` pixels in the blocks not in ``fullatt_block_indexes`` (the patches put in
window order first, the rows put back after the merger). Qwen2.5-VL also uses RMSNorm and a
SwiGLU MLP.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trillm.model_executor.models.llava import activation


class VisionRMSNorm(nn.Module):
    """transformers' ``Qwen2_5_VLRMSNorm``: normalised in float32, weighted in the input dtype."""

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated by cos/sin [N, D], in float32 as transformers does."""
    xf = x.float()
    return (xf * cos[:, None] + _rotate_half(xf) * sin[:, None]).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self,
        x: torch.Tensor,  # [N, C]
        rotary: tuple[torch.Tensor, torch.Tensor],  # cos, sin [N, D]
        spans: list[int],  # lengths of the runs of rows that attend among themselves
    ) -> torch.Tensor:  # [N, C]
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, -1).unbind(1)  # [N, heads, D] each
        q, k = _rotate(q, *rotary), _rotate(k, *rotary)
        outs = []
        for qs, ks, vs in zip(q.split(spans), k.split(spans), v.split(spans), strict=True):
            # [1, heads, n_i, D]: every row of a span sees the whole span (no causal mask)
            heads = [t.transpose(0, 1).unsqueeze(0) for t in (qs, ks, vs)]
            outs.append(F.scaled_dot_product_attention(*heads)[0].transpose(0, 1))
        return self.proj(torch.cat(outs).reshape(n, -1))


class VisionMLP(nn.Module):
    """Qwen2-VL: fc1 -> act -> fc2."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = activation(act, "vision_config hidden_act")
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionGatedMLP(nn.Module):
    """Qwen2.5-VL: down(act(gate(x)) * up(x)), each with a bias."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = activation(act, "vision_config hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, norm: type[nn.Module], mlp: nn.Module) -> None:
        super().__init__()
        self.norm1 = norm(dim, eps=1e-6)
        self.norm2 = norm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, heads)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], spans: list[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rotary, spans)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, dim: int, merge: int, norm: type[nn.Module]) -> None:
        super().__init__()
        self.width = dim * merge**2
        self.ln_q = norm(dim, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, C] -> [N / merge**2, out_dim]
        return self.mlp(self.ln_q(x).view(-1, self.width))


class PatchEmbed(nn.Module):
    def __init__(self, vc: dict[str, Any], dim: int) -> None:
        super().__init__()
        self.channels = int(vc.get("in_channels", 3))
        self.patch = int(vc.get("patch_size", 14))
        self.temporal = int(vc.get("temporal_patch_size", 2))
        kernel = (self.temporal, self.patch, self.patch)
        self.proj = nn.Conv3d(self.channels, dim, kernel, stride=kernel, bias=False)

    @property
    def patch_dim(self) -> int:
        return self.channels * self.temporal * self.patch**2

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # [N, patch_dim] -> [N, C]
        x = patches.view(-1, self.channels, self.temporal, self.patch, self.patch)
        return self.proj(x.to(self.proj.weight.dtype)).flatten(1)


def _block_order(h: int, w: int, merge: int) -> torch.Tensor:  # [h * w, 2]: (row, column)
    """Each patch's grid coordinates in the processor's merge-block order."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    return torch.stack(
        [t.reshape(shape).transpose(1, 2).flatten() for t in (rows, cols)], dim=-1
    )  # fmt: skip


def _window_order(h: int, w: int, merge: int, side: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows over one frame's merged grid: (the merged rows in window order,
    each window's length in patches). ``side``: merged rows per window side."""
    gh, gw = h // merge, w // merge
    index = torch.arange(gh * gw).view(gh, gw)
    order, spans = [], []
    for top in range(0, gh, side):
        for left in range(0, gw, side):
            window = index[top : top + side, left : left + side].flatten()
            order.append(window)
            spans.append(len(window) * merge**2)
    return torch.cat(order), spans


class Qwen2VisionTower(nn.Module):
    """Qwen2-VL's tower; ``Qwen25VisionTower`` changes the norm, MLP and attention spans."""

    GATED = False

    def __init__(self, vc: dict[str, Any]) -> None:
        super().__init__()
        dim = self.dim(vc)
        # transformers' attribute_map: num_attention_heads / num_hidden_layers name these too
        self.heads = int(vc.get("num_heads", vc.get("num_attention_heads", 16)))
        self.merge = int(vc.get("spatial_merge_size", 2))
        theta = float((vc.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        # NOTE: on the CPU, not the meta device the loader builds the model on
        quarter = torch.arange(0, dim // self.heads // 2, 2, dtype=torch.float, device="cpu")
        self.inv_freq = 1.0 / (theta ** (quarter / (dim // self.heads // 2)))  # [D / 4]
        self.patch_embed = PatchEmbed(vc, dim)
        norm = VisionRMSNorm if self.GATED else nn.LayerNorm
        self.blocks = nn.ModuleList(
            VisionBlock(dim, self.heads, norm, self.mlp(vc, dim))
            for _ in range(int(vc.get("depth", vc.get("num_hidden_layers", 32))))
        )
        self.merger = PatchMerger(self.out_dim(vc), dim, self.merge, norm)

    @staticmethod
    def dim(vc: dict[str, Any]) -> int:
        return int(vc.get("embed_dim", 1280))

    @staticmethod
    def out_dim(vc: dict[str, Any]) -> int:
        return int(vc.get("hidden_size", 3584))

    @staticmethod
    def mlp(vc: dict[str, Any], dim: int) -> nn.Module:
        hidden = int(dim * float(vc.get("mlp_ratio", 4)))
        return VisionMLP(dim, hidden, vc.get("hidden_act", "quick_gelu"))

    def rotary(
        self, h: int, w: int, t: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [t * h * w, D]: (row, column) frequencies, twice (the rotate-half pairs)."""
        coords = _block_order(h, w, self.merge).repeat(t, 1)  # [N, 2]
        freqs = (coords[..., None].float() * self.inv_freq).flatten(1)  # [N, D / 2]: h | w
        freqs = torch.cat([freqs, freqs], dim=-1).to(device)
        return freqs.cos(), freqs.sin()

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [t, h, w, P] -> [t*h*w/m², out]
        t, h, w, _ = pixels.shape
        x = self.patch_embed(pixels.reshape(t * h * w, -1))
        rotary = self.rotary(h, w, t, x.device)
        for block in self.blocks:
            x = block(x, rotary, [h * w] * t)  # each frame attends within itself
        return self.merger(x)


class Qwen25VisionTower(Qwen2VisionTower):
    GATED = True

    def __init__(self, vc: dict[str, Any]) -> None:
        super().__init__(vc)
        patch = int(vc.get("patch_size", 14))
        self.window_side = int(vc.get("window_size", 112)) // self.merge // patch
        if self.window_side < 1:
            raise ValueError(
                f"vision_config window_size {vc.get('window_size')} is smaller than a merged "
                f"patch ({self.merge * patch} pixels)."
            )
        self.full_blocks = {int(i) for i in vc.get("fullatt_block_indexes", ())}

    @staticmethod
    def dim(vc: dict[str, Any]) -> int:
        return int(vc.get("hidden_size", 1280))

    @staticmethod
    def out_dim(vc: dict[str, Any]) -> int:
        return int(vc.get("out_hidden_size", 3584))

    @staticmethod
    def mlp(vc: dict[str, Any], dim: int) -> nn.Module:
        return VisionGatedMLP(
            dim, int(vc.get("intermediate_size", 3420)), vc.get("hidden_act", "silu")
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        t, h, w, _ = pixels.shape
        unit = self.merge**2
        frame, windows = _window_order(h, w, self.merge, self.window_side)
        merged = h * w // unit
        order = torch.cat([frame + i * merged for i in range(t)])  # merged rows, window order
        rows = (order[:, None] * unit + torch.arange(unit)).flatten()  # the patches, the same
        x = self.patch_embed(pixels.reshape(t * h * w, -1))[rows.to(pixels.device)]
        cos, sin = self.rotary(h, w, t, x.device)
        rotary = (cos[rows.to(cos.device)], sin[rows.to(sin.device)])
        for i, block in enumerate(self.blocks):
            spans = [h * w] * t if i in self.full_blocks else windows * t
            x = block(x, rotary, spans)
        return self.merger(x)[torch.argsort(order).to(x.device)]
