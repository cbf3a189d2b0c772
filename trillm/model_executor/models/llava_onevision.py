"""LLaVA-OneVision (``LlavaOnevisionForConditionalGeneration``): a SigLIP tower, LLaVA's MLP
projector and the Qwen2 decoder (``models/qwen2.py``), with any-resolution tiling.

The frontend (``trillm/engine/onevision_inputs.py``) cuts an image into a base tile (the whole
image resized) and the tiles of its best grid pinpoint; the item's data carries them and the
image's (height, width). ``encode_image`` runs every tile through the tower and projector, lays
the grid tiles' features out as one feature map, unpads it to the image's aspect ratio,
shrinks it (bilinear) when it holds more than ``vision_aspect_ratio``'s N tiles' worth, ends
each of its rows with ``image_newline``, and puts the base tile's features first: one row
per placeholder token, as transformers' ``pack_image_features`` packs them. A video's
frames go through the tower and projector as tiles do, then are pooled (``encode_video``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from trillm.attention.backend import AttentionBackend
from trillm.config import ModelConfig
from trillm.model_executor.models.llava import LlavaMultiModalProjector
from trillm.model_executor.models.multimodal import ImageEmbeddingsMixin
from trillm.model_executor.models.qwen2 import Qwen2ForCausalLM
from trillm.model_executor.models.siglip import SiglipVisionTower
from trillm.model_executor.onevision_config import (
    grid_pinpoints,
    max_tiles,
    onevision_field,
)


def best_grid(size: tuple[int, int], pinpoints: list[list[int]], tile: int) -> tuple[int, int]:
    """(rows, columns) of tiles the image of ``size`` (height, width) was cut into."""
    from transformers.image_processing_utils import select_best_resolution

    height, width = select_best_resolution(size, pinpoints)
    return height // tile, width // tile


def unpad(features: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """The feature map [C, h, w] without the rows or columns that cover the padding the image
    (``size``: height, width) got when resized into its grid."""
    height, width = size
    _, rows, cols = features.shape
    if width / height > cols / rows:  # padded above and below
        kept = int(round(height * (cols / width), 7))
        pad = (rows - kept) // 2
        return features[:, pad : rows - pad, :]
    kept = int(round(width * (rows / height), 7))
    pad = (cols - kept) // 2
    return features[:, :, pad : cols - pad]


def _checkpoint_name(name: str) -> str:
    """Either transformers layout's name -> this module's."""
    if name.startswith("model."):
        name = name.removeprefix("model.")
        if name.startswith("language_model."):  # the new layout's decoder: model.language_model.
            return "model." + name.removeprefix("language_model.")
        return name.replace("vision_tower.vision_model.", "vision_tower.", 1)
    if name.startswith("language_model."):  # the hub's layout: language_model.model. / .lm_head
        return name.removeprefix("language_model.")
    return name.replace("vision_tower.vision_model.", "vision_tower.", 1)


class LlavaOnevisionForConditionalGeneration(ImageEmbeddingsMixin, Qwen2ForCausalLM):
    NON_DECODER_PREFIXES = ("vision_tower.", "multi_modal_projector.", "image_newline")
    FIRST_STAGE_MODULES = ("vision_tower", "multi_modal_projector", "image_newline")

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(cfg, backend, device)
        mm = cfg.mm_config
        if mm is None:
            raise ValueError("LlavaOnevisionForConditionalGeneration needs its vision_config.")
        vc = mm["vision_config"]
        layer = onevision_field(mm, "vision_feature_layer")
        self.feature_layers = [int(x) for x in layer] if isinstance(layer, list) else [int(layer)]
        self.vision_tower = SiglipVisionTower(vc)
        self.multi_modal_projector = LlavaMultiModalProjector(
            int(vc["hidden_size"]) * len(self.feature_layers),
            cfg.hidden_size,
            mm.get("projector_hidden_act", "gelu"),
            bool(mm.get("multimodal_projector_bias", True)),
        )
        self.image_newline = nn.Parameter(torch.empty(cfg.hidden_size))
        self.tile = int(vc.get("image_size", 224))
        self.side = self.tile // int(vc.get("patch_size", 16))  # patches a tile side
        self.pinpoints = grid_pinpoints(mm)
        self.max_tiles = max_tiles(mm)

    def tower_states(self, tiles: torch.Tensor) -> torch.Tensor:  # [n, 3, S, S] -> [n, P, C*L]
        """transformers' ``hidden_states[i]`` for each feature layer i (0: the embeddings, i:
        layer i's output, before the post-layernorm), concatenated."""
        layers = self.vision_tower.encoder.layers
        total = len(layers) + 1
        wanted = [w % total for w in self.feature_layers]
        states = [self.vision_tower.embeddings(tiles)]
        for layer in layers[: max(wanted)]:
            states.append(layer(states[-1]))
        return torch.cat([states[i] for i in wanted], dim=-1)

    def encode_image(self, values: torch.Tensor) -> torch.Tensor:  # [n*3*S*S + 2] -> [N, H]
        size = (int(values[-2]), int(values[-1]))  # the image's height, width
        tiles = values[:-2].view(-1, 3, self.tile, self.tile)
        features = self.multi_modal_projector(self.tower_states(tiles))  # [n, P, H]
        return self.pack(features, size)

    def encode_video(self, frames: torch.Tensor) -> torch.Tensor:  # [T, 3, S, S] -> [N, H]
        """transformers' ``get_video_features``: each frame's s x s feature map shrunk to
        ceil(s / 2) a side (bilinear), the frames' rows in order, one ``image_newline`` after
        the last frame (N = T * ceil(s / 2) ** 2 + 1)."""
        features = self.multi_modal_projector(self.tower_states(frames))  # [T, s*s, H]
        fmap = features.view(len(frames), self.side, self.side, -1).permute(0, 3, 1, 2)
        half = [math.ceil(self.side / 2)] * 2
        pooled = F.interpolate(fmap, half, mode="bilinear").permute(0, 2, 3, 1)  # [T, h, h, H]
        newline = self.image_newline.to(features.dtype)
        return torch.cat([pooled.reshape(-1, features.shape[-1]), newline[None]])

    def pack(self, features: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """[n, P, H] tiles' features (the base tile first) -> [N, H] rows in prompt order."""
        base, grid = features[0], features[1:]
        newline = self.image_newline.to(features.dtype)
        if not len(grid):
            return torch.cat([base, newline[None]])
        rows, cols = best_grid(size, self.pinpoints, self.tile)
        s = self.side
        fmap = grid.view(rows, cols, s, s, -1).permute(4, 0, 2, 1, 3)  # [H, rows, s, cols, s]
        fmap = unpad(fmap.flatten(1, 2).flatten(2, 3), size)  # [H, h, w]
        _, height, width = fmap.shape
        ratio = math.sqrt(height * width / (self.max_tiles * s**2))
        if ratio > 1.1:  # more than N tiles' worth: shrunk to about N
            shape = [int(height // ratio), int(width // ratio)]
            fmap = F.interpolate(fmap[None], shape, mode="bilinear")[0]
        ends = newline[:, None, None].expand(-1, fmap.shape[1], 1)
        fmap = torch.cat([fmap, ends], dim=-1)  # each feature row ends with image_newline
        return torch.cat([base, fmap.flatten(1, 2).transpose(0, 1)])

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.merge_step_embeddings(self.model.embed_tokens(input_ids))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        own = self.first_stage_parameters()
        # the tower's attention-pooling head makes the pooled output, which is not read
        unused = ("vision_tower.head.",)
        self.load_vision_and_text(super().load_weights, weights, own, _checkpoint_name, unused)
