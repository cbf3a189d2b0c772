"""LLaVA (``LlavaForConditionalGeneration``): a CLIP vision tower and an MLP projector in front
of the Llama decoder (``models/llama.py``, unchanged).

An image's pixel values [3, H, W] go through the tower once (``encode_image``); the hidden
states of ``vision_feature_layer`` (a list: those layers' concatenated), without the CLS vector
under the "default" strategy, are projected to the decoder's width: one row per placeholder
token. The runner (``trillm/worker/mm_inputs.py``) caches them per item and hands each step the
rows its tokens cover (``set_step_embeddings``); ``embed_input_ids`` writes them over the
placeholders' token embeddings before the first decoder layer, as transformers'
``masked_scatter`` does.

Checkpoint names: both transformers' layouts (``language_model.model.*`` /
``vision_tower.vision_model.*`` and ``model.language_model.*`` / ``model.vision_tower.*``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from trillm.attention.backend import AttentionBackend
from trillm.config import ModelConfig
from trillm.model_executor.models.llama import LlamaForCausalLM
from trillm.model_executor.models.multimodal import ImageEmbeddingsMixin


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}


def activation(name: str, what: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"{what} {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}.")
    return ACTIVATIONS[name]


class CLIPAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, N, C] -> [B, N, C]
        b, n, c = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, heads, N, D]
            return t.view(b, n, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        scores = torch.matmul(q, k.transpose(2, 3)) * self.head_dim**-0.5
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, n, c)
        return self.out_proj(out)


class CLIPMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str) -> None:
        super().__init__()
        self.act = activation(act, "vision hidden_act")
        self.fc1 = nn.Linear(hidden, inter)
        self.fc2 = nn.Linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, vc: dict) -> None:
        super().__init__()
        hidden, eps = int(vc["hidden_size"]), float(vc.get("layer_norm_eps", 1e-5))
        self.self_attn = CLIPAttention(hidden, int(vc["num_attention_heads"]))
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = CLIPMLP(hidden, int(vc["intermediate_size"]), vc.get("hidden_act", "quick_gelu"))
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEmbeddings(nn.Module):
    def __init__(self, vc: dict) -> None:
        super().__init__()
        hidden, patch = int(vc["hidden_size"]), int(vc.get("patch_size", 32))
        self.num_positions = (int(vc.get("image_size", 224)) // patch) ** 2 + 1
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        channels = int(vc.get("num_channels", 3))
        self.patch_embedding = nn.Conv2d(channels, hidden, patch, stride=patch, bias=False)
        self.position_embedding = nn.Embedding(self.num_positions, hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [B, 3, H, W] -> [B, 1 + P, C]
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        if patches.shape[1] + 1 != self.num_positions:
            raise ValueError(
                f"An image of {tuple(pixels.shape[-2:])} pixels makes {patches.shape[1]} "
                f"patches; the vision tower has positions for {self.num_positions - 1}."
            )
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPEncoder(nn.Module):
    def __init__(self, vc: dict) -> None:
        super().__init__()
        count = int(vc["num_hidden_layers"])
        self.layers = nn.ModuleList(CLIPEncoderLayer(vc) for _ in range(count))


class CLIPVisionTower(nn.Module):
    """HF's ``CLIPVisionModel`` up to the hidden states LLaVA reads (no pooled output)."""

    def __init__(self, vc: dict) -> None:
        super().__init__()
        hidden, eps = int(vc["hidden_size"]), float(vc.get("layer_norm_eps", 1e-5))
        self.embeddings = CLIPEmbeddings(vc)
        self.pre_layrnorm = nn.LayerNorm(hidden, eps=eps)
        self.encoder = CLIPEncoder(vc)
        self.post_layernorm = nn.LayerNorm(hidden, eps=eps)  # loaded, unused (pooled output)

    def hidden_states(self, pixels: torch.Tensor, wanted: list[int]) -> list[torch.Tensor]:
        """The hidden states at HF's ``hidden_states`` indices ``wanted`` (0: the embeddings
        after the pre-norm, i: layer i's output; negative from the end)."""
        layers = self.encoder.layers
        total = len(layers) + 1
        index = [w % total for w in wanted]
        states = {0: self.pre_layrnorm(self.embeddings(pixels))}
        x = states[0]
        for i, layer in enumerate(layers[: max(index)], start=1):
            x = layer(x)
            states[i] = x
        return [states[i] for i in index]


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, in_features: int, hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden, bias=bias)
        self.act = activation(act, "projector_hidden_act")
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def _checkpoint_name(name: str) -> str:
    """Either transformers layout's name -> this module's."""
    for prefix in ("model.vision_tower.", "model.multi_modal_projector.", "model.language_model."):
        if name.startswith(prefix):
            name = name.removeprefix("model.")
    if name.startswith("language_model.model."):
        return "model." + name.removeprefix("language_model.model.")
    if name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model.")
    if name.startswith("language_model."):
        return "model." + name.removeprefix("language_model.")
    return name.replace("vision_tower.vision_model.", "vision_tower.", 1)


class LlavaForConditionalGeneration(ImageEmbeddingsMixin, LlamaForCausalLM):
    NON_DECODER_PREFIXES = ("vision_tower.", "multi_modal_projector.")
    FIRST_STAGE_MODULES = ("vision_tower", "multi_modal_projector")

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(cfg, backend, device)
        mm = cfg.mm_config
        if mm is None:
            raise ValueError("LlavaForConditionalGeneration needs its config's vision_config.")
        vc = mm["vision_config"]
        layer = mm.get("vision_feature_layer", -2)
        self.feature_layers = [int(x) for x in layer] if isinstance(layer, list) else [int(layer)]
        self.drop_cls = mm.get("vision_feature_select_strategy", "default") == "default"
        self.vision_tower = CLIPVisionTower(vc)
        self.multi_modal_projector = LlavaMultiModalProjector(
            int(vc["hidden_size"]) * len(self.feature_layers),
            cfg.hidden_size,
            mm.get("projector_hidden_act", "gelu"),
            bool(mm.get("multimodal_projector_bias", True)),
        )

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:  # [3, H, W] -> [N, H_text]
        states = self.vision_tower.hidden_states(pixels.unsqueeze(0), self.feature_layers)
        if self.drop_cls:
            states = [s[:, 1:] for s in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))[0]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.merge_step_embeddings(self.model.embed_tokens(input_ids))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        own = self.first_stage_parameters()
        self.load_vision_and_text(super().load_weights, weights, own, _checkpoint_name)
