"""Llama 4 text (``Llama4ForCausalLM``): the Llama decoder with Llama 4's attention and
mixture of experts, as transformers' ``modeling_llama4`` computes them.

- Attention, per layer as config.json says (``llama4_config.prepare`` fills the lists):
  RoPE layers (``no_rope_layers[i] == 1``) rotate q/k and then, with ``use_qk_norm``, divide
  each head by its RMS (no weight); NoPE layers do neither and, with
  ``attn_temperature_tuning``, scale each query by ``1 + attn_scale * log1p(floor((p + 1) /
  floor_scale))`` at its position p. Layers ``layer_types`` calls ``chunked_attention`` see
  only the keys of their own ``attention_chunk_size``-sized chunk of the sequence (by absolute
  position, so prefill chunks, preemption and prefix-cache hits do not move the boundary);
  only the torch backend's gather path masks that, so another backend is refused when the
  model is built.
- transformers rotates interleaved pairs ``(x0, x1), (x2, x3) ...`` (a complex product); the
  loader reorders each head's q/k rows to ``[even dims; odd dims]`` so that the usual
  half-split rotation does the same. Scores are sums over a head's dims, and the qk norm is
  over the whole head, so the reordering changes neither (on NoPE layers too).
- Feed-forward: a mixture of experts on ``moe_layers`` (a shared expert of
  ``intermediate_size`` plus routed experts: the router's top-k logits through a sigmoid
  scale the *input* of their expert), else a dense MLP of ``intermediate_size_mlp``.

Tensor parallelism splits heads and every MLP's intermediate size as for Llama, and each
expert's (``sharding.py``), the router replicated; pipeline parallelism splits the layers.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from trillm.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    UnsupportedAttentionFeatureError,
)
from trillm.attention.torch_backend import TorchAttentionBackend
from trillm.config import ModelConfig
from trillm.distributed.pipeline import is_missing
from trillm.model_executor.layers.fused_moe import FusedMoE
from trillm.model_executor.layers.norm import RMSNorm
from trillm.model_executor.layers.rotary import RotaryEmbedding
from trillm.model_executor.llama4_config import ARCHITECTURE, CHUNKED, CONDITIONAL
from trillm.model_executor.llama4_vision_config import vision_fields
from trillm.model_executor.models.llama import (
    DecoderStack,
    FoldedResidualLayer,
    LlamaAttention,
    LlamaDecoderFlags,
    LlamaForCausalLM,
    LlamaMLP,
    rank_shapes,
)
from trillm.model_executor.models.llama4_vision import (
    Llama4MultiModalProjector,
    Llama4VisionModel,
)
from trillm.model_executor.models.moe import check_experts_loaded, refuse_quantized_experts
from trillm.model_executor.models.multimodal import ImageEmbeddingsMixin
from trillm.model_executor.models.stacked_weights import MissingWeightsError

_QK = re.compile(r"\.self_attn\.[qk]_proj\.(weight|bias)$")
_VISION_PREFIXES = ("vision_model.", "multi_modal_projector.")
_EXPERTS = re.compile(r"^(model\.layers\.\d+\.feed_forward\.experts)\.(gate_up_proj|down_proj)$")


class Llama4Attention(LlamaAttention):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        flags: LlamaDecoderFlags,
        layer: int,
    ) -> None:
        super().__init__(cfg, backend, flags)
        hf = cfg.hf_config
        self.use_rope = bool(hf["no_rope_layers"][layer])
        self.l2_norm = self.use_rope and bool(hf["use_qk_norm"])
        self.temperature_tuning = not self.use_rope and bool(hf["attn_temperature_tuning"])
        self.floor_scale, self.attn_scale = float(hf["floor_scale"]), float(hf["attn_scale"])
        self.eps = cfg.rms_norm_eps
        self.chunk = (
            int(hf["attention_chunk_size"]) if hf["layer_types"][layer] == CHUNKED else None
        )
        self.torch_backend: TorchAttentionBackend | None = None
        if self.chunk is not None:
            self.torch_backend = _chunking_backend(backend)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        q, k, v = self.project_qkv(hidden)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        if self.use_rope:
            rotary(positions, q, k)  # in place: q and k are views of the qkv buffer
        if self.l2_norm:
            q, k = self._rms(q), self._rms(k)
        if self.temperature_tuning:
            q = (q * self._temperature(positions)[:, None, None]).to(q.dtype)
        if self.torch_backend is not None:
            out = self.torch_backend.forward(q, k, v, kv_cache, meta, self.scale, chunk=self.chunk)
        else:
            out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)  # [T, Hq, D]
        return self.project_out(out)

    def _rms(self, x: torch.Tensor) -> torch.Tensor:  # [T, h, D], each head over its RMS
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _temperature(self, positions: torch.Tensor) -> torch.Tensor:  # [T] -> [T] float32
        steps = torch.floor((positions.float() + 1.0) / self.floor_scale)
        return torch.log1p(steps) * self.attn_scale + 1.0


def _chunking_backend(backend: AttentionBackend) -> TorchAttentionBackend:
    """The backend, when it masks chunked local attention; refused by name otherwise."""
    if not isinstance(backend, TorchAttentionBackend):
        raise UnsupportedAttentionFeatureError(
            f"The {backend.name} attention backend does not implement chunked local attention "
            f"(attention_chunk_size), which this {ARCHITECTURE} model uses; use "
            "--attention-backend torch."
        )
    return backend


class Llama4MoE(nn.Module):
    """HF's ``feed_forward``: ``router`` [E, H], ``experts`` and ``shared_expert``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hf = cfg.hf_config
        experts, self.top_k = int(hf["num_local_experts"]), int(hf["num_experts_per_tok"])
        self.router = nn.Linear(cfg.hidden_size, experts, bias=False)  # replicated
        # Tensor parallelism: every rank holds every expert's share of its I (sharding.py).
        self.tp, shapes = rank_shapes(cfg)
        self.experts = FusedMoE(experts, self.top_k, cfg.hidden_size, shapes.inter_size, False)
        self.shared_expert = LlamaMLP(cfg, bias=False)  # all-reduced inside

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)  # [T, k] each
        scores = torch.sigmoid(top.float()).to(x.dtype)  # [T, k]
        ones = torch.ones_like(scores[:, :1], dtype=torch.float32)  # [T, 1]
        routed = torch.zeros_like(x)
        # NOTE: the score scales the expert's input, not its output: one expert at a time.
        for slot in range(self.top_k):
            routed = routed + self.experts.run(x * scores[:, slot, None], ones, ids[:, slot, None])
        return self.shared_expert(x) + self.tp.all_reduce(routed)  # the ranks' partial sums


class Llama4DecoderLayer(FoldedResidualLayer):
    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, flags: LlamaDecoderFlags, layer: int
    ) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.self_attn = Llama4Attention(cfg, backend, flags, layer)
        self.feed_forward: nn.Module
        if layer in hf["moe_layers"]:
            self.feed_forward = Llama4MoE(cfg)
        else:
            dense = dataclasses.replace(cfg, intermediate_size=int(hf["intermediate_size_mlp"]))
            self.feed_forward = LlamaMLP(dense, bias=False)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def feed(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(hidden)


class Llama4Model(DecoderStack):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, flags: LlamaDecoderFlags):
        super().__init__()
        layers = (Llama4DecoderLayer(cfg, backend, flags, i) for i in range(cfg.num_hidden_layers))
        self.assemble(cfg, layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))


class Llama4ForCausalLM(LlamaForCausalLM):
    MODEL_CLASS = Llama4Model

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, device: torch.device | str = "cpu"
    ) -> None:
        refuse_quantized_experts(cfg, f"{ARCHITECTURE}'s experts")
        super().__init__(cfg, backend, device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._route_experts(weights))
        check_experts_loaded(self)

    def _route_experts(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Loads the experts' ``[E, in, out]`` tensors into their FusedMoE (``[E, out, in]``);
        yields every other tensor, q/k rows reordered for the half-split rotation."""
        for name, tensor in weights:
            if self.pp.num_stages > 1 and is_missing(self, name):
                continue  # another pipeline stage's
            if match := _EXPERTS.match(name):
                experts = self.get_submodule(match.group(1))
                if not isinstance(experts, FusedMoE):
                    raise MissingWeightsError(f"Checkpoint has experts at {name!r}, a dense layer.")
                experts.load_fused(match.group(2), tensor.transpose(1, 2))
            elif _QK.search(name):
                yield name, self._deinterleave(tensor)
            else:
                yield name, tensor

    def _deinterleave(self, rows: torch.Tensor) -> torch.Tensor:  # [heads * D, ...]
        """Each head's dims ``0, 2, 4, ... 1, 3, 5, ...``: the interleaved pair ``(2i, 2i + 1)``
        becomes the half-split pair ``(i, i + D / 2)``."""
        dim = self.config.head_dim
        order = torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])
        heads = rows.view(-1, dim, *rows.shape[1:])
        return heads.index_select(1, order.to(rows.device)).reshape(rows.shape)


class Llama4ForConditionalGeneration(ImageEmbeddingsMixin, Llama4ForCausalLM):
    """A multimodal Llama 4 checkpoint: its language model (``language_model.*``) with the
    vision model and projector (``models/llama4_vision.py``) in front. An image item is its
    tiles and its layout (``engine/llama4_inputs.py``); ``encode_image`` gives one row per
    token between ``<|image_start|>`` and ``<|image_end|>``: each tile's projected features
    over its ``<|patch|>`` tokens, the separators' and ``<|image|>``'s own token embeddings
    over theirs (what transformers' ``masked_scatter`` leaves them)."""

    NON_DECODER_PREFIXES = _VISION_PREFIXES
    # Under PP the first stage, which holds the token embeddings encode_image reads, runs
    # them; under TP they are whole on every rank (sharding.py)
    FIRST_STAGE_MODULES = ("vision_model", "multi_modal_projector")

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(cfg, backend, device)
        mm = cfg.mm_config
        if mm is None:
            raise ValueError(f"{CONDITIONAL} needs its config's vision_config.")
        self.vision_model = Llama4VisionModel(mm)
        out_dim = int(vision_fields(mm)["vision_output_dim"])
        self.multi_modal_projector = Llama4MultiModalProjector(out_dim, cfg.hidden_size)

    def encode_image(self, values: torch.Tensor) -> torch.Tensor:  # [N] -> [length, H_text]
        """``values``: the tiles flattened, then (rows, columns, ``<|image|>``,
        ``<|tile_x_separator|>``, ``<|tile_y_separator|>`` ids) (``llama4_inputs.item_values``)."""
        rows, cols, image, tile_x, tile_y = (int(v) for v in values[-5:])
        side = self.vision_model.tile
        tiles = values[:-5].view(-1, 3, side, side)
        feats = self.multi_modal_projector(self.vision_model(tiles))  # [tiles, n, H_text]
        ids = torch.tensor([image, tile_x, tile_y], device=feats.device)
        image_row, x_row, y_row = self.model.embed_tokens(ids).to(feats.dtype).split(1)
        parts: list[torch.Tensor] = []
        if rows * cols > 1:
            for y in range(rows):
                for x in range(cols):
                    parts += [feats[y * cols + x]] + ([x_row] if x < cols - 1 else [])
                parts.append(y_row)
        return torch.cat([*parts, image_row, feats[-1]])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        own = self.first_stage_parameters()  # none on a later pipeline stage
        self.load_vision_and_text(super().load_weights, weights, own, _language_model_name)


def _language_model_name(name: str) -> str:
    return name.removeprefix("language_model.")
