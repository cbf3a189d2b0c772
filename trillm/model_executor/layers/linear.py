"""Linear layers on CPU through the native packed-weight GEMM (``kernels/linear_cpu.py``).

``pack_cpu_linears(model)`` runs once after the weights are loaded: every fp32 CPU
``nn.Linear`` of the model (``StackedLinear`` included) gets a packed copy of its weight and a
forward that multiplies by it (inference only: with autograd on, torch's GEMM, see below).
On the bench model's shapes with 2 threads it runs 1.3-1.7x torch's GEMM at 8-96 rows (decode
steps) and 1.1-1.2x at 512-4096 (prefill chunks) on Zen 4 (AVX2 kernel); on an Intel core with
two 512-bit FMA units its AVX-512 kernel runs 1.1-1.2x torch (MKL) at 64 rows and 0.9-1.0x at
256-2048, where the AVX2 one ran 0.6-0.7x (benchmarks/RESULTS.md, section 26).

The packed copy is the layer's only copy: the original weight is dropped (left an empty
parameter of its dtype), so the weights take their bytes once: Llama-3.2-1B's shape (tied head)
in bf16 holds 2.79 GiB (resident 3.50 GiB) where both copies held 4.60 (5.30), in fp32 5.58
(6.30) where they held 9.21 (``benchmarks/engine/packed_memory.py``). torch's GEMM, where a
call leaves the kernel (autograd on, another dtype or device), runs on the weight unpacked from
the packed copy, exactly (``dense_weight``, a copy per call; gradients reach the input, not the dropped
weight); what reads a loaded weight reads it there. The original stays where something else reads it: a head tied to its embedding (the embedding
holds those rows anyway; the tie is kept), bf16 layers on an AMX host (torch's AMX GEMM takes
their calls of many rows), and layers marked ``leave_unpacked`` (read as a tensor, never
called: MLA's ``kv_b_proj``; not packed at all). Weights cannot be rewritten in place after
packing: load the model again.

bf16 layers (``--dtype bfloat16``) go the same way through the AVX512-BF16 GEMM
(``linear_cpu.linear_bf16``): bf16 in, bf16 out rounded once from fp32 sums (torch's bf16
``F.linear`` numerics, so the model keeps matching transformers in bf16); norms and softmax stay
fp32 inside their kernels as before. On a CPU without AVX512-BF16 they keep ``F.linear``; on
one with AMX-BF16, calls of more than ``linear_cpu.bf16_kernel_max_rows()`` rows go to
``F.linear`` (oneDNN's AMX GEMM: faster there, the same numerics up to summation order).

On a CPU without AVX512-BF16 but with AVX2/FMA/F16C, bf16 layers go through the fp16 GEMM's
kernel in its bf16 form (``linear_bf16_avx2_cpu``): bf16 weights widened to fp32 in registers,
the same numerics (``bf16_kernel()`` picks).

fp16 layers (``--dtype float16``) go through the F16C GEMM (``linear_fp16_cpu``, any AVX2 CPU):
fp16 weights and activations widened in registers, fp32 sums rounded to fp16 once (torch's fp16
``F.linear`` numerics, 3-7x its speed on AVX2 from 8 rows up, measured alternately on the bench
model's shapes).

``--quantization fp8`` (``pack_cpu_linears(model, "fp8")``): weight-only fp8 e4m3 with a scale
per output channel, through ``kernels/linear_fp8_cpu.py``; activations stay in the model's
dtype (fp32 or bf16; fp16 activations are widened to fp32 for the kernel, the output rounded
back to fp16).
"""

from __future__ import annotations

import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from trillm.kernels import linear_bf16_avx2_cpu, linear_cpu, linear_fp8_cpu, linear_fp16_cpu


def dense_weight(module: nn.Linear) -> torch.Tensor:  # [N, K]
    """A packed layer's weight as the checkpoint gave it: the original where the layer kept it,
    else unpacked from the packed copy, exactly (a copy per call). For torch's GEMM off the
    kernel's path (autograd on, another dtype or device) and for what reads loaded weights."""
    if module.weight.numel():
        return module.weight
    packed: linear_cpu.PackedWeight | linear_cpu.PackedWeightBf16 | linear_fp16_cpu.Packed16
    packed = module.packed_weight  # type: ignore[assignment]
    return packed.unpack()


def loaded_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``model.named_parameters()`` with each packed layer's weight read back from its packed
    copy: the values the checkpoint loaded (what a state dict of the model would hold)."""
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if leaf == "weight" and hasattr(module, "packed_weight"):
            yield name, dense_weight(module)  # type: ignore[arg-type]
        else:
            yield name, param


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    packed: linear_cpu.PackedWeight = self.packed_weight  # type: ignore[assignment]
    if x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_grad_enabled():
        return linear_cpu.linear(x, packed, self.bias)
    return F.linear(x, dense_weight(self), self.bias)


def _packed_forward_bf16(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    packed: linear_cpu.PackedWeightBf16 = self.packed_weight  # type: ignore[assignment]
    if x.device.type == "cpu" and x.dtype == torch.bfloat16 and not torch.is_grad_enabled():
        limit = linear_cpu.bf16_kernel_max_rows()  # with AMX, torch's GEMM wins at many rows
        if limit is None or x.numel() <= limit * x.shape[-1]:
            return linear_cpu.linear_bf16(x, packed, self.packed_bias)  # type: ignore[arg-type]
    return F.linear(x, dense_weight(self), self.bias)


def _packed_forward_bf16_avx2(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    packed: linear_bf16_avx2_cpu.PackedWeightBf16Avx2 = self.packed_weight  # type: ignore[assignment]
    if x.device.type == "cpu" and x.dtype == torch.bfloat16 and not torch.is_grad_enabled():
        return linear_bf16_avx2_cpu.linear_bf16(x, packed, self.packed_bias)  # type: ignore[arg-type]
    return F.linear(x, dense_weight(self), self.bias)


def _packed_forward_fp16(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    packed: linear_fp16_cpu.PackedWeightFp16 = self.packed_weight  # type: ignore[assignment]
    if x.device.type == "cpu" and x.dtype == torch.float16 and not torch.is_grad_enabled():
        return linear_fp16_cpu.linear_fp16(x, packed, self.packed_bias)  # type: ignore[arg-type]
    return F.linear(x, dense_weight(self), self.bias)


def _pack_fp32(module: nn.Linear) -> bool:
    weight = module.weight.detach()
    if not linear_cpu.available() or not linear_cpu.supports(weight):
        return False
    if module.bias is not None and module.bias.dtype != torch.float32:
        return False
    # a native object as a plain attribute (torch types Module.__setattr__ as Tensor | Module)
    module.packed_weight = linear_cpu.PackedWeight(weight)  # type: ignore[assignment]
    module.forward = types.MethodType(_packed_forward, module)  # type: ignore[method-assign]
    return True


def bf16_kernel() -> str | None:
    """The GEMM bf16 layers get: ``"avx512_bf16"`` where the CPU has AVX512-BF16 (that kernel
    is faster), else ``"avx2"`` (weights widened in registers), else None (``F.linear``)."""
    if linear_cpu.available_bf16():
        return "avx512_bf16"
    if linear_bf16_avx2_cpu.available():
        return "avx2"
    return None


def _pack_bf16(module: nn.Linear) -> bool:
    weight = module.weight.detach()
    kernel = bf16_kernel()
    if kernel is None or not linear_cpu.supports_bf16(weight):
        return False
    bias = module.bias
    if bias is not None and bias.dtype not in (torch.bfloat16, torch.float32):
        return False
    if kernel == "avx512_bf16":
        module.packed_weight = linear_cpu.PackedWeightBf16(weight)  # type: ignore[assignment]
        forward = _packed_forward_bf16
    else:
        module.packed_weight = linear_bf16_avx2_cpu.PackedWeightBf16Avx2(weight)  # type: ignore[assignment]
        forward = _packed_forward_bf16_avx2
    # fp32 once here, not per call: the kernel adds the bias to its fp32 sums (exact for bf16).
    module.packed_bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
    module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
    return True


def _pack_fp16(module: nn.Linear) -> bool:
    weight = module.weight.detach()
    if not linear_fp16_cpu.available() or not linear_fp16_cpu.supports(weight):
        return False
    bias = module.bias
    module.packed_weight = linear_fp16_cpu.PackedWeightFp16(weight)  # type: ignore[assignment]
    # fp32 once here: the kernel adds the bias to its fp32 sums (exact for fp16).
    module.packed_bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
    module.forward = types.MethodType(_packed_forward_fp16, module)  # type: ignore[method-assign]
    return True


def _fp8_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight: linear_fp8_cpu.Fp8Weight = self.fp8_weight  # type: ignore[assignment]
    if x.dtype == torch.float16:  # the kernel takes fp32 or bf16: widened, exact
        return linear_fp8_cpu.linear_fp8(x.float(), weight, self.packed_bias).half()  # type: ignore[arg-type]
    return linear_fp8_cpu.linear_fp8(x, weight, self.packed_bias)  # type: ignore[arg-type]


def _quantize_fp8(module: nn.Linear) -> None:
    """The weight becomes e4m3 bytes + per-channel scales; the original is dropped (the point
    is a quarter of fp32's bytes in memory too)."""
    weight = module.weight.detach()
    weight = weight.float() if weight.dtype == torch.float16 else weight  # exact: e4m3 from fp32
    module.fp8_weight = linear_fp8_cpu.Fp8Weight.quantize(weight)  # type: ignore[assignment]
    bias = module.bias
    module.packed_bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
    module.register_parameter("weight", None)
    module.forward = types.MethodType(_fp8_forward, module)  # type: ignore[method-assign]


# Layers --quantization fp8 leaves in the model's dtype (vLLM's fp8 method does the same: its
# lm_head is not a quantized linear; here it is often the tied embedding, too).
FP8_SKIPPED = ("lm_head",)


def pack_cpu_linears(model: nn.Module, quantization: str | None = None) -> int:
    """Route the model's fp32, bf16 and fp16 CPU linear layers through packed weights; -> how many.
    fp32 layers stay on ``F.linear`` when the fp32 GEMM is unavailable (not built,
    ``TRILLM_NO_EXTENSIONS=1``, no AVX2/FMA), bf16 ones when neither bf16 GEMM is (the same, or
    neither AVX512-BF16 nor AVX2/F16C). ``quantization="fp8"``: every linear but
    ``FP8_SKIPPED`` is quantized to fp8 e4m3 with per-channel scales
    (``kernels/linear_fp8_cpu.py``; its portable path where the native kernel is unavailable)."""
    # gguf / awq / gptq: the quantized layers have their own kernel (quantized_linear.py)
    if quantization not in (None, "fp8", "gguf", "awq", "gptq"):
        raise ValueError(f"pack_cpu_linears: unknown quantization {quantization!r}.")
    shared = _shared_weights(model)
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or _left_alone(module):
            continue
        with torch.no_grad():
            if quantization == "fp8" and name.rsplit(".", 1)[-1] not in FP8_SKIPPED:
                _quantize_fp8(module)
                count += 1
            elif _pack_fp32(module) or _pack_bf16(module) or _pack_fp16(module):
                count += 1
                if not _keeps_original(module, shared):
                    _drop_original(module)
    return count


# A layer the model reads as a tensor and never calls (MLA's kv_b_proj, absorbed into the
# attention): a packed copy would go unused and its original must stay.
_UNPACKED = "trillm_leave_unpacked"


def leave_unpacked(module: nn.Linear) -> nn.Linear:
    """Mark ``module`` for ``pack_cpu_linears`` to leave as it is (its weight read as a tensor)."""
    setattr(module, _UNPACKED, True)
    return module


def _left_alone(module: nn.Linear) -> bool:
    # GGUF / AWQ / GPTQ-quantized layers have their own kernel (quantized_linear.py)
    return hasattr(module, "quantized_weight") or getattr(module, _UNPACKED, False)


def _shared_weights(model: nn.Module) -> set[int]:
    """ids of the parameters two modules hold (a head tied to its embedding)."""
    seen: set[int] = set()
    shared: set[int] = set()
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                (shared if id(param) in seen else seen).add(id(param))
    return shared


def _keeps_original(module: nn.Linear, shared: set[int]) -> bool:
    """Whether a packed layer keeps its original weight: another module holds it (the embedding
    a head is tied to reads its rows), or torch's AMX GEMM takes its calls of many rows."""
    amx = getattr(module.forward, "__func__", None) is _packed_forward_bf16
    return id(module.weight) in shared or (amx and linear_cpu.bf16_kernel_max_rows() is not None)


def _drop_original(module: nn.Linear) -> None:
    """The packed copy becomes the only one. The weight is left an empty parameter of its dtype:
    what reads ``.weight.dtype`` still can, what reads its values fails loudly."""
    empty = torch.empty(0, dtype=module.weight.dtype)
    module.weight = nn.Parameter(empty, requires_grad=False)
