"""TTFT of a decode instance (kv_consumer of vLLM's SharedStorageConnector) when the prompt's
KV is loaded from the prefill instance's file ("transfer") against computing it ("recompute").

Starts ``trillm serve`` twice on the benchmark Llama (benchmarks/common.py), a kv_producer and a
kv_consumer sharing a folder. Each round takes two fresh random prompts of ``--prompt-len``
tokens (fresh: no prefix-cache hit on either instance): the first goes to the prefill instance
(max_tokens 1, which stores its KV) and then, streamed, to the decode instance; the second goes
streamed to the decode instance only. TTFT is the time from sending the request to its first
streamed token; the order of the two alternates by round (a shared, loaded machine). Also
reported: the stored bytes per token and the decode instance's
``vllm:external_prefix_cache_hits``.

    python benchmarks/serving/kv_transfer_ttft.py [--rounds 8] [--prompt-len 1000]
        [--out benchmarks/serving/results/kv_transfer_ttft.json]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*

from benchmarks.common import build_bench_model, machine_info, print_table, write_json
from benchmarks.serving import kv_ttft

SERVER_ARGS = ["--max-model-len", "1024", "--kv-cache-memory", "256MiB", "--block-size", "16"]


def run(rounds: int, prompt_len: int) -> dict[str, Any]:
    model = str(build_bench_model())
    rng = random.Random(0)
    folder = tempfile.mkdtemp(prefix="kv-ttft-")
    prefill_kv, decode_kv, _ = kv_ttft.kv_configs("shared_storage", folder)
    args = [*SERVER_ARGS, "--served-model-name", "m"]
    rows = []
    with kv_ttft.prefill_decode(model, args, prefill_kv, decode_kv) as (prefill, decode):
        kv_ttft.ttft_s(decode, [5] * 32)  # warm-up: first-step costs out of the figures
        for i in range(rounds):
            stored, fresh = kv_ttft.random_prompts(rng, prompt_len, 2)
            kv_ttft.complete(prefill, stored)
            order = [("transfer", stored), ("recompute", fresh)]
            times = {name: kv_ttft.ttft_s(decode, p) for name, p in kv_ttft.alternating(i, order)}
            rows.append({"round": i, **times, "ratio": times["transfer"] / times["recompute"]})
        hits = kv_ttft.metric(decode, "vllm:external_prefix_cache_hits_total")
    files = [os.path.join(folder, f) for f in os.listdir(folder)]
    stored_tokens = (prompt_len - 1) // 16 * 16
    bytes_per_token = statistics.mean(os.path.getsize(f) for f in files) / stored_tokens
    return {
        "machine": machine_info(),
        "prompt_len": prompt_len,
        "rounds": rows,
        "median_ttft_transfer_s": statistics.median(r["transfer"] for r in rows),
        "median_ttft_recompute_s": statistics.median(r["recompute"] for r in rows),
        "median_ratio": statistics.median(r["ratio"] for r in rows),
        "file_bytes_per_token": bytes_per_token,
        "external_prefix_cache_hits": hits,
        "stored_tokens_per_prompt": stored_tokens,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    result = run(args.rounds, args.prompt_len)
    print_table(
        result["rounds"],
        [("round", "d"), ("transfer", ".3f"), ("recompute", ".3f"), ("ratio", ".2f")],
    )
    print(
        f"median TTFT transfer {result['median_ttft_transfer_s']:.3f} s, recompute "
        f"{result['median_ttft_recompute_s']:.3f} s, ratio {result['median_ratio']:.2f}; "
        f"{result['file_bytes_per_token']:.0f} file bytes per token; "
        f"{result['external_prefix_cache_hits']:.0f} tokens loaded"
    )
    write_json(args.out, result)


if __name__ == "__main__":
    main()
