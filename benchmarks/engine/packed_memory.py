"""Memory of a CPU model whose linear layers run on packed weights: the packed copy the only copy
(today's loader), against the originals kept beside the packed copies (``--keep-originals``:
what the loader held before).

    python benchmarks/engine/packed_memory.py --model ~/.cache/trillm-bench/llama-3.2-1b \
        --dtype float32 --out results/packed_memory_fp32.json [--keep-originals]

The model is loaded by ``trillm.LLM`` with its rank in this process (``uni``), a 16-block KV
cache, and greedy-generates from two prompts (tokens and logprobs go in the output: the two
runs must agree). Reported: bytes of the parameters (distinct storages) and of the packed
copies, and this process's resident memory (VmRSS) after generating.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

import torch

from benchmarks import common  # noqa: F401 - puts the repository root on sys.path
from trillm import LLM, SamplingParams
from trillm.model_executor import loader
from trillm.model_executor.layers import linear as linear_layers

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def model_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of the parameters' distinct storages, bytes of the packed copies)."""
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()
    }
    packed = [m.packed_weight.data for m in model.modules() if hasattr(m, "packed_weight")]
    return sum(storages.values()), sum(t.numel() * t.element_size() for t in packed)


def run(model_path: str, dtype: str, keep_originals: bool) -> dict[str, object]:
    loaded: list[torch.nn.Module] = []
    pack = loader.pack_cpu_linears

    def pack_and_keep(model: torch.nn.Module, quantization: str | None = None) -> int:
        loaded.append(model)
        return pack(model, quantization)

    loader.pack_cpu_linears = pack_and_keep  # type: ignore[assignment]
    if keep_originals:
        linear_layers._drop_original = lambda module: None  # type: ignore[assignment]
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=1)
    with LLM(
        model_path,
        dtype=dtype,
        device="cpu",
        distributed_executor_backend="uni",
        max_model_len=256,
        num_gpu_blocks_override=16,
    ) as llm:
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        param_bytes, packed_bytes = model_bytes(loaded[0])
        rss = rss_bytes()
    completions = [o.outputs[0] for o in outputs]
    return {
        "model": model_path,
        "dtype": dtype,
        "keep_originals": keep_originals,
        "param_bytes": param_bytes,
        "packed_bytes": packed_bytes,
        "weights_gib": round((param_bytes + packed_bytes) / 2**30, 3),
        "rss_gib": round(rss / 2**30, 3),
        "tokens": [list(c.token_ids) for c in completions],
        "logprobs": [
            [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] for c in completions
        ],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--keep-originals", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    result = run(str(Path(args.model).expanduser()), args.dtype, args.keep_originals)
    text = json.dumps(result)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
