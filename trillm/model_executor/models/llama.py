"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3 differ only by class flags).

Tensor parallelism (``trillm/distributed/``): each rank holds its heads of q/k/v and o, its
columns of gate/up and rows of down, its vocabulary rows of the embedding and head
(``RankShapes``); o_proj's and down_proj's partial sums are all-reduced.

Parameter names match Hugging Face's (``model.layers.N.self_attn.q_proj.weight``, ...) except
that q/k/v and gate/up are stacked into one matmul each; ``stacked_weights.py`` maps the HF
names onto the stacked shards, so safetensors load by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from trillm.attention.backend import AttentionBackend, AttentionMetadata, check_backend_supports
from trillm.attention.kv_layout import KVCacheLayout
from trillm.config import ModelConfig
from trillm.distributed.parallel_state import TensorParallelGroup, get_tp_group
from trillm.distributed.pipeline import (
    IntermediateTensors,
    PPMissingLayer,
    get_pp_group,
    is_missing,
)
from trillm.distributed.sharding import RankShapes
from trillm.kernels import activation_torch
from trillm.kernels.dispatch import silu_and_mul
from trillm.model_executor.layer_types import layer_windows, partial_rotary_factor
from trillm.model_executor.layers.norm import RMSNorm
from trillm.model_executor.layers.rotary import RotaryEmbedding
from trillm.model_executor.layers.vocab_parallel import VocabParallelEmbedding, gather_logits
from trillm.model_executor.models.stacked_weights import StackedLinear, StackedWeightLoader

# Checkpoint entries that are not parameters (old exports carry the rotary buffers).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@dataclass(frozen=True)
class LlamaDecoderFlags:
    """What distinguishes the family members; subclasses of LlamaForCausalLM set these."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    mlp_bias: bool


def rank_shapes(cfg: ModelConfig) -> tuple[TensorParallelGroup, RankShapes]:
    """This process's tensor-parallel group and its share of ``cfg`` (the whole at TP=1)."""
    tp = get_tp_group()
    return tp, RankShapes.of(cfg, tp.rank, tp.world_size, tp.expert_parallel)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        layer: LlamaDecoderFlags,
        window: int | None = None,  # sliding window of this layer (Mistral, Phi-3, Gemma)
        *,
        scale: float | None = None,  # None: head_dim ** -0.5
        softcap: float | None = None,  # attention logit soft-capping (Gemma 2)
        norm: type[nn.Module] = RMSNorm,  # the q/k norm's class, when ``layer.qk_norm``
    ):
        super().__init__()
        check_backend_supports(backend, window, softcap)
        self.window, self.softcap = window, softcap
        self.tp, shapes = rank_shapes(cfg)
        self.num_heads = shapes.num_heads  # this rank's
        self.num_kv_heads = shapes.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5 if scale is None else scale
        shards = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}
        self.qkv_proj = StackedLinear(cfg.hidden_size, shards, bias=layer.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=layer.o_bias)
        if layer.qk_norm:
            self.q_norm = norm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = norm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = layer.qk_norm
        self.backend = backend

    def split_heads(
        self,
        q: torch.Tensor,  # [T, q_size]
        k: torch.Tensor,  # [T, kv_size]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, Hq, D], [T, Hkv, D]
        """Per-head views of q and k, normed per head when the family does (Qwen3, Gemma 3)."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k

    def project_qkv(
        self,
        hidden: torch.Tensor,  # [T, H]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [T, Hq, D], [T, Hkv, D] twice
        """q, k, v per head; q and k are views of the qkv buffer (or the norms' outputs), so the
        rotary embedding can turn them in place."""
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.split_heads(q, k)
        return q, k, v.view(-1, self.num_kv_heads, self.head_dim)

    def project_out(self, out: torch.Tensor) -> torch.Tensor:  # [T, Hq, D] -> [T, H]
        """o_proj over this rank's heads, summed over the tensor-parallel ranks."""
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        q, k, v = self.project_qkv(hidden)  # [T, Hq, D], [T, Hkv, D], [T, Hkv, D]
        rotary(positions, q, k)  # in place: q and k are views of the qkv buffer (or the norms')
        out = self.backend.forward(
            q, k, v, kv_cache, meta, self.scale, window=self.window, softcap=self.softcap
        )  # [T, Hq, D]
        return self.project_out(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool) -> None:
        super().__init__()
        self.tp, shapes = rank_shapes(cfg)
        inter = shapes.inter_size  # this rank's I / N
        shards = {"gate": inter, "up": inter}
        self.gate_up_proj = StackedLinear(cfg.hidden_size, shards, bias=bias)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=bias)
        self.reference = False  # numerics="transformers": F.silu(gate) * up, as HF's MLP

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        act = activation_torch.silu_and_mul if self.reference else silu_and_mul
        out = self.down_proj(act(self.gate_up_proj(x)))  # via [T, 2I/N], [T, I/N]
        return self.tp.all_reduce(out)


class FoldedResidualLayer(nn.Module):
    """A pre-norm decoder layer (attention, then a feed-forward) with Llama's folded residual
    adds; subclasses build its modules under their checkpoint's names."""

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module

    def feed(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        """The feed-forward sublayer (Llama 4 names it ``feed_forward``)."""
        return self.mlp(hidden)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]: the previous layer's MLP output (the embeddings first)
        residual: torch.Tensor | None,  # [T, H]: the residual stream so far (None: first layer)
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual stream), both [T, H]
        """HF's ``residual + sublayer(norm(residual))`` twice, with each residual add folded
        into the next norm (vLLM's layout): the stream after this layer is ``residual +
        returned output``. The same adds in the same order as HF, so the values match up to
        the reduction order inside the norms."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, rotary, kv_cache, meta)
        hidden = self.post_attention_layernorm(hidden, residual)
        return self.feed(hidden), residual


class LlamaDecoderLayer(FoldedResidualLayer):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        flags: LlamaDecoderFlags,
        window: int | None = None,
    ):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, backend, flags, window)
        self.mlp = LlamaMLP(cfg, flags.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderStack(nn.Module):
    """What a ``MODEL_CLASS`` holds (HF's ``model.*`` names): embeddings, layers, final norm."""

    embed_tokens: VocabParallelEmbedding
    layers: nn.ModuleList
    norm: nn.Module

    def assemble(self, cfg: ModelConfig, layers: Iterable[nn.Module], norm: nn.Module) -> None:
        self.embed_tokens = VocabParallelEmbedding(cfg, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class LlamaModel(DecoderStack):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, flags: LlamaDecoderFlags):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg, cfg.hidden_size)
        windows = layer_windows(cfg.hf_config, cfg.architecture, cfg.num_hidden_layers)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, backend, flags, w) for w in windows)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# (rows of the step's tokens, their embeddings [rows, H])
StepRows = tuple[torch.Tensor, torch.Tensor]


class LlamaForCausalLM(nn.Module):
    # Family flags; Mistral/Qwen2/Qwen3 override them in their own modules.
    QKV_BIAS_ALWAYS = False  # Qwen2: q/k/v carry a bias whatever the config says
    O_BIAS_FOLLOWS_CONFIG = True  # Llama/Qwen3: ``attention_bias`` covers o_proj too
    QK_NORM = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    MODEL_CLASS: type[DecoderStack] = LlamaModel  # the decoder stack (Gemma, OLMo 2: their own)
    # Pipeline parallelism: a stage hands the next the residual stream besides the hidden states.
    PP_CARRIES_RESIDUAL = True
    # Parameters ``load_weights`` leaves to a subclass (LLaVA's vision tower and projector).
    NON_DECODER_PREFIXES: tuple[str, ...] = ()
    # --enable-prompt-embeds: given rows replace the token embeddings where transformers'
    # ``inputs_embeds`` enter (Gemma scales after its lookup, so not there yet).
    ACCEPTS_PROMPT_EMBEDS = True
    # The next forward's rows written over its token embeddings (prompt embeddings, image
    # features; ``trillm/worker/mm_inputs.py`` hands them over), consumed by it.
    _step_embeddings: StepRows | None = None

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        self.config = cfg
        self.tp, self.shapes = rank_shapes(cfg)
        self.pp = get_pp_group()  # this rank's stage (its layers: ``stage_layers``)
        self.model = self.MODEL_CLASS(cfg, backend, self.decoder_flags(cfg))
        # [V / N (padded), H]: this rank's vocabulary rows
        self.lm_head = nn.Linear(cfg.hidden_size, self.shapes.vocab_per_rank, bias=False)
        self.tie_weights()
        self.rotary = RotaryEmbedding(
            int(cfg.head_dim * partial_rotary_factor(cfg.hf_config)),  # the rest passes through
            cfg.rope_theta,
            cfg.rope_scaling,
            cfg.max_position_embeddings,
            max_positions=cfg.max_model_len,
            device=device,
        )

    def tie_weights(self) -> None:
        """Share the embedding with the head when the checkpoint ties them (again after
        the loader re-allocates every parameter: ``loader._materialize``)."""
        if self.config.tie_word_embeddings and not isinstance(self.lm_head, PPMissingLayer):
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def decoder_flags(cls, cfg: ModelConfig) -> LlamaDecoderFlags:
        attention_bias = bool(cfg.hf_config.get("attention_bias", False))
        return LlamaDecoderFlags(
            qkv_bias=cls.QKV_BIAS_ALWAYS or attention_bias,
            o_bias=cls.O_BIAS_FOLLOWS_CONFIG and attention_bias,
            qk_norm=cls.QK_NORM,
            mlp_bias=bool(cfg.hf_config.get("mlp_bias", False)),
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # per stage layer [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        intermediate: IntermediateTensors | None = None,  # from the stage before (not stage 0)
    ) -> torch.Tensor | IntermediateTensors:  # [T, H]; what the next stage needs if any
        if intermediate is None:
            hidden, residual = self.embed_input_ids(input_ids), None
        else:
            hidden, residual = intermediate.hidden, intermediate.residual
        for layer, kv_cache in zip(self.stage_layers(), kv_caches):
            hidden, residual = layer(positions, hidden, residual, self.rotary, kv_cache, meta)
        if not self.pp.is_last:
            return IntermediateTensors(hidden, residual)
        return self.model.norm(hidden, residual)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        """The first layer's input, with the step's prompt-embedding rows written over it."""
        return self.merge_step_embeddings(self.model.embed_tokens(input_ids))

    def set_step_embeddings(self, rows: StepRows | None) -> None:
        """The next forward's given rows and their embeddings (consumed by it)."""
        self._step_embeddings = rows

    def merge_step_embeddings(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H]
        if self._step_embeddings is not None:
            rows, embeddings = self._step_embeddings
            self._step_embeddings = None
            hidden[rows] = embeddings.to(hidden.dtype)
        return hidden

    def stage_layers(self) -> list[nn.Module]:
        """The decoder layers this rank runs (all of them without pipeline parallelism)."""
        return [layer for layer in self.model.layers if not isinstance(layer, PPMissingLayer)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, V]
        return gather_logits(self.lm_head(hidden), self.config.vocab_size, self.tp)

    @classmethod
    def kv_cache_layout(cls, cfg: ModelConfig, num_kv_heads: int) -> KVCacheLayout:
        """One layer's cache per token: K and V of a rank's ``num_kv_heads`` heads."""
        return KVCacheLayout.key_value(num_kv_heads, cfg.head_dim)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in; raises MissingWeightsError naming what is missing."""
        skip = self.NON_DECODER_PREFIXES
        params = {n: p for n, p in self.named_parameters() if not n.startswith(skip)}
        loader = StackedWeightLoader(self, params, "Checkpoint")
        for name, tensor in weights:
            if name.endswith(IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            if self.pp.num_stages > 1 and is_missing(self, name):
                continue  # another pipeline stage's
            loader.load(name, tensor, stacked=not self.own_projection(name))
        loader.check_complete()

    @classmethod
    def own_projection(cls, name: str) -> bool:
        """Whether ``name`` is a projection of its own though it reads like a share of a
        stacked q/k/v or gate/up (none in Llama)."""
        return False
