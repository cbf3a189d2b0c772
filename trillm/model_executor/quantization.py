"""Which quantization a model runs with: ``--quantization`` (vLLM's method names) and the
checkpoint's ``quantization_config``, checked before anything loads (issue 13).

trillm runs one method, ``fp8``: vLLM's name for quantizing an unquantized checkpoint at load
(dynamic). Here it is weight-only fp8 e4m3 with a scale per output channel on CPU
(``kernels/linear_fp8_cpu.py``); activations stay in the model's dtype. Every other vLLM method,
and every checkpoint that is already quantized (its ``config.json`` has a
``quantization_config``), is refused with the method named: trillm would otherwise load the
packed integers as if they were weights.
"""

from __future__ import annotations

from typing import Any

SUPPORTED = ("fp8", "gguf")  # gguf: a .gguf model's own Q4_0/Q4_1/Q8_0 blocks (gguf_loader.py)

# vLLM's other method names: refused as "not implemented yet", not as unknown.
VLLM_METHODS = (
    "aqlm", "awq", "awq_marlin", "bitblas", "bitsandbytes", "compressed-tensors", "deepspeedfp",
    "experts_int8", "fbgemm_fp8", "fp_quant", "gptq", "gptq_bitblas", "gptq_marlin",
    "gptq_marlin_24", "hqq", "inc", "ipex", "marlin", "modelopt", "modelopt_fp4", "moe_wna16",
    "mxfp4", "petit_nvfp4", "ptpc_fp8", "quark", "rtn", "torchao", "tpu_int8",
)  # fmt: skip


class UnsupportedQuantizationError(ValueError):
    """A quantization method (asked for, or the checkpoint's) trillm cannot run."""


def check_quantization(method: str) -> str:
    """``method`` if trillm runs it, else ``UnsupportedQuantizationError`` naming it."""
    if method in SUPPORTED:
        return method
    if method.lower() in VLLM_METHODS:
        raise UnsupportedQuantizationError(
            f"quantization method {method!r} is not implemented yet (issues 13 and 15); trillm "
            "runs: fp8 (weights quantized at load, CPU) and gguf (a .gguf model's own blocks)."
        )
    raise UnsupportedQuantizationError(
        f"Unknown quantization method {method!r}; trillm runs: {', '.join(SUPPORTED)}."
    )


def checkpoint_method(hf: dict[str, Any]) -> str | None:
    """The checkpoint's own quantization method (config.json's ``quantization_config``)."""
    config = hf.get("quantization_config")
    if not config:
        return None
    if isinstance(config, dict):
        return str(config.get("quant_method") or config.get("quant_type") or "unnamed")
    return "unnamed"


def resolve_quantization(requested: str | None, hf: dict[str, Any], device: str) -> str | None:
    """What the model runs with; refuses a quantized checkpoint and fp8 off CPU."""
    stored = checkpoint_method(hf)
    if stored is not None:
        raise UnsupportedQuantizationError(
            f"The checkpoint is quantized ({stored!r}, config.json's quantization_config): "
            "loading quantized checkpoints is not implemented yet (issues 13 and 15); trillm "
            "loads unquantized checkpoints, optionally quantizing them with --quantization fp8."
        )
    if requested is None:
        return None
    method = check_quantization(requested)
    if device != "cpu":
        raise UnsupportedQuantizationError(
            f"quantization {method!r} runs on CPU only in trillm (issue 13), device is {device!r}."
        )
    return method
