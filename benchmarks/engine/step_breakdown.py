"""Where a replayed decode step's time goes, kernel by kernel (trillm/worker/step_program.py).

One ModelRunner decodes ``--batch`` rows after a ``--prompt-len`` prompt; once its step
program is captured, each replay runs the program's thunks timed one by one in native code
(``Program.run_timed``: this thread's CPU time and the wall time of each kernel call). Per kind
of call (the kernel, and a linear's N x K) over ``--steps`` steps: calls a step, thread CPU us
a step and a call, wall us a step; then the whole step (execute_model + sample_tokens) and its
part outside the program (the head, timed alone too, sampling, Python). For each ``--threads``
count (a program is captured again at each: the thread count is part of its calls), and the
thread pool's own cost of a call of empty items (``pool_dispatch_ns``) at that count.

    python benchmarks/engine/step_breakdown.py --model PATH [--dtype float32] [--threads 1 2]
        [--batch 1] [--prompt-len 256] [--steps 32] [--rounds 3] [--out x.json]

PATH may be a checkpoint folder or a .gguf file (kept quantized where trillm can).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

import torch

from benchmarks.engine.decode_step import BLOCK_SIZE, time_decode
from trillm._native import cpu_kernels
from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config
from trillm.kernels import recording
from trillm.worker import step_program
from trillm.worker.model_runner import ModelRunner


def _label(call: recording.Call) -> str:
    kernel, args, kwargs = call
    if kernel is None:
        return "paged_attention"
    name = getattr(kernel, "__name__", type(kernel).__name__)
    if (
        name == "linear" and len(args) >= 8
    ):  # gemm_q.linear(x, x_bf16, m, k, ldx, packed, qtype, n, ...)
        return f"linear_q n={args[7]} k={args[3]}"
    if name.startswith("linear") and "n" in kwargs and "k" in kwargs:
        return f"{name} n={kwargs['n']} k={kwargs['k']}"
    return name


def _instrument(program: step_program.StepProgram, totals: dict[str, list[float]]) -> None:
    """Swap the program's native runs for timed ones; each replay adds its calls' thread CPU
    and wall ns to totals[label] = [calls, cpu_ns, wall_ns]."""
    labels: list[list[str]] = []
    current: list[str] | None = None
    for call in program.calls:  # the grouping of bind_native
        thunk = recording.bind(
            call, program.plan_slots, {k: i for i, k in enumerate(program.plan_keys)}
        )
        if thunk is None:
            labels.append([_label(call)])
            current = None
        else:
            if current is None:
                current = []
                labels.append(current)
            current.append(_label(call))
    steps: list[Any] = []
    for step, names in zip(program.steps, labels, strict=True):
        run = getattr(step, "__self__", None)
        if run is not None and hasattr(run, "run_timed"):

            def timed(run: Any = run, names: list[str] = names) -> None:
                for name, (cpu, wall) in zip(names, run.run_timed(), strict=True):
                    row = totals[name]
                    row[0] += 1
                    row[1] += cpu
                    row[2] += wall

        else:

            def timed(step: Any = step, names: list[str] = names) -> None:
                c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
                step()
                row = totals[names[0]]
                row[0] += 1
                row[1] += time.thread_time_ns() - c0
                row[2] += time.perf_counter_ns() - w0

        steps.append(timed)
    program.steps = steps


def measure(runner: ModelRunner, args: argparse.Namespace, threads: int, first: int) -> dict:
    torch.set_num_threads(threads)
    programs = runner.step_programs
    assert programs is not None
    programs.programs.clear()
    programs.seen.clear()
    programs.nbytes = 0
    # capture and check the program at this thread count
    time_decode(runner, args.batch, 4, first, args.prompt_len, time.thread_time)
    first += 6
    program = programs.programs.get(args.batch)
    if program is None:
        raise SystemExit(f"no program for batch {args.batch}: {programs.reason}")
    plain = list(program.steps)
    per_round: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        # a plain round (the step's own time) and a timed round (the breakdown), alternated
        program.steps = plain
        step_cpu = time_decode(
            runner, args.batch, args.steps, first, args.prompt_len, time.thread_time
        )
        first += args.steps + 2
        step_wall = time_decode(
            runner, args.batch, args.steps, first, args.prompt_len, time.perf_counter
        )
        first += args.steps + 2
        totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0, 0])
        _instrument(program, totals)
        time_decode(runner, args.batch, args.steps, first, args.prompt_len, time.thread_time)
        first += args.steps + 2
        n = args.steps
        per_round.append(
            dict(
                step_cpu_ms=statistics.median(step_cpu[2:]) * 1e3,
                step_wall_ms=statistics.median(step_wall[2:]) * 1e3,
                kinds={
                    k: dict(calls=c / n, cpu_us=cpu / n / 1e3, wall_us=w / n / 1e3)
                    for k, (c, cpu, w) in totals.items()
                },
            )
        )
    program.steps = plain
    hidden = torch.randn(args.batch, runner.config.model.hidden_size, dtype=runner.dtype)
    head = []
    with torch.inference_mode():
        for _ in range(args.steps):
            c0 = time.thread_time_ns()
            runner.model.compute_logits(hidden)
            head.append((time.thread_time_ns() - c0) / 1e6)
    head_ms = statistics.median(head)
    pool = cpu_kernels("program")
    dispatch = (
        {items: pool.pool_dispatch_ns(threads, items, 2000) for items in (2, 8)}
        if pool is not None
        else {}
    )
    kinds = sorted(per_round[0]["kinds"], key=lambda k: -per_round[0]["kinds"][k]["cpu_us"])
    med = {
        k: {
            f: statistics.median(r["kinds"][k][f] for r in per_round)
            for f in ("calls", "cpu_us", "wall_us")
        }
        for k in kinds
    }
    step_cpu = statistics.median(r["step_cpu_ms"] for r in per_round)
    step_wall = statistics.median(r["step_wall_ms"] for r in per_round)
    prog_cpu = sum(v["cpu_us"] for v in med.values()) / 1e3
    prog_wall = sum(v["wall_us"] for v in med.values()) / 1e3
    print(f"\n== {threads} thread(s), batch {args.batch}, {args.prompt_len}-token prompt")
    print(
        f"step: thread CPU {step_cpu:.2f} ms, wall {step_wall:.2f} ms; program (timed): "
        f"CPU {prog_cpu:.2f} ms, wall {prog_wall:.2f} ms; outside the program: CPU "
        f"{step_cpu - prog_cpu:.2f} ms, of which the head (compute_logits alone) {head_ms:.2f} ms"
    )
    print(f"{'kind':<32}{'calls':>7}{'CPU us':>10}{'us/call':>9}{'wall us':>10}{'us/call':>9}")
    for k in kinds:
        v = med[k]
        print(
            f"{k:<32}{v['calls']:>7.0f}{v['cpu_us']:>10.1f}{v['cpu_us'] / v['calls']:>9.2f}"
            f"{v['wall_us']:>10.1f}{v['wall_us'] / v['calls']:>9.2f}"
        )
    for items, (wall, cpu) in dispatch.items():
        print(
            f"pool: a call of {items} empty items: wall {wall / 1e3:.2f} us, caller CPU {cpu / 1e3:.2f} us"
        )
    return dict(
        threads=threads,
        step_cpu_ms=step_cpu,
        step_wall_ms=step_wall,
        program_cpu_ms=prog_cpu,
        program_wall_ms=prog_wall,
        head_cpu_ms=head_ms,
        kinds=med,
        pool_dispatch_ns={str(k): v for k, v in dispatch.items()},
        rounds=per_round,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    engine_args = EngineArgs(
        model=args.model,
        dtype=args.dtype,
        device="cpu",
        block_size=BLOCK_SIZE,
        max_num_seqs=args.batch,
        max_model_len=1024,
        num_gpu_blocks_override=max(args.batch * 24, 1024 // BLOCK_SIZE),
    )
    runner = ModelRunner(build_config(engine_args))
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_blocks())
    step_program.CAPTURE_AFTER = 1
    if runner.step_programs is None:
        raise SystemExit("step programs do not apply to this runner (see ModelRunner)")
    results = []
    first = 0
    for threads in args.threads:
        results.append(measure(runner, args, threads, first))
        first += 10_000
    if args.out:
        args.out.write_text(
            json.dumps(dict(model=args.model, dtype=args.dtype, results=results), indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
