"""Decode steps with and without step-program replay (trillm/worker/step_program.py).

One ModelRunner; rounds alternate the eager forward, the native replay and the replay of the same
recorded calls from Python (``step_program.NATIVE_REPLAY``; the same runner, the programs
switched off and on), each round a fresh set of ``batch`` requests decoding ``--steps``
steps after a ``--prompt-len`` prompt. Reported: the median step time of each mode (median of
the rounds' medians), eager / replay, and the bytes the batch's program keeps against the bytes
its forward allocates (the arena's reuse). ``--clock thread`` times this thread's CPU time
instead of wall time (with ``--threads 1``: what other load on the machine barely moves).
Batches past ``step_program.MAX_ROWS`` are replayed too (to see where replay stops paying).

    python benchmarks/engine/step_program.py --model PATH [--dtype float32] [--batches 1 4 16]
        [--rounds 4] [--steps 24] [--threads N] [--clock wall|thread] [--out x.json]

PATH may be a checkpoint folder or a .gguf file (kept quantized where trillm can).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

from benchmarks.engine.decode_step import BLOCK_SIZE, time_decode
from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config
from trillm.worker import step_program
from trillm.worker.model_runner import ModelRunner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default=None)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--clock", choices=["wall", "thread"], default="wall")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine_args = EngineArgs(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        device="cpu",
        block_size=BLOCK_SIZE,
        max_num_seqs=max(args.batches),
        max_model_len=1024,
        num_gpu_blocks_override=max(max(args.batches) * 24, 1024 // BLOCK_SIZE),
    )
    runner = ModelRunner(build_config(engine_args))
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_blocks())
    step_program.CAPTURE_AFTER = 1  # every size at its first step (times[2:] skip it)
    step_program.MAX_ROWS = max(step_program.MAX_ROWS, *args.batches)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    programs = runner.step_programs
    if programs is None:
        raise SystemExit("step programs do not apply to this runner (see ModelRunner)")
    rows, first_step = [], 0
    for batch in args.batches:
        medians: dict[str, list[float]] = {"eager": [], "replay": [], "python_replay": []}
        for _ in range(args.rounds):
            for mode in medians:
                runner.step_programs = None if mode == "eager" else programs
                step_program.NATIVE_REPLAY = mode == "replay"
                times = time_decode(runner, batch, args.steps, first_step, args.prompt_len, clock)
                first_step += args.steps + 2
                medians[mode].append(statistics.median(times[2:]) * 1e3)  # after the capture
        eager, replay, python = (statistics.median(medians[m]) for m in medians)
        program = programs.programs.get(batch)
        kept, allocated = (program.nbytes, program.allocated) if program else (0, 0)
        rows.append(
            dict(
                batch=batch,
                eager_ms=eager,
                replay_ms=replay,
                python_replay_ms=python,
                speedup=eager / replay,
                program_bytes=kept,
                allocated_bytes=allocated,
                rounds=medians,
            )
        )
        print(
            f"batch {batch:>3}: eager {eager:7.2f} ms, replay {replay:7.2f} ms "
            f"({eager / replay:.2f}x), the same calls replayed from Python {python:7.2f} ms "
            f"({eager / python:.2f}x); the program keeps {kept >> 10} KiB of the "
            f"{allocated >> 10} KiB its forward allocates",
            flush=True,
        )
    if programs.reason is not None:
        print("programs off:", programs.reason)
    result = dict(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        threads=torch.get_num_threads(),
        steps=args.steps,
        prompt_len=args.prompt_len,
        off_reason=programs.reason,
        rows=rows,
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
