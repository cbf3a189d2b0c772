"""The packed copy of a CPU linear layer's weight is its only copy (``layers/linear.py``): a loaded
model holds its checkpoint's bytes once, a head tied to its embedding keeps the embedding's rows
(and the tie), the originals come back exactly from the packed copies where torch's GEMM needs
them, and a layer the model reads as a tensor is left unpacked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from trillm._native import cpu_kernels
from trillm.config import EngineArgs
from trillm.kernels import linear_bf16_avx2_cpu, linear_cpu, linear_fp16_cpu
from trillm.model_executor.layers import linear as linear_layers
from trillm.model_executor.loader import build_model
from trillm.model_executor.model_config import load_model_config
from trillm.testing.tiny_models import build_tiny_model

needs_kernels = pytest.mark.skipif(
    not (linear_cpu.available() and linear_fp16_cpu.available()),
    reason="trillm._ext.cpu_kernels is not built or this CPU lacks AVX2/FMA/F16C",
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):  # qwen2: lm_head tied to embed_tokens
    return build_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2"))


def _load(path, dtype: str) -> nn.Module:
    cfg = load_model_config(EngineArgs(model=str(path), device="cpu", dtype=dtype))
    return build_model(cfg, None, "cpu")


def _checkpoint(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def _held_bytes(model: nn.Module) -> int:
    """Bytes of the parameters' distinct storages plus the packed copies."""
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()
    }
    packed = [m.packed_weight.data for m in model.modules() if hasattr(m, "packed_weight")]
    return sum(storages.values()) + sum(t.numel() * t.element_size() for t in packed)


def _dense_bytes(path, dtype: torch.dtype) -> int:
    """What the checkpoint's tensors take in ``dtype``: one copy of every weight."""
    return sum(t.numel() for t in _checkpoint(path).values()) * dtype.itemsize


def _packed_linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear) and hasattr(m, "packed_weight")]


def _amx_keeps_originals(dtype: torch.dtype) -> bool:
    # With AMX-BF16 torch's GEMM takes bf16 calls of many rows: those layers keep the original
    return dtype == torch.bfloat16 and linear_cpu.bf16_kernel_max_rows() is not None


@needs_kernels
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_loaded_model_holds_one_copy_of_its_linear_weights(llama_dir, dtype):
    model = _load(llama_dir, dtype)
    linears = _packed_linears(model)
    assert len(linears) == 2 * 4 + 1  # per layer qkv, o, gate_up, down; the head
    if _amx_keeps_originals(DTYPES[dtype]):
        assert all(m.weight.shape == (m.out_features, m.in_features) for m in linears)
        return
    assert all(m.weight.numel() == 0 and m.weight.dtype == DTYPES[dtype] for m in linears)
    # Panels pad N to a multiple of 16 (64 for AVX512-BF16); these shapes need none. Two
    # copies would be ~1.9x: the linears are most of the model's bytes.
    assert _held_bytes(model) == _dense_bytes(llama_dir, DTYPES[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tied_head_keeps_the_embedding_it_shares(tied_dir, dtype):
    model = _load(tied_dir, dtype)
    embed, head = model.model.embed_tokens, model.lm_head
    assert hasattr(head, "packed_weight") and head.weight is embed.weight
    rows = _checkpoint(tied_dir)["model.embed_tokens.weight"].to(DTYPES[dtype])
    ids = torch.tensor([0, 7, 4095, 7])
    with torch.inference_mode():
        assert torch.equal(embed(ids), rows[ids])
        hidden = torch.randn(3, rows.shape[1]).to(DTYPES[dtype])
        torch.testing.assert_close(head(hidden), F.linear(hidden, rows), rtol=2**-7, atol=1e-3)
    # The embedding once, the head's packed copy beside it; every other linear packed only
    # (unless AMX keeps bf16 originals).
    head_bytes = head.packed_weight.data.numel() * DTYPES[dtype].itemsize
    if not _amx_keeps_originals(DTYPES[dtype]):
        assert _held_bytes(model) == _dense_bytes(tied_dir, DTYPES[dtype]) + head_bytes


def _packed(kind: str, weight: torch.Tensor):
    if kind != "avx512_bf16":
        return {"fp32": linear_cpu.PackedWeight, "fp16": linear_fp16_cpu.PackedWeightFp16}.get(
            kind, linear_bf16_avx2_cpu.PackedWeightBf16Avx2
        )(weight)
    # This layout's pack is plain C++ (any CPU); only its kernel needs AVX512-BF16.
    ext = cpu_kernels("gemm_bf16")
    if ext is None:
        pytest.skip("trillm._ext.cpu_kernels is not built")
    packed = object.__new__(linear_cpu.PackedWeightBf16)
    packed.out_features, packed.in_features = weight.shape
    packed.panel = ext.PANEL
    packed.data = torch.empty(ext.packed_size(*weight.shape), dtype=torch.bfloat16)
    ext.pack(weight.data_ptr(), *weight.shape, weight.stride(0), packed.data.data_ptr())
    return packed


@needs_kernels
@pytest.mark.parametrize(
    ("kind", "dtype"),
    [
        ("fp32", torch.float32),
        ("fp16", torch.float16),
        ("bf16_avx2", torch.bfloat16),
        ("avx512_bf16", torch.bfloat16),
    ],
)
@pytest.mark.parametrize("shape", [(37, 19), (64, 32), (1, 1)])
def test_unpack_gives_the_weight_back_exactly(kind, dtype, shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = _packed(kind, weight).unpack()
    assert got.dtype == dtype and torch.equal(got, weight)


@needs_kernels
def test_a_layer_read_as_a_tensor_is_left_unpacked():
    model = nn.Sequential(nn.Linear(32, 48), linear_layers.leave_unpacked(nn.Linear(48, 16)))
    weight = model[1].weight
    assert linear_layers.pack_cpu_linears(model.eval()) == 1
    assert hasattr(model[0], "packed_weight") and model[0].weight.numel() == 0
    assert not hasattr(model[1], "packed_weight") and model[1].weight is weight
