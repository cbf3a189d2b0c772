"""TTFT of a decode instance at 1,024- and 8,192-token prompts, with the prompt's KV moved from a
prefill instance ("transfer") against computing it ("recompute"), for both of trillm's KV
connectors: vLLM's SharedStorageConnector (a folder) and its P2pNcclConnector (TCP: "GET",
and with ``--connectors p2p_put p2p_put_async`` its push modes "PUT" and "PUT_ASYNC").

The model is a random 2-layer Llama small enough that an 8,192-token prefill fits a loaded
2-core host (hidden 256, 4 heads of 64, 2 KV heads, intermediate 688, vocab 4,096, fp32:
2,048 KV bytes per token). For each connector, a kv_producer and a kv_consumer ``trillm serve``
start; each round takes two fresh random prompts: the first goes to the prefill instance
(max_tokens 1, which stores or serves its KV) and then, streamed, to the decode instance; the
second goes streamed to the decode instance only. With P2pNcclConnector both requests carry
vLLM's proxy request id naming the prefill and decode instances' kv_ip:kv_port. TTFT is the
time from sending the request to its first streamed token; the order of the two alternates by
round.

    python benchmarks/serving/pd_ttft.py [--rounds 3] [--lengths 1024 8192]
        [--connectors shared_storage p2p p2p_put p2p_put_async]
        [--out benchmarks/serving/results/pd_ttft.json]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*

from benchmarks.common import machine_info, print_table, write_json
from benchmarks.serving import kv_ttft

MODEL_SPEC = dict(
    hidden_size=256,
    num_hidden_layers=2,
    intermediate_size=688,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=4096,
    max_position_embeddings=8448,
)
SERVER_ARGS = ["--max-model-len", "8448", "--kv-cache-memory", "96MiB", "--block-size", "16"]
SERVER_ARGS += ["--served-model-name", "m"]


def build_model() -> str:
    from trillm.testing.tiny_models import build_tiny_model

    folder = Path(tempfile.gettempdir()) / "trillm-pd-ttft-model"
    if not (folder / "model.safetensors").is_file():
        build_tiny_model("llama", folder, **MODEL_SPEC)
    return str(folder)


def run(connector: str, model: str, rounds: int, lengths: list[int]) -> dict[str, Any]:
    rng = random.Random(0)
    prefill_kv, decode_kv, rid_head = kv_ttft.kv_configs(connector)
    rows = []
    with kv_ttft.prefill_decode(model, SERVER_ARGS, prefill_kv, decode_kv) as (prefill, decode):
        kv_ttft.ttft_s(decode, [5] * 32, None, 600)  # warm-up: first-step costs out of the figures
        for n in lengths:
            for i in range(rounds):
                moved, fresh = kv_ttft.random_prompts(rng, n, 2)
                rid = None if rid_head is None else rid_head + uuid.uuid4().hex
                kv_ttft.complete(prefill, moved, 600, request_id=rid)
                order = [("transfer", moved, rid), ("recompute", fresh, None)]
                times = {
                    name: kv_ttft.ttft_s(decode, p, r, 600)
                    for name, p, r in kv_ttft.alternating(i, order)
                }
                ratio = times["transfer"] / times["recompute"]
                rows.append({"connector": connector, "prompt_len": n, **times, "ratio": ratio})
        hits = kv_ttft.metric(decode, "vllm:external_prefix_cache_hits_total")
    return {"rows": rows, "external_prefix_cache_hits": hits}


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = sorted({(r["connector"], r["prompt_len"]) for r in rows})
    out = []
    for connector, n in keys:
        mine = [r for r in rows if (r["connector"], r["prompt_len"]) == (connector, n)]
        transfer = statistics.median(r["transfer"] for r in mine)
        recompute = statistics.median(r["recompute"] for r in mine)
        out.append(
            {
                "connector": connector,
                "prompt_len": n,
                "transfer": transfer,
                "recompute": recompute,
                "ratio": transfer / recompute,
            }
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--connectors", nargs="+", default=["shared_storage", "p2p"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    model = build_model()
    result: dict[str, Any] = {"machine": machine_info(), "model": MODEL_SPEC, "rows": []}
    for connector in args.connectors:
        one = run(connector, model, args.rounds, args.lengths)
        result["rows"] += one["rows"]
        result[f"{connector}_external_prefix_cache_hits"] = one["external_prefix_cache_hits"]
    result["medians"] = summary(result["rows"])
    columns = [("connector", "s"), ("prompt_len", "d"), ("transfer", ".3f")]
    columns += [("recompute", ".3f"), ("ratio", ".3f")]
    print_table(result["rows"], columns)
    print("medians:")
    print_table(result["medians"], columns)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
