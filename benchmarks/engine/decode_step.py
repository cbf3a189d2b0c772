"""Decode-step micro-benchmark: ModelRunner's step time against the machine's roofline.

A ~25M-parameter random Llama (hidden 512, 8 layers, intermediate 1408, vocab 4096) decodes at
batch 1, 8 and 64. The limit is measured in the same run: fp32 matmul GFLOP/s (square matmul)
and memory bandwidth (a large copy); the roofline step time is
max(2 * matmul_params * batch / flops, weight_bytes / bandwidth).

    python benchmarks/engine/decode_step.py [--steps 20] [--batches 1 8 64] [--threads N] [--out x.json]

On a CPU shared with other work, ``--threads 1`` avoids OpenMP barrier stalls that make
multi-threaded small ops erratic; the roofline is measured with the same thread count.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

import torch

from benchmarks import common  # benchmarks/common.py: the benchmark model, built once
from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config
from trillm.messages import CachedRequestData, NewRequestData, SchedulerOutput
from trillm.sampling_params import SamplingParams
from trillm.worker.model_runner import ModelRunner

BLOCK_SIZE = 16
PROMPT_LEN = 64


def matmul_gflops(n: int = 1024, repeats: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e9


def copy_gbps(mbytes: int = 256, repeats: int = 5) -> float:
    src = torch.empty(mbytes * (1 << 20) // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    # A copy reads and writes every byte once.
    return 2 * src.numel() * 4 * repeats / (time.perf_counter() - start) / 1e9


def _sched(step_id, new, cached, scheduled, finished=()) -> SchedulerOutput:
    return SchedulerOutput(
        step_id=step_id,
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        finished_req_ids=list(finished),
    )


def time_decode(
    runner: ModelRunner,
    batch: int,
    steps: int,
    first_step: int,
    prompt_len: int = PROMPT_LEN,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Prefill ``batch`` prompts of ``prompt_len`` tokens, then time ``steps`` decode steps;
    returns seconds per step (wall time, or ``time.thread_time`` for this thread's CPU time)."""
    blocks_per_req = -(-(prompt_len + steps + 2) // BLOCK_SIZE)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2)
    g = torch.Generator().manual_seed(batch)
    req_ids = [f"b{batch}-{i}" for i in range(batch)]
    new = [
        NewRequestData(
            rid,
            torch.randint(3, 4096, (prompt_len,), generator=g).tolist(),
            [],
            params,
            list(range(i * blocks_per_req, (i + 1) * blocks_per_req)),
            0,
        )
        for i, rid in enumerate(req_ids)
    ]
    runner.execute_model(
        _sched(first_step, new, CachedRequestData(), dict.fromkeys(req_ids, prompt_len))
    )
    runner.sample_tokens(None)
    times = []
    for step in range(steps):
        computed = prompt_len + step
        cached = CachedRequestData(req_ids, [[] for _ in req_ids], [computed] * batch)
        sched = _sched(first_step + 1 + step, [], cached, dict.fromkeys(req_ids, 1))
        start = clock()
        runner.execute_model(sched)
        runner.sample_tokens(None)
        times.append(clock() - start)
    empty = _sched(first_step + steps + 1, [], CachedRequestData(), {}, finished=req_ids)
    runner.execute_model(empty)
    runner.sample_tokens(None)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    folder = common.build_bench_model()
    engine_args = EngineArgs(
        model=str(folder),
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        max_num_seqs=max(args.batches),
        max_model_len=1024,
        num_gpu_blocks_override=max(args.batches) * 16,
    )
    runner = ModelRunner(build_config(engine_args))
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_blocks())
    params = sum(p.numel() for p in runner.model.parameters())
    matmul_params = params - runner.model.model.embed_tokens.weight.numel()
    weight_bytes = matmul_params * 4
    gflops, gbps = matmul_gflops(), copy_gbps()

    rows, step_id = [], 0
    for batch in args.batches:
        times = time_decode(runner, batch, args.steps, step_id)
        step_id += args.steps + 2
        measured = statistics.median(times)
        compute_s = 2 * matmul_params * batch / (gflops * 1e9)
        roofline = max(compute_s, weight_bytes / (gbps * 1e9))
        rows.append(
            dict(
                batch=batch,
                step_ms=measured * 1e3,
                tokens_per_s=batch / measured,
                roofline_ms=roofline * 1e3,
                fraction_of_roofline=roofline / measured,
            )
        )
    print(
        f"params {params / 1e6:.1f}M (matmul {matmul_params / 1e6:.1f}M), "
        f"fp32 matmul {gflops:.1f} GFLOP/s, copy bandwidth {gbps:.1f} GB/s, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'batch':>5} {'step ms':>9} {'tok/s':>9} {'roofline ms':>12} {'of roofline':>12}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['step_ms']:>9.2f} {r['tokens_per_s']:>9.1f} "
            f"{r['roofline_ms']:>12.2f} {r['fraction_of_roofline']:>11.1%}"
        )
    if args.out:
        result = dict(
            params=params,
            matmul_params=matmul_params,
            matmul_gflops=gflops,
            copy_gbps=gbps,
            threads=torch.get_num_threads(),
            steps=args.steps,
            rows=rows,
        )
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
