"""Qwen2-VL and Qwen2.5-VL (``Qwen2VLForConditionalGeneration``,
``Qwen2_5_VLForConditionalGeneration``): a vision tower (``qwen2_vl_vision.py``) in front of
the Qwen2 decoder, whose rotary embedding is M-RoPE (``layers/mrope.py``).

An image's patches [t, h, w, patch_dim] go through the tower once (``encode_image``; a
video's, t > 1, likewise: ``encode_video``): one row per placeholder token (``<|image_pad|>``,
``<|video_pad|>``), written over the placeholders' token embeddings as
LLaVA's are (``trillm/worker/mm_inputs.py`` hands each step its rows). The runner gives the
decoder [3, T] positions (``MultiModalInputs.rope_positions``): an image's tokens at (time,
row, column) of its merged grid, the text after it continuing from the largest + 1.

Checkpoint names: ``model.*`` + ``visual.*`` (hub folders) and ``model.language_model.*`` +
``model.visual.*`` (transformers 5's own layout).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from trillm.attention.backend import AttentionBackend
from trillm.config import ModelConfig
from trillm.model_executor.layers.mrope import MRotaryEmbedding
from trillm.model_executor.models.multimodal import ImageEmbeddingsMixin
from trillm.model_executor.models.qwen2 import Qwen2ForCausalLM
from trillm.model_executor.models.qwen2_vl_vision import Qwen2VisionTower, Qwen25VisionTower


def _checkpoint_name(name: str) -> str:
    """Either layout's name -> this module's."""
    if name.startswith("model.visual."):
        return name.removeprefix("model.")
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    return name


class Qwen2VLForConditionalGeneration(ImageEmbeddingsMixin, Qwen2ForCausalLM):
    NON_DECODER_PREFIXES = ("visual.",)
    FIRST_STAGE_MODULES = ("visual",)
    TOWER: type[Qwen2VisionTower] = Qwen2VisionTower

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(cfg, backend, device)
        mm = cfg.mm_config
        if mm is None:
            raise ValueError(f"{type(self).__name__} needs its config's vision_config.")
        self.visual = self.TOWER(mm["vision_config"])
        # The multimodal inputs' M-RoPE grid: an image's rows, columns per token (merged)
        self.mrope_merge_size = self.visual.merge
        section = cfg.hf_config["rope_parameters"]["mrope_section"]
        self.rotary = MRotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, list(section), cfg.max_model_len, device
        )

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:  # [t, h, w, P] -> [N, H]
        if pixels.dim() != 4 or pixels.shape[-1] != self.visual.patch_embed.patch_dim:
            raise ValueError(
                f"The image's patches have shape {tuple(pixels.shape)}; the vision tower takes "
                f"[t, h, w, {self.visual.patch_embed.patch_dim}]."
            )
        return self.visual(pixels)

    def encode_video(self, pixels: torch.Tensor) -> torch.Tensor:  # [t, h, w, P] -> [N, H]
        """A video's temporal patches (``temporal_patch_size`` frames each) through the tower:
        an image is a video of one temporal patch."""
        return self.encode_image(pixels)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.merge_step_embeddings(self.model.embed_tokens(input_ids))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.load_vision_and_text(
            super().load_weights,
            weights,
            self.first_stage_parameters(),
            _checkpoint_name,
            drop_position_ids=False,
        )


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):  # noqa: N801 (HF's)
    TOWER = Qwen25VisionTower
