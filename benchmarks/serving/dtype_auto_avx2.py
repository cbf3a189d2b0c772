"""What ``--dtype auto`` should pick for a bf16 checkpoint on this CPU: the same checkpoint in
fp32 and in bf16, each held by its own child process (``LLM``, uni executor), the workloads run
ALTERNATELY (fp32, bf16, fp32, bf16, ...) so that a shared machine's load falls on both alike.

    nice -n 5 python benchmarks/serving/dtype_auto_avx2.py \
        --model ~/.cache/trillm-bench/llama-3.2-1b --rounds 3 \
        --out benchmarks/serving/results/dtype_auto_avx2_20261207.json

Per round and dtype: batch-1 decode tokens/s (``--decode-tokens`` after an 8-token prompt:
(t(n) - t(1)) / (n - 1) per step, the prompt cancels), the same at batch 16, the TTFT of one
``--prefill-len``-token prompt, and the child's resident memory (VmRSS, VmHWM). The result
gives each run and the median bf16 / fp32 ratio of each figure.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

from benchmarks import common  # noqa: E402

DTYPES = ("float32", "bfloat16")


def _memory() -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = round(int(value.split()[0]) / 2**20, 2)  # GiB
    return out


def _child(conn: Connection, model: str, dtype: str, max_len: int) -> None:
    import torch

    from trillm import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, max_model_len=max_len, distributed_executor_backend="uni")
    g = torch.Generator().manual_seed(0)

    def run(batch: int, length: int, tokens: int) -> float:
        prompts = [torch.randint(100, 40000, (length,), generator=g).tolist() for _ in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t

    run(1, 8, 2)  # warm-up
    conn.send(_memory())
    while (job := conn.recv()) is not None:
        batch, length, tokens = job
        if tokens == 1:
            conn.send({"ttft_s": run(batch, length, 1)})
            continue
        one, many = run(batch, length, 1), run(batch, length, tokens)
        step = (many - one) / (tokens - 1)
        conn.send({"step_ms": step * 1e3, "tok_s": batch / step, **_memory()})
    conn.send(_memory())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    children: dict[str, tuple[Any, Connection]] = {}
    result: dict[str, Any] = {"model": str(args.model), "machine": common.machine_info()}
    for dtype in DTYPES:
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_child,
            args=(child, str(args.model.expanduser()), dtype, args.prefill_len + 128),
        )
        proc.start()
        children[dtype] = (proc, parent)
        result[f"loaded_{dtype}"] = parent.recv()  # one load at a time: the memory peaks apart
    jobs = {
        "decode_b1": (1, 8, args.decode_tokens),
        "decode_b16": (16, 8, args.decode_tokens),
        "prefill": (1, args.prefill_len, 1),
    }
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for name, job in jobs.items():
            for dtype in DTYPES if r % 2 == 0 else DTYPES[::-1]:
                conn = children[dtype][1]
                conn.send(job)
                row = {"round": r, "job": name, "dtype": dtype, **conn.recv()}
                row["load1"] = os.getloadavg()[0]
                runs.append(row)
                print(row, flush=True)
                result["runs"] = runs
                common.write_json(args.out, result)
    for dtype, (proc, conn) in children.items():
        conn.send(None)
        result[f"end_{dtype}"] = conn.recv()
        proc.join()
    result["median_bf16_over_fp32"] = _ratios(runs)
    common.write_json(args.out, result)
    print(result["median_bf16_over_fp32"])


def _ratios(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per job, the median over rounds of bf16's figure / fp32's (tokens/s, or TTFT)."""
    out = {}
    for job in ("decode_b1", "decode_b16", "prefill"):
        key = "ttft_s" if job == "prefill" else "tok_s"
        by_round: dict[int, dict[str, float]] = {}
        for row in runs:
            if row["job"] == job:
                by_round.setdefault(row["round"], {})[row["dtype"]] = row[key]
        pairs = [v["bfloat16"] / v["float32"] for v in by_round.values() if len(v) == 2]
        if pairs:
            out[f"{job}_{key}"] = round(statistics.median(pairs), 3)
    return out


if __name__ == "__main__":
    main()
