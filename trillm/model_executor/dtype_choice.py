"""The dtype a model runs in: ``--dtype`` names and aliases, the refusals, and what ``auto``
picks per device and CPU (docs/models.md, Dtypes). ``auto`` keeps a float32 checkpoint in
float32; a bf16 / fp16 checkpoint runs in bfloat16 on a CPU with bf16 instructions, else in
float32 (on AVX2 too: measured, see AUTO_DTYPE_NOTES); on CUDA the checkpoint's dtype.
"""

from __future__ import annotations

import logging
from typing import Any

# The float16-on-CPU warning keeps the logger name it had in loader.py.
logger = logging.getLogger("trillm.model_executor.loader")

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {
    "float": "float32",
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "half": "float16",
    "fp16": "float16",
    "float16": "float16",
}

# vLLM refuses an explicit float16 for these model types (numerical instability), on every
# device: Gemma 2/3 and GLM-4 activations grow past float16's 65504.
FLOAT16_UNSTABLE_MODEL_TYPES = ("gemma2", "gemma3", "gemma3_text", "glm4")
# What float16 on CPU stores and computes in, and what it costs (docs/models.md, Dtypes).
FLOAT16_CPU_NOTE = (
    "dtype float16 on CPU: weights, activations and the KV cache are stored in float16, each op "
    "sums in float32 and rounds to float16 once; linears run the F16C GEMM (0.5-1.1x the fp32 "
    "GEMM's time, where the CPU has F16C), attention and norms torch's fp16 ops (no native "
    "fp16 kernels there): about 4.5x float32's time per step on an AVX2 CPU (SmolLM2-135M); "
    "its gain is memory, half the weight and KV cache bytes."
)


class UnsupportedDtypeError(ValueError):
    """A dtype trillm cannot run (an unknown name, or float16 for a model type that overflows)."""


def checkpoint_dtype(hf: dict[str, Any]) -> str:
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return _DTYPE_ALIASES.get(str(name).removeprefix("torch."), "float32")


def cpu_supports_bf16() -> bool:
    """AVX512-BF16 (AMX-BF16 CPUs have it too), by the native kernels' own CPUID check: torch's
    capability string names only the ISA level its kernels were built for ("AVX512", "AVX2"),
    never the bf16 extensions, so it alone read every CPU as lacking them. Torch's string
    where the native kernels are not built."""
    from trillm.kernels import linear_cpu

    if linear_cpu.available_bf16():
        return True
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    return "AVX512_BF16" in capability or "AMX" in capability


def cpu_bf16_gemm() -> str | None:
    """The GEMM bf16 linears get on this CPU: ``"native"`` (AVX512-BF16 or AMX instructions),
    ``"avx2"`` (trillm's AVX2 kernel: bf16 weights widened to fp32 in registers), or None
    (torch's bf16 ``F.linear``, about 1/7 of its fp32 rate on an AVX2 CPU)."""
    if cpu_supports_bf16():
        return "native"
    from trillm.kernels import linear_bf16_avx2_cpu

    return "avx2" if linear_bf16_avx2_cpu.available() else None


# Why ``--dtype auto`` picked what it did for a bf16 / fp16 checkpoint on CPU, per cpu_bf16_gemm().
AUTO_DTYPE_NOTES = {
    "native": "this CPU has bf16 instructions (AVX512-BF16 or AMX)",
    "avx2": (
        "this AVX2 CPU has no bf16 instructions; trillm's AVX2 bf16 GEMM (--dtype bfloat16) "
        "measured faster at batch-1 decode but slower at batch 16 and in a long prefill "
        "(Llama-3.2-1B shape, alternated runs; benchmarks/README.md), at 0.6x the memory"
    ),
    None: (
        "this CPU has no fast bf16 GEMM (no AVX512-BF16 or AMX, and trillm's AVX2 bf16 kernel "
        "is not built or lacks AVX2/FMA/F16C)"
    ),
}


def resolve_dtype(requested: str, checkpoint: str, device: str, model_type: str = "") -> str:
    """The dtype the model runs in: explicit names as asked, ``auto`` per device."""
    name = requested.lower().removeprefix("torch.")
    if name != "auto" and name not in _DTYPE_ALIASES:
        raise UnsupportedDtypeError(
            f"Unsupported dtype {requested!r}; supported: {', '.join(SUPPORTED_DTYPES)}."
        )
    if name != "auto":
        dtype = _DTYPE_ALIASES[name]
        if dtype == "float16" and model_type in FLOAT16_UNSTABLE_MODEL_TYPES:
            raise UnsupportedDtypeError(
                f"dtype float16 is not supported for model type {model_type!r}: its "
                "activations overflow float16's range; use bfloat16 or float32."
            )
        if dtype == "float16" and device == "cpu":
            logger.info(FLOAT16_CPU_NOTE)
        return dtype
    if device == "cuda" or checkpoint == "float32":
        return checkpoint
    gemm = cpu_bf16_gemm()
    picked = "bfloat16" if gemm == "native" else "float32"
    log = logger.info if picked == "bfloat16" else logger.warning
    log("dtype auto: the %s checkpoint runs in %s: %s.", checkpoint, picked, AUTO_DTYPE_NOTES[gemm])
    return picked
