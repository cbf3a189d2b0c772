"""trillm on a 1B-class checkpoint (``make_1b_checkpoints.py``) against this machine's limits:
decode ms/token at batch 1 and 16 against weight bytes / measured copy bandwidth, prefill TTFT
against torch's bf16 GEMM rate at the model's shapes. One process, ``LLM`` with the uni
executor; the load average is recorded before and after each phase (a shared machine: only
ratios within one run mean much). The JSON is rewritten after each phase, so a run cut short
keeps what it measured.

    nice -n 10 python benchmarks/serving/speed_1b.py --model ~/.cache/trillm-bench/llama-3.2-1b \
        --prefill-lens 1024 --out benchmarks/serving/results/speed_1b_llama_20261207.json

Decode ms/token is (time of ``n`` tokens - time of 1 token) / (n - 1): the prefill cancels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import common  # noqa: E402
from trillm import LLM, SamplingParams  # noqa: E402


def best_s(fn: Any, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def copy_gbps() -> float:
    """Bytes read + written per second by a 1 GiB fp32 copy (far beyond the caches)."""
    x = torch.empty(2**28, dtype=torch.float32).fill_(1.0)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / best_s(lambda: y.copy_(x)) / 1e9


def linear_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """[K, N] of one layer's projections (fused as trillm runs them) and the lm_head."""
    h, d, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    return {
        "qkv": (h, q + 2 * kv),
        "o": (q, h),
        "gate_up": (h, 2 * inter),
        "down": (inter, h),
        "lm_head": (h, cfg["vocab_size"]),
    }


def gemm_rates(cfg: dict[str, Any], rows: int) -> dict[str, dict[str, float]]:
    """GFLOP/s of F.linear at the model's shapes, bf16 and fp32, ``rows`` input rows."""
    out: dict[str, dict[str, float]] = {}
    for name, (k, n) in linear_shapes(cfg).items():
        if name == "lm_head":
            continue  # prefill runs it on the last token only
        out[name] = {}
        for dtype in (torch.bfloat16, torch.float32):
            x, w = torch.randn(rows, k).to(dtype), torch.randn(n, k).to(dtype)
            rate = 2 * rows * k * n / best_s(lambda x=x, w=w: F.linear(x, w), 1) / 1e9
            out[name][str(dtype).removeprefix("torch.")] = round(rate, 2)
    return out


def layer_flops_per_token(cfg: dict[str, Any]) -> int:
    return sum(2 * k * n for name, (k, n) in linear_shapes(cfg).items() if name != "lm_head")


def timed_generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--prefill-lens", type=int, nargs="*", default=[1024, 8192])
    p.add_argument("--decode-batches", type=int, nargs="*", default=[1, 16])
    p.add_argument("--decode-tokens", type=int, default=4, help="tokens of the long decode run")
    p.add_argument("--decode-prompt-len", type=int, default=4)
    p.add_argument("--gemm-rows", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16", help="trillm's --dtype (the checkpoint is bf16)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    folder = args.model.expanduser()
    cfg = json.loads((folder / "config.json").read_text())
    # the bf16 file's bytes, doubled when trillm runs it in fp32: what a decode step reads
    weight_bytes = (folder / "model.safetensors").stat().st_size * (
        2 if args.dtype == "float32" else 1
    )
    result: dict[str, Any] = {"model": str(folder), "dtype": args.dtype}
    result["machine"] = common.machine_info()
    result["threads"] = torch.get_num_threads()
    result["load_start"] = os.getloadavg()

    def save() -> None:
        common.write_json(args.out, result)

    result["copy_gbps_read_plus_write"] = round(copy_gbps(), 2)
    result["decode_bound_ms_per_step"] = round(
        weight_bytes / (result["copy_gbps_read_plus_write"] * 1e9) * 1e3, 1
    )
    if args.gemm_rows:  # 0: skip the GEMM rates (a second run of the same machine)
        result[f"gemm_gflops_rows{args.gemm_rows}"] = gemm_rates(cfg, args.gemm_rows)
    result["load_after_micro"] = os.getloadavg()
    save()
    max_len = max([*args.prefill_lens, 64]) + 16
    llm = LLM(
        str(folder), dtype=args.dtype, max_model_len=max_len, distributed_executor_backend="uni"
    )
    g = torch.Generator().manual_seed(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [torch.randint(100, 40000, (length,), generator=g).tolist() for _ in range(n)]

    timed_generate(llm, prompts(1, 8), 2)  # warm-up
    decode: dict[str, Any] = {}
    for batch in args.decode_batches:
        n = args.decode_tokens
        one = timed_generate(llm, prompts(batch, args.decode_prompt_len), 1)
        many = timed_generate(llm, prompts(batch, args.decode_prompt_len), n)
        step_ms = (many - one) / (n - 1) * 1e3
        decode[f"batch{batch}"] = {
            "step_ms": round(step_ms, 1),
            "ms_per_token": round(step_ms / batch, 1),
            "step_vs_bandwidth_bound": round(step_ms / result["decode_bound_ms_per_step"], 2),
            "load": os.getloadavg(),
        }
        result["decode"] = decode
        save()
    prefill: dict[str, Any] = {}
    for length in args.prefill_lens:
        ttft = timed_generate(llm, prompts(1, length), 1)
        flops = layer_flops_per_token(cfg) * cfg["num_hidden_layers"] * length
        prefill[str(length)] = {
            "ttft_s": round(ttft, 2),
            "linear_gflops_achieved": round(flops / ttft / 1e9, 2),
            "load": os.getloadavg(),
        }
        result["prefill"] = prefill
        save()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
