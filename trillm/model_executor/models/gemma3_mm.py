"""Gemma 3 with images (``Gemma3ForConditionalGeneration``): a SigLIP vision tower
(``siglip.py``) and Gemma 3's projector in front of the Gemma 3 decoder (``gemma.py``).

An image's pixel values [3, H, W] go through the tower once (``encode_image``); its patch grid
is average-pooled to ``mm_tokens_per_image`` vectors, normed (the soft-embedding norm, Gemma's
``1 + weight`` RMSNorm) and projected to the decoder's width: one row per ``<image_soft_token>``,
written over the placeholders after the embedding scale (transformers scales the token
embeddings, then scatters the image features in unscaled).

Among one image's tokens attention is bidirectional (transformers' ``token_type_ids`` mask):
the runner gives the attention backend each request's image spans (``AttentionMetadata.
bidirectional_spans``) and the scheduler keeps an image's span in one prefill chunk
(``trillm/core/mm_spans.py``).

Checkpoint names: transformers 4's (``language_model.model.*``, ``vision_tower.vision_model.*``)
and 5's (``model.language_model.*``, ``model.vision_tower.*``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from trillm.attention.backend import AttentionBackend, check_backend_supports_bidirectional
from trillm.config import ModelConfig
from trillm.model_executor.models.gemma import Gemma3ForCausalLM, GemmaRMSNorm
from trillm.model_executor.models.llava import _checkpoint_name
from trillm.model_executor.models.multimodal import ImageEmbeddingsMixin
from trillm.model_executor.models.siglip import SiglipVisionTower

# The tower's attention-pooling head: its pooled output is not what Gemma 3 reads
_UNUSED_PREFIX = "vision_tower.head."


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, mm: dict, text_hidden: int) -> None:
        super().__init__()
        vc = mm["vision_config"]
        hidden = int(vc["hidden_size"])
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(hidden, text_hidden))
        self.mm_soft_emb_norm = GemmaRMSNorm(hidden, float(vc.get("layer_norm_eps", 1e-6)))
        self.patches_per_side = int(vc["image_size"]) // int(vc["patch_size"])
        tokens_per_side = int(int(mm.get("mm_tokens_per_image", 256)) ** 0.5)
        self.kernel = self.patches_per_side // tokens_per_side

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, P, C] -> [B, N, H]
        b, _, c = x.shape
        side = self.patches_per_side
        grid = x.transpose(1, 2).reshape(b, c, side, side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        normed = self.mm_soft_emb_norm(pooled)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(x)


class Gemma3ForConditionalGeneration(ImageEmbeddingsMixin, Gemma3ForCausalLM):
    NON_DECODER_PREFIXES = ("vision_tower.", "multi_modal_projector.")
    FIRST_STAGE_MODULES = ("vision_tower", "multi_modal_projector")
    # The runner hands the attention each request's image spans (bidirectional inside)
    bidirectional_image_spans = True

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, device: torch.device | str = "cpu"
    ) -> None:
        check_backend_supports_bidirectional(backend)
        super().__init__(cfg, backend, device)
        mm = cfg.mm_config
        if mm is None:
            raise ValueError("Gemma3ForConditionalGeneration needs its config's vision_config.")
        self.vision_tower = SiglipVisionTower(mm["vision_config"])
        self.multi_modal_projector = Gemma3MultiModalProjector(mm, cfg.hidden_size)

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:  # [3, H, W] -> [N, H_text]
        return self.multi_modal_projector(self.vision_tower(pixels.unsqueeze(0)))[0]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.merge_step_embeddings(super().embed_input_ids(input_ids))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.load_vision_and_text(
            super().load_weights,
            weights,
            self.first_stage_parameters(),
            _checkpoint_name,
            unused=(_UNUSED_PREFIX,),
        )
