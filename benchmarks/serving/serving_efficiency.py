"""Serving efficiency: output tokens/s over HTTP (``trillm bench serve``) / offline engine tokens/s.

One workload for both: ``trillm.bench.datasets.build_random`` with the flags given to ``bench
serve`` (token-id prompts, no tokenizer, so lengths are exact; EOS ignored, greedy). The server
is a ``trillm serve`` subprocess; the client is a ``python -m trillm.bench serve`` subprocess
with ``--max-concurrency``; the offline engine is ``trillm.LLM`` in this process with the same
engine arguments (``max_num_seqs`` = the concurrency). Both engines stay up for the whole run
and are measured alternately: offline, serve, offline, serve, ...

    python benchmarks/serving/serving_efficiency.py --out benchmarks/serving/results/serving_efficiency.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

from benchmarks import common


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--random-input-len", type=int, default=196)
    p.add_argument("--random-output-len", type=int, default=84)
    p.add_argument("--random-range-ratio", type=float, default=0.9)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backend", choices=["mp", "uni"], default="mp")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        dtype="float32",
        device="cpu",
        kv_cache_memory="2GiB",
        max_num_seqs=args.max_concurrency,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,
        distributed_executor_backend=args.backend,
    )


def serve_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--kv-cache-memory",
        "2GiB",
        "--max-num-seqs",
        str(args.max_concurrency),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--no-enable-prefix-caching",
        "--distributed-executor-backend",
        args.backend,
    ]


def bench_flags(args: argparse.Namespace, num_prompts: int) -> list[str]:
    return [
        "--dataset-name",
        "random",
        "--num-prompts",
        str(num_prompts),
        "--random-input-len",
        str(args.random_input_len),
        "--random-output-len",
        str(args.random_output_len),
        "--random-range-ratio",
        str(args.random_range_ratio),
        "--max-concurrency",
        str(args.max_concurrency),
        "--ignore-eos",
        "--seed",
        str(args.seed),
        "--metric-percentiles",
        "50,99",
    ]


def workload(args: argparse.Namespace, num_prompts: int) -> list[Any]:
    """Exactly what ``bench serve`` sends for ``bench_flags`` (same builder, same seed)."""
    from trillm.bench.datasets import build_random

    return build_random(
        num_prompts,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        seed=args.seed,
        tokenizer=None,
        as_text=False,
    )


def run_offline(llm: Any, requests: list[Any]) -> dict[str, Any]:
    from trillm import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt} for r in requests]
    params = [
        SamplingParams(max_tokens=r.expected_output_len, ignore_eos=True, temperature=0.0)
        for r in requests
    ]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if tokens != sum(r.expected_output_len for r in requests):
        raise RuntimeError("the offline engine returned other output lengths than requested")
    return dict(seconds=seconds, output_tokens=tokens, output_tok_s=tokens / seconds)


def run_serve(url: str, args: argparse.Namespace, num_prompts: int, tmp: Path) -> dict[str, Any]:
    record = common.run_bench_serve(
        url, bench_flags(args, num_prompts), tmp / f"serve-{time.monotonic_ns()}.json"
    )
    if record["failed"]:
        raise RuntimeError(f"{record['failed']} request(s) failed in bench serve")
    keep = (
        "duration",
        "completed",
        "total_output_tokens",
        "output_throughput",
        "mean_ttft_ms",
        "p50_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "p99_tpot_ms",
        "mean_itl_ms",
        "p99_itl_ms",
    )
    return {k: record.get(k) for k in keep}


def main() -> None:
    args = parse_args()
    common.set_threads(args.threads)
    from trillm import LLM

    folder = common.build_bench_model()
    machine = common.machine_info()
    requests = workload(args, args.num_prompts)
    tmp = Path(tempfile.mkdtemp(prefix="serving-eff-"))
    print(
        f"workload: {len(requests)} requests, "
        f"{sum(r.prompt_len for r in requests)} prompt + "
        f"{sum(r.expected_output_len for r in requests)} output tokens; "
        f"{machine['cpu']}, load {machine['load_avg_1m']:.1f}",
        flush=True,
    )
    llm = LLM(str(folder), **engine_kwargs(args))
    run_offline(llm, workload(args, 4))  # warm-up
    offline, served = [], []
    with common.trillm_server(str(folder), serve_flags(args), log_path=tmp / "server.log") as (
        url,
        _,
    ):
        run_serve(url, args, 4, tmp)  # warm-up
        for r in range(args.rounds):
            offline.append(run_offline(llm, requests))
            print(f"round {r}: offline {offline[-1]['output_tok_s']:.1f} output tok/s", flush=True)
            served.append(run_serve(url, args, args.num_prompts, tmp))
            print(
                f"round {r}: served  {served[-1]['output_throughput']:.1f} output tok/s", flush=True
            )
    llm.shutdown()

    offline_mean = statistics.mean(o["output_tok_s"] for o in offline)
    served_mean = statistics.mean(s["output_throughput"] for s in served)
    ratio = served_mean / offline_mean
    rows = [
        dict(mode="offline", tok_s=o["output_tok_s"], seconds=o["seconds"], p99_ttft_ms=None)
        for o in offline
    ] + [
        dict(
            mode="served",
            tok_s=s["output_throughput"],
            seconds=s["duration"],
            p99_ttft_ms=s["p99_ttft_ms"],
        )
        for s in served
    ]
    print(f"\nserving efficiency, concurrency {args.max_concurrency}:")
    common.print_table(
        rows, [("mode", ""), ("tok_s", ".1f"), ("seconds", ".2f"), ("p99_ttft_ms", ".0f")]
    )
    print(f"served / offline output tokens/s (ratio of means): {ratio:.3f} (target >= 0.8)")
    common.write_json(
        args.out,
        dict(
            benchmark="serving_efficiency",
            machine=machine,
            args=vars(args) | {"out": str(args.out)},
            serve_flags=serve_flags(args),
            bench_flags=bench_flags(args, args.num_prompts),
            offline=offline,
            served=served,
            offline_mean_tok_s=offline_mean,
            served_mean_tok_s=served_mean,
            ratio=ratio,
        ),
    )


if __name__ == "__main__":
    main()
