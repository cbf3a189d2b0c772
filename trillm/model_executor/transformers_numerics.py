"""``numerics="transformers"``: every op of the model computed as transformers' eager forward
computes it, so that a request's output equals transformers' own, bit for bit.

trillm's native kernels (packed GEMMs, fused add-and-norm, the paged and fresh-prompt attention
kernels) give the model's values up to summation order; in bf16 one value rounded the other way
spreads to every later layer and moves greedy tokens at near-ties (benchmarks/archive/RESULTS-journal.md,
sections 22-24 and 30). Here the model runs transformers' ops instead, op for op:

- linears: torch's ``F.linear`` on the unpacked weights (``build_model`` does not pack them);
- RMSNorm: ``rms_norm_torch`` (fp32 mean of squares, rsqrt, cast back, then the weight), the
  residual add a separate op in the model's dtype;
- rotary: ``rotary_torch`` (``apply_rotary_pos_emb``'s products and sum, rounded alike);
- the MLP: ``F.silu(gate) * up``;
- attention: ``attention/eager_backend.py`` (``eager_attention_forward``, one request at a time).

A request's rows then meet the same ops, in the same shapes, as when transformers runs that
request alone; what batching still changes is the row count of each GEMM, and the weights'
addresses differ from transformers'. Where torch's GEMM gives a row the same bits at any row
count and weight alignment (``gemm_batch_variance`` checks each of the model's linear shapes at
load, and the log says so), batched output equals transformers' one request at a time: bf16 on
the CPUs measured (benchmarks/archive/RESULTS-journal.md, section 37). Where the row count matters, one request
at a time does (the log says how); MKL's fp32 GEMM follows the weights' alignment, so fp32
output equals transformers' to rounding only.

Implemented for the Llama family (Llama, Mistral, Qwen2, Qwen3) on CPU, unquantized, one
tensor-parallel rank, the KV cache in the model's dtype, no LoRA; ``check`` refuses the rest
before anything loads.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from trillm.config import EngineArgs, ModelConfig

logger = logging.getLogger(__name__)

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
PROBE_ROWS = (1, 2, 3, 8, 17, 33, 64)
ALIGNMENT = "weight memory alignment"  # MKL's fp32 GEMM: transformers' mmap'd weights differ


def check(args: EngineArgs, model: ModelConfig, device: str) -> None:
    """ValueError naming what ``numerics="transformers"`` cannot honour with these args."""
    if args.numerics != "transformers":
        return
    refusals = {
        "device": (device != "cpu", f"runs on CPU, not {device}"),
        "architecture": (
            model.architecture not in ARCHITECTURES,
            f"is implemented for {', '.join(ARCHITECTURES)}, not {model.architecture}",
        ),
        "quantization": (
            model.quantization is not None,
            f"needs unquantized weights, not {model.quantization}",
        ),
        "kv_cache_dtype": (
            args.kv_cache_dtype != "auto",
            f"keeps the KV cache in the model's dtype (kv_cache_dtype auto), not "
            f"{args.kv_cache_dtype}",
        ),
        "enable_lora": (args.enable_lora, "does not apply LoRA adapters"),
        "tensor_parallel_size": (
            args.tensor_parallel_size > 1,
            "runs one tensor-parallel rank (an all-reduce sums in another order)",
        ),
        "attention_backend": (
            args.attention_backend not in (None, "eager"),
            f"attends with the eager backend, not {args.attention_backend}",
        ),
    }
    for name, (refused, why) in refusals.items():
        if refused:
            raise ValueError(f"numerics='transformers' {why} ({name}).")


def prepare(model: nn.Module) -> None:
    """Switch the model's norms, rotary and MLPs to transformers' ops (its linears stay
    unpacked: ``F.linear``), then log whether torch's GEMM is batch-invariant here."""
    from trillm.model_executor.layers.norm import RMSNorm
    from trillm.model_executor.layers.rotary import RotaryEmbedding
    from trillm.model_executor.models.llama import LlamaMLP

    for module in model.modules():
        if isinstance(module, (RMSNorm, RotaryEmbedding, LlamaMLP)):
            module.reference = True
    variant = gemm_batch_variance(model)
    if variant:
        logger.warning(
            "numerics='transformers': on this CPU torch's GEMM gives a row other bits for %s. "
            "At another row count: one request at a time (max_num_seqs=1, "
            "enable_prefix_caching=False, each prompt in one prefill chunk) gives transformers' "
            "output for a request run alone. At another %s: outputs equal transformers' to "
            "rounding, not bit for bit.",
            "; ".join(variant),
            ALIGNMENT,
        )
    else:
        logger.info(
            "numerics='transformers': torch's GEMM gives a row the same bits at %s rows and at "
            "any weight alignment for every linear shape of this model.",
            "-".join(str(n) for n in (PROBE_ROWS[0], PROBE_ROWS[-1])),
        )


def gemm_batch_variance(model: nn.Module) -> list[str]:
    """For each distinct linear shape of ``model`` (random values of its dtype), where
    ``F.linear`` of a row differs with the weight's memory alignment, the call's row count
    or the stacked weight split into its shards: a description per shape, empty when none
    does."""
    import torch
    from torch import nn

    seen: dict[tuple[Any, ...], str] = {}
    for module in model.modules():
        if not isinstance(module, nn.Linear) or module.weight.device.type != "cpu":
            continue
        weight = module.weight
        offsets = getattr(module, "shard_offsets", {})  # a StackedLinear's (start, size)
        shards = tuple(size for _, size in offsets.values())
        key = (tuple(weight.shape), weight.dtype, module.bias is not None, shards)
        if key not in seen:
            seen[key] = _probe(weight.shape, weight.dtype, module.bias is not None, shards, torch)
    return list(dict.fromkeys(found for found in seen.values() if found))


def _probe(
    shape: torch.Size, dtype: torch.dtype, bias: bool, shards: tuple[int, ...], torch: Any
) -> str:
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    x = torch.randn(PROBE_ROWS[-1], in_features, generator=gen).to(dtype)
    alone = torch.nn.functional.linear(x[:1], w, b)
    where = f"{in_features} x {out_features} {str(dtype).removeprefix('torch.')}"
    for offset in (1, 3, 6):  # the same weight at 2-24 bytes past a 64-byte boundary
        shifted = torch.empty(w.numel() + offset, dtype=dtype)[offset:].view_as(w).copy_(w)
        if not torch.equal(torch.nn.functional.linear(x[:1], shifted, b), alone):
            return f"{where} at another {ALIGNMENT}"
    for rows in PROBE_ROWS[1:]:
        if not torch.equal(torch.nn.functional.linear(x[:rows], w, b)[:1], alone):
            return f"{where} at {rows} rows"
    if len(shards) > 1:
        full = torch.nn.functional.linear(x, w, b)
        start = 0
        for size in shards:
            part_b = None if b is None else b[start : start + size]
            part = torch.nn.functional.linear(x, w[start : start + size], part_b)
            if not torch.equal(part, full[:, start : start + size]):
                return f"{where} split into {shards}"
            start += size
    return ""
