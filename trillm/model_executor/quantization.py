"""Which quantization a model runs with: ``--quantization`` (vLLM's method names) and the
checkpoint's ``quantization_config``, checked before anything loads (issue 13).

trillm runs ``fp8``: vLLM's name for quantizing an unquantized checkpoint at load (dynamic).
Here it is weight-only fp8 e4m3 with a scale per output channel on CPU
(``kernels/linear_fp8_cpu.py``); activations stay in the model's dtype. It runs ``awq`` and
``gptq`` checkpoints (4-bit groups, ``model_executor/awq_gptq.py``) on CPU: the method is the
checkpoint's, and ``--quantization`` may only name it. Every other vLLM method, and every other
quantized checkpoint (its ``config.json`` has a ``quantization_config``), is refused with the
method named: trillm would otherwise load the packed integers as if they were weights.
"""

from __future__ import annotations

from typing import Any

from trillm.errors import UnsupportedQuantizationError

# gguf: a .gguf model's own Q4_0/Q4_1/Q8_0/K-quant blocks (gguf_loader.py); awq / gptq: the checkpoint's
SUPPORTED = ("fp8", "gguf", "awq", "gptq")
CHECKPOINT_METHODS = ("awq", "gptq")  # methods a checkpoint must carry (not applied at load)

# vLLM's other method names: refused as "not implemented yet", not as unknown.
VLLM_METHODS = (
    "aqlm",
    "awq_marlin",
    "bitblas",
    "bitsandbytes",
    "compressed-tensors",
    "deepspeedfp",
    "experts_int8",
    "fbgemm_fp8",
    "fp_quant",
    "gptq_bitblas",
    "gptq_marlin",
    "gptq_marlin_24",
    "hqq",
    "inc",
    "ipex",
    "marlin",
    "modelopt",
    "modelopt_fp4",
    "moe_wna16",
    "mxfp4",
    "petit_nvfp4",
    "ptpc_fp8",
    "quark",
    "rtn",
    "torchao",
    "tpu_int8",
)


def check_quantization(method: str) -> str:
    """``method`` if trillm runs it, else ``UnsupportedQuantizationError`` naming it."""
    if method in SUPPORTED:
        return method
    if method.lower() in VLLM_METHODS:
        raise UnsupportedQuantizationError(
            f"quantization method {method!r} is not implemented yet (issues 13 and 15); trillm "
            "runs: fp8 (weights quantized at load, CPU), gguf (a .gguf model's own blocks), "
            "awq and gptq (4-bit checkpoints, CPU)."
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
    """What the model runs with: an AWQ / GPTQ checkpoint's method (``requested`` None or the
    same), or ``requested`` on an unquantized one; refuses other quantized checkpoints, a
    method that does not match the checkpoint, and quantization off CPU."""
    stored = checkpoint_method(hf)
    if stored is not None and stored.lower() in CHECKPOINT_METHODS:
        from trillm.model_executor.awq_gptq import parse_config

        parse_config(hf)  # refuses what the kernel cannot run, naming it
        stored = stored.lower()
        if requested is not None and requested != stored:
            raise UnsupportedQuantizationError(
                f"quantization {requested!r} does not match the checkpoint, which is {stored!r} "
                "(config.json's quantization_config); pass that, or nothing."
            )
        requested = stored
    elif stored is not None and stored.lower() == "mxfp4":
        # gpt-oss's MXFP4 experts, dequantized at load by its model (gpt_oss_config.py refuses
        # the format for other architectures): the model runs unquantized.
        if requested not in (None, "mxfp4"):
            raise UnsupportedQuantizationError(
                f"quantization {requested!r} does not match the checkpoint, which is 'mxfp4' "
                "(config.json's quantization_config); pass that, or nothing."
            )
        return None
    elif stored is not None:
        raise UnsupportedQuantizationError(
            f"The checkpoint is quantized ({stored!r}, config.json's quantization_config): "
            "loading it is not implemented yet (issues 13 and 15); trillm loads AWQ and GPTQ "
            "checkpoints and unquantized ones, optionally quantizing them with --quantization fp8."
        )
    if requested is None:
        return None
    method = check_quantization(requested)
    if stored is None and method in CHECKPOINT_METHODS:
        raise UnsupportedQuantizationError(
            f"quantization {method!r} needs a checkpoint quantized with it (config.json's "
            "quantization_config names the method); this checkpoint is not quantized."
        )
    if device != "cpu":
        raise UnsupportedQuantizationError(
            f"quantization {method!r} runs on CPU only in trillm, device is {device!r}."
        )
    return method
