"""Multi-head Latent Attention (DeepSeek-V2 / V3), on the paged latent cache.

Per token and layer the cache holds what transformers' cache holds: the ``kv_lora_rank``
latent after ``kv_a_layernorm``, then the ``qk_rope_head_dim`` roped key shared by every head
(``KVCacheLayout(1, (1, L + R))``), not the expanded K/V of every head.

Attention runs in torch ops with the up-projection absorbed (DeepSeek-V2's paper, vLLM's MLA
backends): ``kv_b_proj`` is ``W_UK`` [Hq, Dn, L] and ``W_UV`` [Hq, Dv, L] per head, so
``q_nope . (W_UK c) = (q_nope W_UK) . c`` and ``sum_s p_s W_UV c_s = W_UV sum_s p_s c_s``. Each
head's query becomes ``[q_nope W_UK, q_pe]`` (L + R wide), scored against the cached rows
themselves, and the attention output over the latents (L wide) goes through ``W_UV``: one
key/value "head" per token, read through the block table, never expanded. The same sums as
transformers' expanded K/V in another order (fp32: logprobs within 1e-5 on the tiny models).

RoPE: V2 rotates interleaved pairs ``(x0, x1), (x2, x3) ...`` (its complex product), as V3 does
with ``rope_interleave``; both are the usual half-split rotation of the de-interleaved dims
(``x[0::2]`` then ``x[1::2]``), applied to q and k alike, so the scores are unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trillm.attention.backend import AttentionMetadata
from trillm.attention.torch_groups import Group, build_groups
from trillm.config import ModelConfig
from trillm.model_executor.layers.linear import leave_unpacked
from trillm.model_executor.layers.norm import RMSNorm
from trillm.model_executor.layers.rotary import RotaryEmbedding
from trillm.model_executor.models.llama import rank_shapes

FP8_KV = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value: stored as x / scale with the scale 1.0
# A CPU decode chunk's gathered fp32 latent rows: within a shared L3 cache
_CPU_CHUNK_BYTES = 8 << 20


def mla_softmax_scale(hf: dict[str, Any], rope_scaling: dict[str, Any] | None) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale ** 2`` for a scaled rope with ``mscale_all_dim``
    (transformers' ``yarn_apply_mscale``: YaRN scales the non-rotary dims of MLA too)."""
    scale = (int(hf["qk_nope_head_dim"]) + int(hf["qk_rope_head_dim"])) ** -0.5
    mscale_all_dim = (rope_scaling or {}).get("mscale_all_dim")
    factor = float((rope_scaling or {}).get("factor") or 1.0)
    if mscale_all_dim and factor > 1:
        mscale = 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class MLAPlan:
    """The step's request groups (decode rows; prefill chunks padded to the longest), built
    by the first layer from the step's metadata and reused by the others."""

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._groups: list[Group] = []

    def groups(self, meta: AttentionMetadata, block_size: int) -> list[Group]:
        if meta is not self._meta:
            decode = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
            prefill = [i for i, n in enumerate(meta.query_lens_cpu) if n > 1]
            self._groups = build_groups(meta, decode, prefill, block_size)
            self._meta = meta
        return self._groups


class MLAAttention(nn.Module):
    """HF's module names: ``q_proj`` or ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``,
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``."""

    def __init__(self, cfg: ModelConfig, plan: MLAPlan, interleaved: bool) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.plan, self.interleaved = plan, interleaved
        # Tensor parallelism: a rank holds its heads' rows of q and kv_b, columns of o_proj
        # (all-reduced), and the whole latent (every head reads it).
        self.tp, shapes = rank_shapes(cfg)
        self.num_heads = shapes.num_heads
        self.nope_dim, self.rope_dim = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
        self.v_dim, self.latent_dim = int(hf["v_head_dim"]), int(hf["kv_lora_rank"])
        self.q_dim = self.nope_dim + self.rope_dim
        self.scale = mla_softmax_scale(hf, cfg.rope_scaling)
        bias, hidden, heads = cfg.attention_bias, cfg.hidden_size, self.num_heads
        q_lora_rank = hf.get("q_lora_rank")
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * self.q_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, int(q_lora_rank), bias=bias)
            self.q_a_layernorm = RMSNorm(int(q_lora_rank), 1e-6)  # HF's default eps here
            self.q_b_proj = nn.Linear(int(q_lora_rank), heads * self.q_dim, bias=False)
        self.q_lora = q_lora_rank is not None
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.latent_dim + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.latent_dim, 1e-6)
        self.kv_b_proj = nn.Linear(self.latent_dim, heads * (self.nope_dim + self.v_dim), False)
        leave_unpacked(self.kv_b_proj)  # its weight is read as W_UK / W_UV, never called
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=bias)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, H]
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, L + R]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q = q.view(-1, self.num_heads, self.q_dim)  # [T, Hq, Dn + R]
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.latent_dim, self.rope_dim], -1)
        latent = self.kv_a_layernorm(latent.contiguous())  # [T, L]
        q_pe, k_pe = self._rope(positions, q[..., self.nope_dim :], k_pe[:, None], rotary)
        cache = kv_cache.view(-1, self.latent_dim + self.rope_dim)  # [num_slots, L + R]
        _write_rows(cache, meta.slot_mapping, torch.cat([latent, k_pe[:, 0]], dim=-1))
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, -1)
        w_uk, w_uv = w_kv.split([self.nope_dim, self.v_dim], dim=1)  # [Hq, Dn | Dv, L]
        q_nope = q[..., : self.nope_dim].transpose(0, 1)  # [Hq, T, Dn]
        q_latent = torch.bmm(q_nope, w_uk).transpose(0, 1)  # [T, Hq, L]
        query = torch.cat([q_latent, q_pe], dim=-1)  # [T, Hq, L + R]
        groups = self.plan.groups(meta, kv_cache.shape[2])
        out_latent = self._attend(query, kv_cache, groups)  # [T, Hq, L]
        out = torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2))  # [Hq, T, Dv]
        out = self.o_proj(out.transpose(0, 1).reshape(-1, self.num_heads * self.v_dim))
        return self.tp.all_reduce(out)

    def _rope(
        self,
        positions: torch.Tensor,  # [T]
        q_pe: torch.Tensor,  # [T, Hq, R] a view of q
        k_pe: torch.Tensor,  # [T, 1, R] a view of the kv_a output
        rotary: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # rotated copies, [T, Hq, R], [T, 1, R]
        if self.interleaved:  # pairs (x0, x1), ... -> halves (x0, x2, ... | x1, x3, ...)
            q_pe = torch.cat([q_pe[..., 0::2], q_pe[..., 1::2]], dim=-1)
            k_pe = torch.cat([k_pe[..., 0::2], k_pe[..., 1::2]], dim=-1)
        else:
            q_pe, k_pe = q_pe.contiguous(), k_pe.contiguous()
        rotary(positions, q_pe, k_pe)
        return q_pe, k_pe

    def _attend(
        self,
        query: torch.Tensor,  # [T, Hq, L + R]
        kv_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, L + R]
        groups: list[Group],
    ) -> torch.Tensor:  # [T, Hq, L]
        heads, width = self.num_heads, query.shape[-1]
        cache = kv_cache.view(-1, width)  # [num_slots, L + R]
        blocks = kv_cache.view(kv_cache.shape[1], -1)  # [num_blocks, block_size * (L + R)]
        out = query.new_empty(query.shape[0], heads, self.latent_dim)
        for group in groups:
            if group.decode:
                self._attend_decode(query, blocks, group, out)
                continue
            keys = _read_rows(cache, group.gather_slots, query.dtype)[:, None]  # [Rg, 1, S, L+R]
            rows = group.query_index.reshape(-1)  # [Rg * Lq]
            queries = query.index_select(0, rows).view(len(group.gather_slots), 1, -1, width)
            mask = group.mask.repeat_interleave(heads, dim=2)  # [Rg, 1, Lq * Hq, S]
            attended = _latent_attention(queries, keys, mask, self.scale, self.latent_dim)
            flat = attended.reshape(-1, heads, self.latent_dim)  # [Rg * Lq, Hq, L]
            out.index_copy_(0, group.token_rows, flat.index_select(0, group.out_index))
        return out

    def _attend_decode(
        self,
        query: torch.Tensor,  # [T, Hq, L + R]
        blocks: torch.Tensor,  # [num_blocks, block_size * (L + R)]: the cache by blocks
        group: Group,
        out: torch.Tensor,  # [T, Hq, L]
    ) -> None:
        """A decode group, its requests' context read by whole blocks (row by row the gather
        cost 5x more), a few requests at a time on CPU so that each chunk's fp32 rows stay in
        the CPU's cache between the gather and the two matmuls that read them (the whole group
        at once made a 16 x 2,048-token decode step 2.3x slower)."""
        # NOTE: one key "head" for all query heads: the heads are rows of one query (a
        # request's Hq rows), so nothing is repeated per head.
        width = query.shape[-1]
        block_size = blocks.shape[1] // width
        block_ids = group.gather_slots[:, ::block_size] // block_size  # [Rg, nb]
        num, padded = block_ids.shape[0], block_ids.shape[1] * block_size
        mask = F.pad(group.mask, (0, padded - group.mask.shape[-1]))  # [Rg, 1, 1, nb * bs]
        chunk = num
        if blocks.device.type == "cpu":
            chunk = max(1, _CPU_CHUNK_BYTES // (padded * width * 4))
        for start in range(0, num, chunk):
            part = slice(start, start + chunk)
            keys = _read_rows(blocks, block_ids[part], query.dtype)  # [Rc, nb, bs * (L + R)]
            keys = keys.view(keys.shape[0], 1, padded, width)
            rows = group.query_index[part]  # [Rc]
            queries = query.index_select(0, rows)[:, None]  # [Rc, 1, Hq, L + R]
            attended = _latent_attention(queries, keys, mask[part], self.scale, self.latent_dim)
            out.index_copy_(0, rows, attended[:, 0])


def _latent_attention(
    queries: torch.Tensor,  # [Rg, 1, Lq * Hq, L + R]
    keys: torch.Tensor,  # [Rg, 1, S, L + R]: the values are their first L columns
    mask: torch.Tensor,  # [Rg, 1, Lq * Hq or 1, S] bool, True = attend
    scale: float,
    latent_dim: int,
) -> torch.Tensor:  # [Rg, 1, Lq * Hq, L]
    """Softmax attention in plain matmuls: SDPA's CPU path scales (copies) every key and
    copies the values' strided view, the bulk of a decode step here; this scales the scores
    and takes the whole key rows as the values (the R roped columns' sums are dropped after:
    the strided L-column view would be copied by the matmul). Sums and softmax in fp32 (bf16:
    the latents widened, as SDPA's CPU path computes)."""
    keys = keys.float()
    scores = torch.matmul(queries.float(), keys.transpose(-1, -2)) * scale  # [Rg, 1, LqHq, S]
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs, keys)[..., :latent_dim].to(queries.dtype)


def _write_rows(
    cache: torch.Tensor,  # [num_slots, L + R]
    slots: torch.Tensor,  # [T] int64
    rows: torch.Tensor,  # [T, L + R]
) -> None:
    if cache.dtype == FP8_KV:  # index_copy_ by bytes
        fp8 = rows.clamp(-FP8_MAX, FP8_MAX).to(FP8_KV)
        cache.view(torch.uint8).index_copy_(0, slots, fp8.view(torch.uint8))
        return
    cache.index_copy_(0, slots, rows.to(cache.dtype))


def _read_rows(
    cache: torch.Tensor,  # [num_slots, L + R] (or by blocks: [num_blocks, bs * (L + R)])
    slots: torch.Tensor,  # [Rg, S] int64 (block ids)
    dtype: torch.dtype,
) -> torch.Tensor:  # [Rg, S, L + R] (or [Rg, S, bs * (L + R)])
    # NOTE: index_select, not advanced indexing: on CPU it is far faster.
    if cache.dtype == FP8_KV:
        rows = cache.view(torch.uint8).index_select(0, slots.reshape(-1)).view(FP8_KV)
    else:
        rows = cache.index_select(0, slots.reshape(-1))
    return rows.to(dtype).view(*slots.shape, cache.shape[-1])
