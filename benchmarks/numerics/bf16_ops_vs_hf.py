"""Each bf16 op on transformers' own inputs: forward hooks on transformers' bf16
eager model capture every RMSNorm's and linear's input and output (the first chat prompt's
prefill, then one decode step); trillm's ``rms_norm``, its bf16 GEMM kernel (``linear_bf16``,
what trillm runs at <= 8 rows on a CPU with AMX) and torch's ``F.linear`` (what it runs above)
recompute them. Prints the outputs that differ, per 10,000, for layers 0, 7, 15 and 29.

    python benchmarks/numerics/bf16_ops_vs_hf.py --model ~/.cache/trillm-peer/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.numerics.bf16_vs_hf import PROMPTS, chat_ids  # noqa: E402
from trillm.kernels import linear_cpu  # noqa: E402
from trillm.kernels.dispatch import rms_norm  # noqa: E402

LAYERS = [0, 7, 15, 29]
LINEARS = {
    "q": "self_attn.q_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "down": "mlp.down_proj",
}


def per_10k(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"{(a != b).float().mean().item() * 1e4:.2f}"


def capture(model: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (input [rows, K], output [rows, N]) of the latest call, via forward hooks."""
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(name: str) -> Any:
        def f(module: Any, args: Any, out: Any) -> None:
            x = args[0]
            seen[name] = (x.reshape(-1, x.shape[-1]).clone(), out.reshape(-1, out.shape[-1]))

        return f

    for i in LAYERS:
        layer = model.model.layers[i]
        layer.input_layernorm.register_forward_hook(hook(f"{i}.norm"))
        for short, path in LINEARS.items():
            layer.get_submodule(path).register_forward_hook(hook(f"{i}.{short}"))
    return seen


def report(model: Any, seen: dict[str, tuple[torch.Tensor, torch.Tensor]], tag: str) -> None:
    print(f"{tag} (outputs that differ per 10,000)")
    for i in LAYERS:
        layer = model.model.layers[i]
        norm = layer.input_layernorm
        x, want = seen[f"{i}.norm"]
        row = {"rms_norm": per_10k(rms_norm(x, norm.weight, norm.variance_epsilon), want)}
        for short, path in LINEARS.items():
            weight = layer.get_submodule(path).weight.data
            x, want = seen[f"{i}.{short}"]
            if linear_cpu.available_bf16():
                packed = linear_cpu.PackedWeightBf16(weight)
                row[f"{short} kernel"] = per_10k(linear_cpu.linear_bf16(x, packed), want)
            row[f"{short} F.linear"] = per_10k(F.linear(x, weight), want)
        print(f"  layer {i}: " + ", ".join(f"{k} {v}" for k, v in row.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    path = str(Path(args.model).expanduser())
    ids = chat_ids(AutoTokenizer.from_pretrained(path), PROMPTS[0])
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    seen = capture(model)
    cache = DynamicCache()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        report(model, seen, f"prefill, {len(ids)} rows")
        model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
        report(model, seen, "decode, 1 row")


if __name__ == "__main__":
    main()
