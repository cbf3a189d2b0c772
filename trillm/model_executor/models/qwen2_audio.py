"""Qwen2-Audio (``Qwen2AudioForConditionalGeneration``): a Whisper-style audio encoder and a
linear projector in front of the Qwen2 decoder (``models/qwen2.py``, unchanged).

An audio item is its log-mel features [mel, L + 2]: the clip's L frames and the two frames
after them (the feature extractor's padding, or zeros past its window), which the two
convolutions read at the clip's edge. transformers runs the encoder over the whole padded
window with the padding's keys masked; the rows it keeps depend on nothing past frame L + 1,
so the encoder here runs over the clip alone (``encode_audio``): conv1 + GELU, conv2 (stride
2) + GELU, the first F = (L - 1) // 2 + 1 positions plus their position embeddings,
bidirectional pre-norm layers, average pooling by 2, the final LayerNorm, the projector: one
row per ``<|AUDIO|>`` token, (F - 2) // 2 + 1 of them, written over the placeholders' token
embeddings (``trillm/worker/mm_inputs.py``).

Checkpoint names: the hub's (``audio_tower.*``, ``language_model.model.*``) and transformers
5's (``model.audio_tower.*``, ``model.language_model.*``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from trillm.attention.backend import AttentionBackend
from trillm.config import ModelConfig
from trillm.model_executor.models.llava import _checkpoint_name as _llava_name
from trillm.model_executor.models.llava import activation
from trillm.model_executor.models.multimodal import ImageEmbeddingsMixin
from trillm.model_executor.models.qwen2 import Qwen2ForCausalLM
from trillm.model_executor.qwen2_audio_config import (
    CONTEXT_FRAMES,
    audio_positions,
    audio_tokens,
)


class AudioAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, C] -> [N, C]
        n, c = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # [heads, N, D]
            return t.view(n, self.heads, self.head_dim).transpose(0, 1)

        q = heads(self.q_proj(x) * self.head_dim**-0.5)  # scaled first, as transformers
        k, v = heads(self.k_proj(x)), heads(self.v_proj(x))
        probs = F.softmax(torch.matmul(q, k.transpose(1, 2)), dim=-1)
        return self.out_proj(torch.matmul(probs, v).transpose(0, 1).reshape(n, c))


class AudioEncoderLayer(nn.Module):
    def __init__(self, ac: dict) -> None:
        super().__init__()
        hidden = int(ac["d_model"])
        self.self_attn = AudioAttention(hidden, int(ac["encoder_attention_heads"]))
        self.self_attn_layer_norm = nn.LayerNorm(hidden)
        self.act = activation(ac.get("activation_function", "gelu"), "audio activation_function")
        self.fc1 = nn.Linear(hidden, int(ac["encoder_ffn_dim"]))
        self.fc2 = nn.Linear(int(ac["encoder_ffn_dim"]), hidden)
        self.final_layer_norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class Qwen2AudioEncoder(nn.Module):
    """transformers' ``Qwen2AudioEncoder`` over one clip's frames."""

    def __init__(self, ac: dict) -> None:
        super().__init__()
        mels, hidden = int(ac["num_mel_bins"]), int(ac["d_model"])
        self.num_mel_bins = mels
        self.conv1 = nn.Conv1d(mels, hidden, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(hidden, hidden, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(int(ac["max_source_positions"]), hidden)
        self.layers = nn.ModuleList(AudioEncoderLayer(ac) for _ in range(int(ac["encoder_layers"])))
        self.layer_norm = nn.LayerNorm(hidden)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [mel, L + 2] -> [N, C]
        frames = features.shape[1] - CONTEXT_FRAMES
        positions = audio_positions(frames)
        x = F.gelu(self.conv1(features.to(self.conv1.weight.dtype)))
        x = F.gelu(self.conv2(x))[:, :positions].transpose(0, 1)  # [F, C]
        x = x + self.embed_positions.weight[:positions]
        for layer in self.layers:
            x = layer(x)
        pooled = F.avg_pool1d(x.transpose(0, 1), 2, 2).transpose(0, 1)  # [F // 2, C]
        return self.layer_norm(pooled)


class Qwen2AudioProjector(nn.Module):
    def __init__(self, audio_hidden: int, text_hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(audio_hidden, text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, C] -> [N, H]
        return self.linear(x)


def _checkpoint_name(name: str) -> str:
    """Either layout's name -> this module's."""
    if name.startswith("model.audio_tower."):
        return name.removeprefix("model.")
    return _llava_name(name)


class Qwen2AudioForConditionalGeneration(ImageEmbeddingsMixin, Qwen2ForCausalLM):
    NON_DECODER_PREFIXES = ("audio_tower.", "multi_modal_projector.")
    FIRST_STAGE_MODULES = ("audio_tower", "multi_modal_projector")

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(cfg, backend, device)
        mm = cfg.mm_config
        if mm is None:
            raise ValueError("Qwen2AudioForConditionalGeneration needs its config's audio_config.")
        ac = mm["audio_config"]
        self.audio_tower = Qwen2AudioEncoder(ac)
        self.multi_modal_projector = Qwen2AudioProjector(int(ac["d_model"]), cfg.hidden_size)

    def encode_audio(self, features: torch.Tensor) -> torch.Tensor:  # [mel, L+2] -> [N, H]
        mels, frames = self.audio_tower.num_mel_bins, features.shape[-1] - CONTEXT_FRAMES
        if features.dim() != 2 or features.shape[0] != mels or audio_tokens(frames) < 1:
            raise ValueError(
                f"The audio's features have shape {tuple(features.shape)}; the encoder takes "
                f"[{mels}, frames + {CONTEXT_FRAMES}] with at least 3 frames."
            )
        return self.multi_modal_projector(self.audio_tower(features))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.merge_step_embeddings(self.model.embed_tokens(input_ids))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        own = self.first_stage_parameters()  # none on a later pipeline stage
        self.load_vision_and_text(super().load_weights, weights, own, _checkpoint_name)
