"""Engine per-step overhead with the near-zero-cost fake model, native vs pure-Python twins.

Each configuration runs in its own subprocess (``TRILLM_NO_EXTENSIONS=1`` for the twins):
``open_engine`` with ``runner=FakeModelRunner`` (``step_sleep_s=0``), ``batch`` requests of
``--prompt-len`` prompt tokens and ``--output-len`` output tokens (EOS ignored) submitted at
once and consumed as streams (``RequestOutputKind.DELTA``, detokenized) like the server does.
``EngineCore.step`` is wrapped to time it; over the steady-state steps (every request
decoding) it reports, per step (medians):

- ``core_overhead_us`` = ``step_time_s - model_time_s`` (scheduler P1 + IPC + update P4;
  ``model_time_s`` is the fake runner's own time, near zero);
- ``period_us``: step start to next step start, i.e. everything the engine thread does per
  step: the core step, output processing (detokenize, stop checks, deliver to the streams),
  and the consumers' Trio tasks;
- ``tok_s``: tokens delivered to the consumers per second over the whole run.

    python benchmarks/engine/engine_overhead.py --out benchmarks/engine/results/engine_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

from benchmarks import common

FAKE_RUNNER = "trillm.worker.fake_runner:FakeModelRunner"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--backend", choices=["mp", "uni"], default="mp")
    p.add_argument(
        "--variants", nargs="+", choices=["native", "python"], default=["native", "python"]
    )
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args()


# ---------------------------------------------------------------- child: one configuration


async def _consume(engine: Any, prompt: list[int], params: Any, counts: list[int]) -> None:
    async with engine.generate({"prompt_token_ids": prompt}, params) as outputs:
        async for out in outputs:
            counts[0] += len(out.outputs[0].token_ids)


def _wrap_step(core: Any, records: list[tuple[float, float, float, int]]) -> None:
    """Time every ``core.step()`` (the engine-core loop looks the method up per call)."""
    step = core.step

    async def timed_step() -> Any:
        start = time.perf_counter()
        result = await step()
        if result is not None and result.step_time_s:
            records.append((start, result.step_time_s, result.model_time_s, len(result.outputs)))
        return result

    core.step = timed_step


async def _run_batch(engine: Any, batch: int, prompt_len: int, output_len: int, seed: int) -> int:
    import trio

    from trillm import RequestOutputKind, SamplingParams

    params = SamplingParams(
        max_tokens=output_len,
        ignore_eos=True,
        temperature=0.0,
        output_kind=RequestOutputKind.DELTA,
    )
    jobs = common.make_workload(batch, seed, (prompt_len, prompt_len), (output_len, output_len))
    counts = [0]
    async with trio.open_nursery() as nursery:
        for job in jobs:
            nursery.start_soon(_consume, engine, job.prompt_ids, params, counts)
    return counts[0]


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from trillm import open_engine

    folder = common.build_bench_model()
    async with open_engine(
        str(folder),
        runner=FAKE_RUNNER,
        runner_kwargs={"step_sleep_s": 0.0},
        dtype="float32",
        device="cpu",
        max_num_seqs=max(args.batch, 1),
        max_num_batched_tokens=max(8192, args.batch * args.prompt_len),
        enable_prefix_caching=False,
        distributed_executor_backend=args.backend,
    ) as engine:
        await _run_batch(engine, min(args.batch, 8), args.prompt_len, 8, seed=1)  # warm-up
        records: list[tuple[float, float, float, int]] = []
        _wrap_step(engine.cores[0], records)
        start = time.perf_counter()
        tokens = await _run_batch(engine, args.batch, args.prompt_len, args.output_len, seed=2)
        wall = time.perf_counter() - start
    return summarize(records, args.batch, tokens, wall)


def summarize(records: list, batch: int, tokens: int, wall: float) -> dict[str, Any]:
    steady = [
        (i, r) for i, r in enumerate(records) if r[3] == batch and i + 1 < len(records)
    ]  # every request decoding, and a next step to measure the period against
    core = [(r[1] - r[2]) * 1e6 for _, r in steady]
    periods = [(records[i + 1][0] - r[0]) * 1e6 for i, r in steady]
    model = [r[2] * 1e6 for _, r in steady]
    return dict(
        batch=batch,
        steps=len(records),
        steady_steps=len(steady),
        core_overhead_us=statistics.median(core) if core else None,
        model_time_us=statistics.median(model) if model else None,
        period_us=statistics.median(periods) if periods else None,
        core_us_per_token=statistics.median(core) / batch if core else None,
        period_us_per_token=statistics.median(periods) / batch if periods else None,
        tokens=tokens,
        wall_s=wall,
        tok_s=tokens / wall,
    )


def child_main(args: argparse.Namespace) -> None:
    import trio

    result = trio.run(measure, args)
    from trillm._native import native_available

    result["native"] = native_available()
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------- parent


def run_child(args: argparse.Namespace, batch: int, variant: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(common.REPO_ROOT)}
    env.pop("TRILLM_NO_EXTENSIONS", None)
    if variant == "python":
        env["TRILLM_NO_EXTENSIONS"] = "1"
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--batch",
        str(batch),
        "--backend",
        args.backend,
        "--prompt-len",
        str(args.prompt_len),
        "--output-len",
        str(args.output_len),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{variant} batch {batch} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    if result["native"] != (variant == "native"):
        raise RuntimeError(f"{variant} run reports native={result['native']}")
    return {"variant": variant, **result}


def main() -> None:
    args = parse_args()
    if args.child:
        child_main(args)
        return
    machine = common.machine_info()
    rows = []
    for batch in args.batches:
        for variant in args.variants:
            row = run_child(args, batch, variant)
            rows.append(row)
            print(
                f"batch {batch:>4} {variant:>6}: core {row['core_overhead_us']:.0f} us/step, "
                f"period {row['period_us']:.0f} us/step, {row['tok_s']:.0f} tok/s",
                flush=True,
            )
    print(
        f"\nengine overhead, fake model, backend {args.backend}, prompt {args.prompt_len}, "
        f"output {args.output_len} tokens ({machine['cpu']}, load {machine['load_avg_1m']:.1f})"
    )
    common.print_table(
        rows,
        [
            ("batch", "d"),
            ("variant", ""),
            ("steady_steps", "d"),
            ("core_overhead_us", ".0f"),
            ("core_us_per_token", ".1f"),
            ("period_us", ".0f"),
            ("period_us_per_token", ".1f"),
            ("tok_s", ".0f"),
        ],
    )
    common.write_json(
        args.out,
        dict(
            benchmark="engine_overhead",
            machine=machine,
            args=vars(args) | {"out": str(args.out)},
            rows=rows,
        ),
    )


if __name__ == "__main__":
    main()
