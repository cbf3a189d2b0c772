"""The Triton kernels compile for a real GPU target (sm_90: Triton -> PTX -> cubin with the
bundled ptxas), without a GPU: catches what the CPU interpreter cannot (dot shapes and
precisions, constexpr branches, type promotion in the compiled dialect).

Run as a script it compiles and prints each kernel's resource use; the test runs the script
in a subprocess because kernels defined under TRITON_INTERPRET (other test modules) cannot be
compiled.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

_REPO_ROOT = Path(__file__).resolve().parents[2]
_INT_POINTERS = {
    "block_table_ptr",
    "query_start_ptr",
    "seq_lens_ptr",
    "tile_req_ptr",
    "tile_start_ptr",
}
_OTHER_TYPES = {
    "part_out_ptr": "*fp32",
    "part_lse_ptr": "*fp32",
    "slot_ptr": "*i64",
    "pos_ptr": "*i64",
    "cache_ptr": "*fp32",
    "scale_log2": "fp32",
    "eps": "fp32",
}


def _signature(fn, dtype: str, constexprs: dict) -> dict[str, str]:
    """Argument types by name: data pointers in ``dtype``, index tables int32, scalars int32."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in _OTHER_TYPES:
            sig[name] = _OTHER_TYPES[name]
        elif name in _INT_POINTERS:
            sig[name] = "*i32"
        elif name.endswith("_ptr"):
            sig[name] = "*" + dtype
        else:
            sig[name] = "i32"
    return sig


def _cases():
    from trillm.kernels import paged_attention_triton as pa
    from trillm.kernels import reshape_and_cache_triton as rc
    from trillm.kernels import rms_norm_triton as rn
    from trillm.kernels import rotary_triton as ro

    for dtype in ("bf16", "fp16"):
        # (group, head_dim, block_m, block_n, splits): prefill and decode tiles, GQA 4:1 at
        # D=128 (the engine's defaults), MHA at D=64, a padded D=24 with group 3, split-KV
        for group, head_dim, block_m, block_n, splits in (
            (4, 128, 64, 32, 1),
            (4, 128, 16, 32, 1),
            (1, 64, 64, 64, 1),
            (3, 24, 64, 64, 1),
            (4, 128, 16, 32, 4),
        ):
            group_pad = 1 << (group - 1).bit_length()
            consts = dict(
                GROUP=group,
                GROUP_PAD=group_pad,
                BLOCK_Q=block_m // group_pad,
                BLOCK_M=block_m,
                HEAD_DIM=head_dim,
                HEAD_DIM_PAD=max(16, 1 << (head_dim - 1).bit_length()),
                PAGE_SIZE=16,
                BLOCK_N=block_n,
                NUM_SPLITS=splits,
                DOT_PRECISION="tf32",
            )
            yield pa._paged_attention_kernel, dtype, consts, 8 if block_m >= 64 else 4
        merge = dict(NUM_SPLITS=4, SPLITS_PAD=4, HEAD_DIM=128, HEAD_DIM_PAD=128)
        yield pa._merge_splits_kernel, dtype, merge, 4
        for residual in (False, True):
            yield rn._rms_norm_kernel, dtype, dict(HAS_RESIDUAL=residual, BLOCK_H=4096), 8
        rotary = dict(HALF=64, BLOCK_HALF=64, BLOCK_QH=32, BLOCK_KH=8)
        yield ro._rotary_kernel, dtype, rotary, 4
        yield rc._reshape_and_cache_kernel, dtype, dict(BLOCK_HEADS=8, BLOCK_D=128), 4
    # fp32 attention uses IEEE dots (no TF32): one small case, the compile is slow
    fp32 = dict(
        GROUP=3,
        GROUP_PAD=4,
        BLOCK_Q=4,
        BLOCK_M=16,
        HEAD_DIM=24,
        HEAD_DIM_PAD=32,
        PAGE_SIZE=16,
        BLOCK_N=64,
        NUM_SPLITS=1,
        DOT_PRECISION="ieee",
    )
    yield pa._paged_attention_kernel, "fp32", fp32, 4


def _resource_usage(cubin: bytes) -> str:
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    return next((line.strip() for line in out.splitlines() if "REG:" in line), "?")


def compile_all() -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    for fn, dtype, consts, num_warps in _cases():
        src = ASTSource(fn=fn, signature=_signature(fn, dtype, consts), constexprs=consts)
        kernel = triton.compile(src, target=target, options={"num_warps": num_warps})
        shown = {k: v for k, v in consts.items() if k in ("GROUP", "HEAD_DIM", "BLOCK_M")}
        print(f"compiled {fn.__name__} {dtype} {shown}: {_resource_usage(kernel.asm['cubin'])}")
    return 0


def _nvidia_backend_present() -> bool:
    try:
        import triton
        from triton.backends import backends
    except ImportError:
        return False
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    return "nvidia" in backends and (ptxas.exists() or shutil.which("ptxas") is not None)


@pytest.mark.slow
@pytest.mark.skipif(not _nvidia_backend_present(), reason="triton's nvidia backend is absent")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, __file__],
        capture_output=True,
        text=True,
        env=env,
        cwd=_REPO_ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("compiled ") == sum(1 for _ in _cases()), result.stdout


if __name__ == "__main__":
    sys.exit(compile_all())
