"""Which models ``--enable-expert-parallel`` can spread over the ranks (checked on the frontend,
without torch): the families whose experts are one ``FusedMoE`` per layer, with a number of
experts the tensor-parallel size divides. The placement and the all-to-alls are in
``expert_parallel.py``."""

from __future__ import annotations

from trillm.config import ModelConfig

# The config key of each family's routed experts' intermediate size: whole on each rank under
# expert parallelism, so the tensor-parallel size need not divide it (Mixtral's experts are
# its only MLPs; the others' dense layers and shared experts stay split).
ROUTED_INTERMEDIATE = {
    "MixtralForCausalLM": "intermediate_size",
    "Qwen2MoeForCausalLM": "moe_intermediate_size",
    "Qwen3MoeForCausalLM": "moe_intermediate_size",
    "DeepseekV2ForCausalLM": "moe_intermediate_size",
    "DeepseekV3ForCausalLM": "moe_intermediate_size",
}
ARCHITECTURES = tuple(ROUTED_INTERMEDIATE)


class ExpertParallelConfigError(ValueError):
    """The model's experts cannot be placed over the ranks."""


def num_routed_experts(hf: dict) -> int:
    """DeepSeek: ``n_routed_experts``; Qwen MoE ``num_experts``; Mixtral (and transformers 5)
    ``num_local_experts``."""
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        if hf.get(key):
            return int(hf[key])
    return 0


def split_sizes(cfg: ModelConfig, sizes: dict[str, int]) -> dict[str, int]:
    """Of ``sizes`` (config key -> size), those tensor parallelism still splits under expert
    parallelism: all but the routed experts' intermediate size, and DeepSeek's shared experts
    (one MLP of n_shared_experts x moe_intermediate_size)."""
    hf = cfg.hf_config
    kept = {k: v for k, v in sizes.items() if k != ROUTED_INTERMEDIATE[cfg.architecture]}
    if hf.get("n_shared_experts"):
        shared = int(hf["moe_intermediate_size"]) * int(hf["n_shared_experts"])
        kept["moe_intermediate_size x n_shared_experts"] = shared
    return kept


def check_expert_parallel(cfg: ModelConfig, size: int, ranks: str = "") -> None:
    """Refuse, naming enable_expert_parallel, a model whose experts cannot be spread over
    ``size`` ranks: a family without a ``FusedMoE``, or a number of experts ``size`` does not
    divide. ``ranks``: how the ranks are counted (default: tensor_parallel_size={size})."""
    if cfg.architecture not in ARCHITECTURES:
        raise ExpertParallelConfigError(
            f"enable_expert_parallel: expert parallelism does not support {cfg.architecture} "
            f"yet; supported: {', '.join(ARCHITECTURES)}."
        )
    experts = num_routed_experts(cfg.hf_config)
    if experts % size:
        raise ExpertParallelConfigError(
            f"enable_expert_parallel: the model's {experts} experts do not split evenly over "
            f"{ranks or f'tensor_parallel_size={size}'} ranks; choose a divisor of {experts}."
        )
