"""Which slice of each checkpoint tensor a tensor-parallel rank holds (Megatron's layout).

    q_proj, k_proj, v_proj, gate_proj, up_proj   column-parallel: rows split (dim 0)
    qkv_proj, gate_up_proj                       fused column-parallel (Phi-3): the rank's
                                                 rows of each part, concatenated
    o_proj, down_proj                            row-parallel: columns split (dim 1); the
                                                 partial sums are all-reduced, so a bias is
                                                 held by rank 0 alone (zeros elsewhere)
    embed_tokens, lm_head                        vocab-parallel: rows split, padded to
                                                 ceil(V / N) rows per rank
    GPT-NeoX's query_key_value, dense_h_to_4h    column-parallel (q/k/v interleaved per head)
    GPT-NeoX's attention.dense, dense_4h_to_h    row-parallel
    norms                                        replicated (OLMo 2's q/k norms, over all
                                                 heads at once: split as q_proj / k_proj)
    MLA's q_proj / q_b_proj, kv_b_proj           column-parallel by heads (DeepSeek); its
                                                 q_a_proj, kv_a_proj_with_mqa replicated
    Llama 4's experts.gate_up_proj, down_proj    [E, H, 2I] / [E, I, H]: each expert's
                                                 gate and up columns, down rows split
    the Mamba-2 layers of Bamba,                 by heads (hybrid_sharding.py)
    GraniteMoeHybrid and Nemotron-H

Attention heads split evenly; KV heads too when there are at least as many as ranks, else each
KV head is replicated on N / Hkv consecutive ranks (the ranks whose query heads use it).
``read_shard`` takes only these slices from a safetensors slice object (``get_slice``), so no
rank reads the whole model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trillm.config import ModelConfig
from trillm.distributed.expert_parallel_check import (
    check_expert_parallel,
    num_routed_experts,
    split_sizes,
)
from trillm.distributed.hybrid_sharding import (
    HYBRID_ARCHITECTURES,
    hybrid_problems,
    read_hybrid_shard,
)
from trillm.utils import cdiv

if TYPE_CHECKING:  # the frontend checks a size (check_divisible) without torch
    import torch

_ROW = ("o_proj", "down_proj", "dense", "dense_4h_to_h")  # GPT-NeoX: attention.dense, MLP out
_VOCAB = ("embed_tokens", "lm_head", "embed_in", "embed_out", "embeddings")  # Nemotron-H's last
_FUSED = ("qkv_proj", "gate_up_proj")  # column-parallel, fused in the checkpoint (Phi-3)
# q/k norms over all heads at once: their weights split like q_proj / k_proj's rows.
_WHOLE_QK_NORM = ("Olmo2ForCausalLM",)
# GPT-NeoX's projections and Mixtral's experts' (each expert's I split) that split as Llama's do.
_AS_LLAMA = {
    "dense_h_to_4h": "up_proj",
    "dense": "o_proj",
    "dense_4h_to_h": "down_proj",
    "w1": "gate_proj",
    "w3": "up_proj",
    "w2": "down_proj",
}


# The families whose layers shard this way (Phi-3's checkpoint fuses q/k/v and gate/up: each
# rank reads its rows of every part; OLMo 2's q/k norms span all heads: split like q/k;
# GPT-NeoX's query_key_value interleaves q/k/v per head: a rank's heads are one block of rows).
# The MoE families split each expert's intermediate rows/columns (Qwen MoE: its own
# moe_intermediate_size, the shared expert's), the router replicated.
ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "Olmo2ForCausalLM",
    "GPTNeoXForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "GptOssForCausalLM",
    "Llama4ForCausalLM",
    "LlavaForConditionalGeneration",
    "LlavaOnevisionForConditionalGeneration",
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
    "Qwen2AudioForConditionalGeneration",
    "Llama4ForConditionalGeneration",
    *HYBRID_ARCHITECTURES,  # their Mamba-2 layers: hybrid_sharding.py
)
# A vision- or audio-language model's tower and projector: whole on every rank (each rank
# encodes an item itself; the text embeddings they overwrite are whole after the vocabulary
# reduce).
_REPLICATED_PREFIXES = (
    "vision_tower.",
    "audio_tower.",
    "vision_model.",  # Llama 4's
    "multi_modal_projector.",
    "visual.",
    "image_newline",
)
_GPT_OSS = "GptOssForCausalLM"
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")  # a routed expert's own tensor
_LLAMA4 = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")


# (and Llama 4's dense layers' intermediate_size_mlp)
_MOE_SIZES = (
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "intermediate_size_mlp",
    "moe_shared_expert_intermediate_size",  # Nemotron-H's shared MLP
)
# MLA (DeepSeek): each head's rows of q_proj / q_b_proj and kv_b_proj, columns of o_proj; the
# low-rank down-projections (q_a_proj, kv_a_proj_with_mqa) and their norms are replicated.
_MLA_HEAD_WIDTHS = {
    "q_proj": ("qk_nope_head_dim", "qk_rope_head_dim"),
    "q_b_proj": ("qk_nope_head_dim", "qk_rope_head_dim"),
    "kv_b_proj": ("qk_nope_head_dim", "v_head_dim"),
    "o_proj": ("v_head_dim",),
}


def intermediate_of(cfg: ModelConfig, name: str) -> int:
    """The whole intermediate size of the MLP that checkpoint tensor ``name`` belongs to."""
    hf = cfg.hf_config
    if cfg.architecture in _LLAMA4:  # experts and shared expert: intermediate_size
        routed = ".experts." in name or ".shared_expert." in name
        return cfg.intermediate_size if routed else int(hf["intermediate_size_mlp"])
    if ".shared_expert." in name:
        return int(hf["shared_expert_intermediate_size"])
    if ".shared_experts." in name and hf.get("moe_shared_expert_intermediate_size"):
        return int(hf["moe_shared_expert_intermediate_size"])  # Nemotron-H's
    if ".shared_experts." in name:  # DeepSeek: n_shared_experts experts' worth, as one MLP
        return int(hf["moe_intermediate_size"]) * int(hf["n_shared_experts"])
    if ".experts." in name and hf.get("moe_intermediate_size"):
        return int(hf["moe_intermediate_size"])
    return cfg.intermediate_size


class TensorParallelConfigError(ValueError):
    """The model's shapes cannot be split over ``tensor_parallel_size`` ranks."""


def check_divisible(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """Raise TensorParallelConfigError naming tensor_parallel_size if ``cfg`` does not split
    (under ``expert_parallel`` the routed experts are whole: their number must split instead
    of their intermediate size, ``expert_parallel_check.py``)."""
    if size > 1 and expert_parallel:
        check_expert_parallel(cfg, size)
    if size > 1 and cfg.architecture not in ARCHITECTURES:
        raise TensorParallelConfigError(
            f"tensor_parallel_size={size}: tensor parallelism does not support "
            f"{cfg.architecture} yet; supported: {', '.join(ARCHITECTURES)}."
        )
    heads, kv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    problems = []
    if heads % size:
        problems.append(f"num_attention_heads={heads}")
    if kv % size and size % kv:
        problems.append(f"num_key_value_heads={kv} (nor is {size} a multiple of it)")
    sizes = {
        "intermediate_size": inter,
        **{key: int(cfg.hf_config[key]) for key in _MOE_SIZES if cfg.hf_config.get(key)},
    }
    if expert_parallel:
        sizes = split_sizes(cfg, sizes)
    problems += [f"{key}={value}" for key, value in sizes.items() if value % size]
    if cfg.architecture in HYBRID_ARCHITECTURES:
        problems += hybrid_problems(cfg.hf_config, size)
    quant = cfg.hf_config.get("quantization_config") or {}
    if size > 1 and cfg.architecture == _GPT_OSS and quant.get("quant_method") == "mxfp4":
        raise TensorParallelConfigError(
            f"tensor_parallel_size={size}: tensor parallelism over MXFP4 checkpoints of "
            f"{_GPT_OSS} is not implemented yet (their 32-value groups span the split)."
        )
    if problems:
        raise TensorParallelConfigError(
            f"tensor_parallel_size={size} does not divide the model's "
            f"{', '.join(problems)}; choose a divisor of these."
        )


@dataclass(frozen=True)
class RankShapes:
    """One rank's share of the model."""

    rank: int
    size: int
    head_start: int  # first query head
    num_heads: int
    kv_head_start: int
    num_kv_heads: int
    inter_start: int
    inter_size: int
    vocab_start: int
    vocab_end: int  # exclusive, <= vocab_size
    vocab_per_rank: int  # rows of the padded shard
    # --enable-expert-parallel: the routed experts whole, this rank's block of them
    # (expert_parallel.py), not every expert's share of its intermediate size
    expert_parallel: bool = False
    # -dp N -ep: (rank, size) of this rank among the ranks the experts are spread over, every
    # engine core's (parallel_state.get_ep_group); None: ``rank`` of ``size``, one core's.
    expert_ranks: tuple[int, int] | None = None

    @property
    def expert_rank_size(self) -> tuple[int, int]:
        return (self.rank, self.size) if self.expert_ranks is None else self.expert_ranks

    @classmethod
    def of(
        cls, cfg: ModelConfig, rank: int = 0, size: int = 1, expert_parallel: bool = False
    ) -> RankShapes:
        check_divisible(cfg, size, expert_parallel)
        heads = cfg.num_attention_heads // size
        kv = cfg.num_key_value_heads
        if kv >= size:
            num_kv, kv_start = kv // size, rank * (kv // size)
        else:
            num_kv, kv_start = 1, rank // (size // kv)
        inter = cfg.intermediate_size // size
        per = cdiv(cfg.vocab_size, size)
        start = min(rank * per, cfg.vocab_size)
        return cls(
            rank,
            size,
            rank * heads,
            heads,
            kv_start,
            num_kv,
            rank * inter,
            inter,
            start,
            min(start + per, cfg.vocab_size),
            per,
            expert_parallel,
        )

    def split_of(self, cfg: ModelConfig, name: str) -> tuple[int, int, int] | None:
        """(dim, start, length) of checkpoint tensor ``name`` on this rank; None = whole."""
        module_path, _, kind = name.rpartition(".")
        proj = module_path.rpartition(".")[2]
        d = cfg.head_dim
        if proj in ("q_norm", "k_norm") and cfg.architecture in _WHOLE_QK_NORM:
            proj = proj[0] + "_proj"
        if proj == "query_key_value":  # GPT-NeoX: rows [Hq, (q|k|v), D], a rank's heads together
            return 0, self.head_start * 3 * d, self.num_heads * 3 * d
        proj = _AS_LLAMA.get(proj, proj)
        if proj in _MLA_HEAD_WIDTHS and "kv_lora_rank" in cfg.hf_config:  # DeepSeek's MLA
            if kind != "weight":  # o_proj's bias: replicated, summed once (read_shard)
                return None
            width = sum(int(cfg.hf_config[key]) for key in _MLA_HEAD_WIDTHS[proj])
            return int(proj == "o_proj"), self.head_start * width, self.num_heads * width
        if proj in ("q_proj",):
            return 0, self.head_start * d, self.num_heads * d
        if proj in ("k_proj", "v_proj"):
            return 0, self.kv_head_start * d, self.num_kv_heads * d
        if proj in ("gate_proj", "up_proj"):
            return 0, *self.inter_rows(cfg, name)
        if proj == "o_proj" and kind == "weight":
            return 1, self.head_start * d, self.num_heads * d
        if proj == "down_proj" and kind == "weight":
            return 1, *self.inter_rows(cfg, name)
        if proj in _VOCAB:
            return 0, self.vocab_start, self.vocab_end - self.vocab_start
        return None

    def _gpt_oss_shard(self, kind: str, source: Any) -> torch.Tensor:
        """gpt-oss's own tensors: ``sinks`` [Hq] by query head; the experts in transformers'
        ``[E, in, out]`` layout, gate and up interleaved column by column (a rank's pairs are
        one run of 2 x its intermediate columns), down's bias summed once (rank 0)."""
        import torch

        start, length = self.inter_start, self.inter_size
        if kind == "sinks":
            return source[self.head_start : self.head_start + self.num_heads]
        if kind == "gate_up_proj":  # [E, H, 2I]
            return source[:, :, 2 * start : 2 * (start + length)]
        if kind == "gate_up_proj_bias":  # [E, 2I]
            return source[:, 2 * start : 2 * (start + length)]
        if kind == "down_proj":  # [E, I, H]
            return source[:, start : start + length]
        tensor = source[:] if not isinstance(source, torch.Tensor) else source
        if kind == "down_proj_bias" and self.rank != 0:
            return torch.zeros_like(tensor)
        return tensor  # the attention projections' own names never end here

    def _llama4_experts_shard(self, cfg: ModelConfig, name: str, source: Any) -> torch.Tensor:
        """Llama 4's experts in transformers' ``[E, in, out]`` layout: this rank's columns of
        gate and of up (``gate_up_proj`` [E, H, 2I], gate's I columns first), its rows of
        ``down_proj`` [E, I, H]."""
        import torch

        start, length = self.inter_rows(cfg, name)
        if name.endswith(".down_proj"):
            return source[:, start : start + length]
        up = cfg.intermediate_size + start
        return torch.cat([source[:, :, start : start + length], source[:, :, up : up + length]], 2)

    def _expert_parallel_shard(self, cfg: ModelConfig, name: str, source: Any) -> torch.Tensor:
        """A routed expert's tensor whole (the loader reads only this rank's experts' ones,
        ``holds_expert``); of the fused ``[E, ...]`` tensors, this rank's block of experts."""
        import torch

        if name.rpartition(".")[0].endswith(".experts"):  # experts.gate_up_proj / down_proj
            rank, size = self.expert_rank_size
            per = num_routed_experts(cfg.hf_config) // size
            return source[rank * per : (rank + 1) * per]
        return source if isinstance(source, torch.Tensor) else source[:]

    def holds_expert(self, cfg: ModelConfig, name: str) -> bool:
        """Whether this rank reads checkpoint tensor ``name``: every tensor but the routed
        experts of other ranks under expert parallelism (``experts.N.`` names)."""
        match = _EXPERT_INDEX.search(name)
        if not self.expert_parallel or match is None:
            return True
        rank, size = self.expert_rank_size
        per = num_routed_experts(cfg.hf_config) // size
        return int(match.group(1)) // per == rank

    def inter_rows(self, cfg: ModelConfig, name: str) -> tuple[int, int]:
        """(start, length) of this rank's share of ``name``'s intermediate dimension."""
        per = intermediate_of(cfg, name) // self.size
        return self.rank * per, per

    def fused_rows(self, cfg: ModelConfig, proj: str) -> list[tuple[int, int]]:
        """(start, length) of this rank's rows in each part of a fused checkpoint weight:
        q, k, v of ``qkv_proj``; gate, up of ``gate_up_proj`` (the parts' order is the one
        the model stacks them in, so the rank's rows concatenate to its fused parameter)."""
        d, heads, kv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        if proj == "qkv_proj":
            k_rows = (self.kv_head_start * d, self.num_kv_heads * d)
            return [
                (self.head_start * d, self.num_heads * d),
                (heads * d + k_rows[0], k_rows[1]),
                ((heads + kv) * d + k_rows[0], k_rows[1]),
            ]
        inter = cfg.intermediate_size
        return [(self.inter_start, self.inter_size), (inter + self.inter_start, self.inter_size)]

    def read_shard(self, cfg: ModelConfig, name: str, source: Any) -> torch.Tensor:
        """This rank's part of ``name`` from ``source`` (a safetensors slice or a tensor):
        only the rank's rows/columns are read."""
        import torch

        if name.removeprefix("model.").startswith(_REPLICATED_PREFIXES):
            return source if isinstance(source, torch.Tensor) else source[:]
        proj = name.rpartition(".")[0].rpartition(".")[2]
        if cfg.architecture in HYBRID_ARCHITECTURES:
            hybrid = read_hybrid_shard(cfg.hf_config, self.rank, self.size, name, source)
            if hybrid is not None:
                return hybrid
        if cfg.architecture == _GPT_OSS and proj in ("experts", "self_attn"):
            return self._gpt_oss_shard(name.rpartition(".")[2], source)
        if self.expert_parallel and ".experts." in name:
            return self._expert_parallel_shard(cfg, name, source)
        if cfg.architecture in _LLAMA4 and proj == "experts":
            return self._llama4_experts_shard(cfg, name, source)
        if proj == "experts":  # fused experts: gate_up_proj [E, 2I, H], down_proj [E, H, I]
            start, length = self.inter_rows(cfg, name)
            if name.endswith(".down_proj"):
                return source[:, :, start : start + length]
            up = intermediate_of(cfg, name) + start
            return torch.cat([source[:, start : start + length], source[:, up : up + length]], 1)
        if proj in _FUSED:  # fused in the checkpoint (Phi-3): this rank's rows of each part
            return torch.cat(
                [source[start : start + length] for start, length in self.fused_rows(cfg, proj)]
            )
        split = self.split_of(cfg, name)
        if split is None:
            tensor = source[:] if not isinstance(source, torch.Tensor) else source
            if proj in _ROW and self.rank != 0:  # a row-parallel bias: summed once, on rank 0
                return torch.zeros_like(tensor)
            return tensor
        dim, start, length = split
        tensor = source[start : start + length] if dim == 0 else source[:, start : start + length]
        if proj in _VOCAB and length < self.vocab_per_rank:  # the last rank's padding rows
            pad = torch.zeros(self.vocab_per_rank - length, *tensor.shape[1:], dtype=tensor.dtype)
            tensor = torch.cat([tensor, pad])
        return tensor
