"""``--dtype auto`` on CPU (trillm/model_executor/dtype_choice.py): a bf16 / fp16 checkpoint runs
in bfloat16 where the CPU has bf16 instructions (AVX512-BF16 / AMX), else in float32 -- on an
AVX2-only CPU too, where trillm's AVX2 bf16 GEMM exists but measured slower than float32 at
batch-16 decode and in a long prefill (benchmarks/serving/dtype_auto_avx2.py), and the log line
says so; a float32 checkpoint stays float32. Both capability probes are monkeypatched each way,
so the choice is tested on any host."""

from __future__ import annotations

import logging

import pytest

from trillm.kernels import linear_bf16_avx2_cpu
from trillm.model_executor import dtype_choice
from trillm.model_executor.dtype_choice import cpu_bf16_gemm, resolve_dtype

CASES = [  # (bf16 instructions, the AVX2 bf16 kernel built and usable) -> cpu_bf16_gemm()
    (True, True, "native"),
    (True, False, "native"),
    (False, True, "avx2"),
    (False, False, None),
]


@pytest.fixture
def cpu(monkeypatch):
    def set_cpu(instructions: bool, avx2_kernel: bool) -> None:
        monkeypatch.setattr(dtype_choice, "cpu_supports_bf16", lambda: instructions)
        monkeypatch.setattr(linear_bf16_avx2_cpu, "available", lambda: avx2_kernel)

    return set_cpu


@pytest.mark.parametrize(("instructions", "avx2_kernel", "gemm"), CASES)
def test_the_probe_names_the_bf16_gemm(cpu, instructions, avx2_kernel, gemm):
    cpu(instructions, avx2_kernel)
    assert cpu_bf16_gemm() == gemm


@pytest.mark.parametrize("checkpoint", ["bfloat16", "float16"])
@pytest.mark.parametrize(("instructions", "avx2_kernel", "gemm"), CASES)
def test_auto_runs_a_16_bit_checkpoint_in_bf16_only_with_bf16_instructions(
    cpu, caplog, checkpoint, instructions, avx2_kernel, gemm
):
    cpu(instructions, avx2_kernel)
    with caplog.at_level(logging.INFO, logger="trillm.model_executor.loader"):
        got = resolve_dtype("auto", checkpoint, "cpu")
    assert got == ("bfloat16" if gemm == "native" else "float32")
    assert f"dtype auto: the {checkpoint} checkpoint runs in {got}" in caplog.text
    if gemm == "avx2":  # the line says why the AVX2 bf16 GEMM is not taken
        assert "slower at batch 16" in caplog.text


@pytest.mark.parametrize(("instructions", "avx2_kernel", "gemm"), CASES)
def test_auto_keeps_a_float32_checkpoint_and_explicit_dtypes(cpu, instructions, avx2_kernel, gemm):
    cpu(instructions, avx2_kernel)
    assert resolve_dtype("auto", "float32", "cpu") == "float32"
    assert resolve_dtype("float32", "bfloat16", "cpu") == "float32"
    assert resolve_dtype("bfloat16", "float32", "cpu") == "bfloat16"
    assert resolve_dtype("float16", "bfloat16", "cpu") == "float16"


def _cpuinfo_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_the_bf16_probe_reads_this_cpu():
    """The probe itself, unpatched, against the kernel's own account of this CPU's flags (torch's
    capability string never names the bf16 extensions: read alone it said no on every host)."""
    from trillm.kernels import linear_cpu

    flags = _cpuinfo_flags()
    if not flags or not linear_cpu.native_available("cpu_kernels"):
        pytest.skip("needs /proc/cpuinfo and the native kernels")
    assert dtype_choice.cpu_supports_bf16() == ("avx512_bf16" in flags)
