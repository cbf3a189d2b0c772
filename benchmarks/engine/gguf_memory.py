"""Bytes of a loaded GGUF model in llama.cpp's mixed ``Q4_K_M`` layout: kept quantized, against
the same model loaded all-fp32 (``dequantize_gguf``).

The file: a random Llama of the given shape (``tiny_models.build_tiny_model``) written as
``Q4_K_M`` stores it (``trillm/testing/gguf_models.py``, random K-quant blocks): projections
Q4_K, ``attn_v`` and ``ffn_down`` Q6_K in every other layer (llama.cpp gives more layers the
extra bits at the ends; the mix per layer is what matters here), the output Q6_K, the embedding
Q4_K. So qkv mixes Q4_K and Q6_K in half the layers.

    python benchmarks/engine/gguf_memory.py --hidden 1024 --intermediate 2816 --layers 4 \
        --out results/gguf_memory_q4_k_m.json

Bytes: every parameter and buffer of the model, plus each kept layer's packed blocks; "mixed
layers as fp32" is what the loader held before stacked layers mixing types stayed quantized
(those layers' blocks counted as fp32 weights instead).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

import torch

from benchmarks import common  # noqa: F401 - puts the repository root on sys.path
from trillm.config import EngineArgs
from trillm.kernels import linear_q_cpu
from trillm.model_executor.loader import build_model
from trillm.model_executor.model_config import load_model_config
from trillm.testing.gguf_models import write_tiny_gguf
from trillm.testing.tiny_models import build_tiny_model


def q4_k_m_types(layers: int) -> dict[str, str]:
    types = dict.fromkeys(
        (
            "attn_q",
            "attn_k",
            "attn_v",
            "attn_output",
            "ffn_gate",
            "ffn_up",
            "ffn_down",
            "token_embd",
        ),
        "Q4_K",
    )
    types["output"] = "Q6_K"
    for i in range(0, layers, 2):
        types[f"blk.{i}.attn_v"] = types[f"blk.{i}.ffn_down"] = "Q6_K"
    return types


def model_bytes(path: Path, dequantize: bool) -> tuple[int, int]:
    """(bytes held, bytes the mixed-type layers' blocks take) of the loaded model."""
    cfg = load_model_config(EngineArgs(model=str(path), device="cpu", dequantize_gguf=dequantize))
    model = build_model(cfg, None, "cpu")
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    mixed_blocks = mixed_fp32 = 0
    for module in model.modules():
        weight = getattr(module, "quantized_weight", None)
        if weight is None:
            continue
        total += weight.nbytes
        if isinstance(weight, linear_q_cpu.StackedQuantizedWeight):
            mixed_blocks += weight.nbytes
            mixed_fp32 += 4 * weight.out_features * weight.in_features
    return total, mixed_fp32 - mixed_blocks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        hf = build_tiny_model(
            "llama",
            Path(tmp) / "hf",
            hidden_size=args.hidden,
            intermediate_size=args.intermediate,
            head_dim=64,
            num_attention_heads=args.hidden // 64,
            num_key_value_heads=4,
            num_hidden_layers=args.layers,
        )
        path = write_tiny_gguf(hf, Path(tmp) / "gguf", q4_k_m_types(args.layers))
        file_bytes = path.stat().st_size
        kept, extra = model_bytes(path, dequantize=False)
        fp32, _ = model_bytes(path, dequantize=True)
    rows = {
        "GGUF file": file_bytes,
        "kept quantized": kept,
        "mixed layers as fp32 (before)": kept + extra,
        "all fp32 (dequantize_gguf)": fp32,
    }
    for name, size in rows.items():
        print(f"{name:<32} {size / 2**20:9.1f} MiB  {size / fp32:6.1%} of fp32")
    if args.out:
        args.out.write_text(
            json.dumps({**vars(args), "out": str(args.out), "bytes": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
