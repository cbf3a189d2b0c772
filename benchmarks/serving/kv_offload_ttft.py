"""TTFT of a repeated prefix that other traffic evicted from a small KV cache: loaded from the KV
offload tier (``--kv-offloading-size``) against computed again (the same server without it).

Starts ``trillm serve`` twice on the benchmark Llama (benchmarks/common.py), with the same small
KV cache (``--kv-cache-memory 24MiB``: 96 blocks, 1,536 tokens), one with a 1 GiB offload tier.
Each round sends a fresh random prompt of ``--prompt-len`` tokens (max_tokens 1), then
``--evictors`` other fresh prompts of the same length (which take every block of the cache),
then the first prompt again, streamed: its TTFT (request sent to first streamed token) is the
figure. Both servers get the same prompts; which goes first alternates by round (a shared,
loaded machine). Also reported: the offload server's ``vllm:prompt_tokens_by_source`` and
``vllm:external_prefix_cache_hits``, and the plain server's ``vllm:prefix_cache_hits`` (0: the
repeat found nothing in its cache).

    python benchmarks/serving/kv_offload_ttft.py [--rounds 5] [--prompt-len 1000]
        [--out benchmarks/serving/results/kv_offload_ttft.json]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*

from benchmarks.common import (
    build_bench_model,
    machine_info,
    print_table,
    trillm_server,
    write_json,
)
from benchmarks.serving import kv_ttft

SERVER_ARGS = ["--max-model-len", "1024", "--kv-cache-memory", "24MiB", "--block-size", "16"]
OFFLOAD_GIB = "1"


def one_round(url: str, prompts: list[list[int]]) -> float:
    """The first prompt, the evictors (max_tokens 1), then the first again: -> its TTFT."""
    for prompt in prompts:
        kv_ttft.complete(url, prompt)
    return kv_ttft.ttft_s(url, prompts[0])


def run(rounds: int, prompt_len: int, evictors: int) -> dict[str, Any]:
    model = str(build_bench_model())
    rng = random.Random(0)
    args = [*SERVER_ARGS, "--served-model-name", "m"]
    rows = []
    with (
        trillm_server(model, [*args, "--kv-offloading-size", OFFLOAD_GIB]) as (offload, _),
        trillm_server(model, args) as (plain, _),
    ):
        for url in (offload, plain):
            kv_ttft.ttft_s(url, [5] * 32)  # warm-up: first-step costs out of the figures
        for i in range(rounds):
            prompts = kv_ttft.random_prompts(rng, prompt_len, 1 + evictors)
            order = [("offload", offload), ("recompute", plain)]
            times = {name: one_round(url, prompts) for name, url in kv_ttft.alternating(i, order)}
            rows.append({"round": i, **times, "ratio": times["offload"] / times["recompute"]})
        by_source = kv_ttft.metrics(offload, "vllm:prompt_tokens_by_source_total")
        hits = kv_ttft.metrics(offload, "vllm:external_prefix_cache_hits_total")
        plain_hits = kv_ttft.metrics(plain, "vllm:prefix_cache_hits_total")
    return {
        "machine": machine_info(),
        "prompt_len": prompt_len,
        "evictors": evictors,
        "server_args": SERVER_ARGS,
        "kv_offloading_size_gib": float(OFFLOAD_GIB),
        "rounds": rows,
        "median_ttft_offload_s": statistics.median(r["offload"] for r in rows),
        "median_ttft_recompute_s": statistics.median(r["recompute"] for r in rows),
        "median_ratio": statistics.median(r["ratio"] for r in rows),
        "offload_prompt_tokens_by_source": by_source,
        "offload_external_prefix_cache_hits": sum(hits.values()),
        "plain_prefix_cache_hits": sum(plain_hits.values()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--evictors", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    result = run(args.rounds, args.prompt_len, args.evictors)
    print_table(
        result["rounds"],
        [("round", "d"), ("offload", ".3f"), ("recompute", ".3f"), ("ratio", ".2f")],
    )
    print(
        f"median TTFT offload {result['median_ttft_offload_s']:.3f} s, recompute "
        f"{result['median_ttft_recompute_s']:.3f} s, ratio {result['median_ratio']:.2f}; "
        f"offload server {result['offload_external_prefix_cache_hits']:.0f} tokens loaded, "
        f"by source {result['offload_prompt_tokens_by_source']}; plain server "
        f"{result['plain_prefix_cache_hits']:.0f} prefix-cache hits"
    )
    write_json(args.out, result)


if __name__ == "__main__":
    main()
