"""Rotary position embedding with rope scaling (default, linear, dynamic, llama3, yarn, longrope).

The inverse frequencies follow transformers' ``ROPE_INIT_FUNCTIONS`` op for op, so the cos/sin
tables are bit-identical to Hugging Face's on the same device; yarn's and longrope's
``attention_factor`` (mscale) multiplies cos and sin, as transformers does. The rotation itself
is ``trillm.kernels.apply_rotary_``, in place (Triton on CUDA, the native kernel on CPU, torch
otherwise).

``rope_scaling`` is the normalised dict from ``ModelConfig.rope_scaling``: ``None`` for plain
RoPE, otherwise ``{"rope_type": ..., <that type's fields>}``.

Long-RoPE (Phi-3.5-mini, Phi-4-mini: ``Phi3ForCausalLM``): transformers' rotary embedding
picks, at each forward, the long factors when ``max(position_ids) + 1 >
original_max_position_embeddings`` and the short ones otherwise, and Phi-3's ``generate``
recomputes the whole sequence (its KV cache dropped) at the step where it first grows past that
length. So every token of a request rotates by one table, the long one iff the request is
longer than the original context: its prompt (one forward there, whatever chunks trillm splits
it into) or, decoding the token at position p, ``p + 1``; when a request crosses, its cached
tokens are computed again on the long table (the runner does that in the crossing step). The
table here is the short one (rows ``0 .. P-1``) above the long one (rows ``P .. 2P-1``);
``LongRopeIndex`` turns positions into rows per request (the runner applies it:
``longrope_index``); plain positions read the short table. Every other rope type has one table
and positions index it as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from trillm.kernels import rotary_torch
from trillm.kernels.dispatch import apply_rotary_
from trillm.model_executor.layer_types import SUPPORTED_ROPE_TYPES


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:  # [dim // 2]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float) / dim
    return 1.0 / (base**exponents)


def _linear(base: float, dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(base, dim) / params["factor"], 1.0


def _llama3(base: float, dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(base, dim)
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the middle band smoothed.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(params: dict[str, Any], factor: float) -> float:
    attention_factor = params.get("attention_factor")
    if attention_factor is not None:
        return float(attention_factor)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _yarn_correction_range(
    params: dict[str, Any], dim: int, base: float, original_max: int
) -> tuple[float, float]:
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn(
    base: float, dim: int, params: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original_max
    attention_factor = _yarn_attention_factor(params, factor)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    low, high = _yarn_correction_range(params, dim, base, original_max)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp(
        (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1
    )
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, attention_factor


def _longrope(
    base: float, dim: int, params: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(short inv_freq, long inv_freq, attention_factor), as transformers'
    ``_compute_longrope_parameters`` computes them (seq_len <= / > the original length)."""
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:  # Phi-3: the ratio of the extended to the pretraining context
        factor = max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if factor <= 1.0:
            attention_factor = 1.0
        else:
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(original_max))
    shape = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim

    def inv_freq(ext_factors: list[float]) -> torch.Tensor:
        ext = torch.tensor(ext_factors, dtype=torch.float32, device="cpu")
        return 1.0 / (ext * base**shape)

    return inv_freq(params["short_factor"]), inv_freq(params["long_factor"]), attention_factor


def _check_longrope_factors(params: dict[str, Any], dim: int) -> None:
    for name in ("short_factor", "long_factor"):
        factors = params.get(name)
        if not isinstance(factors, list) or len(factors) != dim // 2:
            raise ValueError(
                f"longrope rope scaling needs {name} as a list of {dim // 2} numbers "
                f"(half the rotary dims), got {factors!r}."
            )


def compute_inv_freq(
    head_dim: int,
    rope_theta: float,
    rope_scaling: dict[str, Any] | None,
    max_position_embeddings: int,
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention_factor) for the configured rope type.

    NOTE: "dynamic" NTK scaling only changes the frequencies past ``max_position_embeddings``,
    and ``max_model_len`` never exceeds that, so within range it is plain RoPE (as in HF).
    "longrope" gives its short (original) frequencies here, the ones transformers starts with;
    ``RotaryEmbedding`` holds both tables.
    """
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    params = rope_scaling or {}
    if rope_type in ("default", "dynamic"):
        return _base_inv_freq(rope_theta, head_dim), 1.0
    if rope_type == "linear":
        return _linear(rope_theta, head_dim, params)
    if rope_type == "llama3":
        return _llama3(rope_theta, head_dim, params)
    if rope_type == "yarn":
        return _yarn(rope_theta, head_dim, params, max_position_embeddings)
    if rope_type == "longrope":
        _check_longrope_factors(params, head_dim)
        short, _, attention_factor = _longrope(
            rope_theta, head_dim, params, max_position_embeddings
        )
        return short, attention_factor
    raise ValueError(
        f"Unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
    )


def _cos_sin_table(
    inv_freq: torch.Tensor, max_positions: int, attention_factor: float
) -> torch.Tensor:
    positions = torch.arange(max_positions, dtype=torch.int64, device="cpu").float()
    freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2], as HF computes them
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], -1)


@dataclass(frozen=True)
class LongRopeIndex:
    """Which table row each token of a step rotates by, for a longrope ``RotaryEmbedding``."""

    original_max_position_embeddings: int
    long_offset: int  # the first row of the long table (the short table's length)

    def is_long(self, num_tokens: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
        """Per request: [R] bool, its tokens known (prompt + outputs) and the length this step
        computes up to -> whether its sequence is past the original context."""
        return np.maximum(num_tokens, seq_lens) > self.original_max_position_embeddings

    def rope_positions(
        self,
        positions: np.ndarray,  # [T] int64
        num_tokens: np.ndarray,  # [T] int64: each token's request's known tokens
    ) -> np.ndarray:  # [T] int64: rows of the [short; long] table
        """Long rows iff the token's request is longer than the original context: its known
        tokens (a prompt is one forward in transformers, all chunks of it alike), or ``p + 1``
        for the token at position p (a decode step, drafts)."""
        return positions + self.is_long(num_tokens, positions + 1) * self.long_offset


class RotaryEmbedding(nn.Module):
    """A precomputed cos|sin table [max_positions, head_dim], applied in place by
    ``trillm.kernels.dispatch``. For longrope: [2 * max_positions, head_dim], the short table
    then the long one, and ``longrope`` says how positions become rows."""

    def __init__(
        self,
        head_dim: int,
        rope_theta: float,
        rope_scaling: dict[str, Any] | None,
        max_position_embeddings: int,
        max_positions: int,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.longrope: LongRopeIndex | None = None
        if (rope_scaling or {}).get("rope_type") == "longrope":
            assert rope_scaling is not None
            _check_longrope_factors(rope_scaling, head_dim)
            short, long, attention_factor = _longrope(
                rope_theta, head_dim, rope_scaling, max_position_embeddings
            )
            table = torch.cat(
                [
                    _cos_sin_table(short, max_positions, attention_factor),
                    _cos_sin_table(long, max_positions, attention_factor),
                ]
            )
            original_max = int(rope_scaling["original_max_position_embeddings"])
            self.longrope = LongRopeIndex(original_max, max_positions)
        else:
            inv_freq, attention_factor = compute_inv_freq(
                head_dim, rope_theta, rope_scaling, max_position_embeddings
            )
            table = _cos_sin_table(inv_freq, max_positions, attention_factor)
        # NOTE: a plain attribute, not a buffer: it stays float32 through a dtype cast of the
        # model and survives the loader's re-allocation after a meta-device construction.
        self.cos_sin_cache = table.to(device)  # [P, D] float32: cos half, then sin half
        # numerics="transformers": HF's apply_rotary_pos_emb op for op (rotary_torch).
        self.reference = False

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64: rows of cos_sin_cache (see LongRopeIndex)
        q: torch.Tensor,  # [T, Hq, D], may be a strided view (of the fused qkv buffer)
        k: torch.Tensor,  # [T, Hkv, D], likewise
    ) -> None:
        """Rotates q and k in place."""
        if self.reference:
            q_rot, k_rot = rotary_torch.apply_rotary(q, k, positions, self.cos_sin_cache)
            q.copy_(q_rot)
            k.copy_(k_rot)
            return
        apply_rotary_(q, k, positions, self.cos_sin_cache)


def longrope_index(model: object) -> LongRopeIndex | None:
    """The model's longrope row index (None: its positions index its tables as they are)."""
    if not isinstance(model, nn.Module):
        return None
    found = {m.longrope for m in model.modules() if isinstance(m, RotaryEmbedding) and m.longrope}
    if len(found) > 1:
        raise ValueError(f"Rotary embeddings with different longrope settings: {found}.")
    return next(iter(found), None)
