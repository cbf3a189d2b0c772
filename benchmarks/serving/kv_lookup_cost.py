"""Cost of the shared-storage connector's scheduler-side lookup (it runs on the engine loop):
the whole-file read and digest check the lookup did before (``read_file``) against the header
read it does now (``read_header``), for stored prompts of ``--tokens`` tokens at the benchmark
Llama's 16,384 file bytes per token. Files are written to a temporary folder (the page cache
holds them: the figures are the lookup's CPU and copy cost, a cold disk adds its reads).

    python benchmarks/serving/kv_lookup_cost.py [--tokens 1000 8000] [--repeats 7]
        [--out benchmarks/serving/results/kv_lookup_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: trillm

from trillm.kv_transfer.storage import Header, payload_digest, read_file, read_header, write_file

BYTES_PER_TOKEN = 16384  # the benchmark Llama's, measured by kv_transfer_ttft.py
IDENTITY = "bench"


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        assert fn() is not None
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(tokens: int, folder: str, repeats: int) -> dict[str, float]:
    payload = os.urandom(tokens * BYTES_PER_TOKEN)
    digest = payload_digest(payload)
    header = Header(IDENTITY, tokens, 16, 2, [8, 64], "torch.float16", len(payload), digest)
    path = os.path.join(folder, f"{tokens}.kv")
    write_file(path, header, payload)
    return {
        "tokens": tokens,
        "file_bytes": os.path.getsize(path),
        "whole_file_ms": _median_ms(lambda: read_file(path, IDENTITY, tokens), repeats),
        "header_ms": _median_ms(lambda: read_header(path, IDENTITY, tokens), repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1000, 8000])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/serving/results/kv_lookup_cost.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        rows = [measure(n, folder, args.repeats) for n in args.tokens]
    for row in rows:
        print(json.dumps(row))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"bytes_per_token": BYTES_PER_TOKEN, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
