"""``trillm bench latency``: wall time of one batch (prefill + decode), offline engine."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from trillm.bench.datasets import build_random, find_tokenizer
from trillm.bench.engine_args import engine_kwargs_from_namespace, model_from_namespace

PERCENTILES = (10, 25, 50, 75, 90, 99)


def make_batch(args: argparse.Namespace) -> list[dict[str, list[int]]]:
    """--batch-size random token-id prompts of exactly --input-len tokens."""
    tokenizer = find_tokenizer(args.tokenizer, model_from_namespace(args))
    reqs = build_random(
        args.batch_size, args.input_len, args.output_len, seed=0, tokenizer=tokenizer
    )
    # NOTE: build_random without as_text returns token-id prompts.
    return [{"prompt_token_ids": r.prompt} for r in reqs if isinstance(r.prompt, list)]


def time_batch(llm: Any, prompts: list[dict[str, list[int]]], params: Any) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def latency_record(latencies: list[float]) -> dict[str, Any]:
    """vLLM's JSON: avg_latency, latencies, percentiles {"10": ..., "99": ...} (seconds)."""
    arr = np.asarray(latencies)
    return {
        "avg_latency": float(arr.mean()),
        "latencies": [float(x) for x in arr],
        "percentiles": {str(p): float(np.percentile(arr, p)) for p in PERCENTILES},
    }


def _check(args: argparse.Namespace) -> None:
    for flag in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(args, flag) < 1:
            raise ValueError(
                f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}."
            )
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}.")


def run_latency(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trillm.engine.llm import LLM
    from trillm.sampling_params import SamplingParams

    try:
        _check(args)
        model = model_from_namespace(args)
        prompts = make_batch(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)
    with LLM(model, **engine_kwargs_from_namespace(args)) as llm:
        for _ in tqdm(
            range(args.num_iters_warmup), desc="Warmup iterations", disable=args.disable_tqdm
        ):
            time_batch(llm, prompts, params)
        latencies = [
            time_batch(llm, prompts, params)
            for _ in tqdm(
                range(args.num_iters), desc="Profiling iterations", disable=args.disable_tqdm
            )
        ]
    record = latency_record(latencies)
    print(f"Avg latency: {record['avg_latency']:.4f} seconds")
    for p, value in record["percentiles"].items():
        print(f"{p}% percentile latency: {value:.4f} seconds")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(record, indent=2))
        print(f"Saved the result to {args.output_json}")
    return 0
