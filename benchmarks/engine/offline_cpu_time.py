"""CPU time of the offline workload, in process: a measure that other load on the machine
barely moves (the wall clock does), for comparing kernels and trees on a busy machine.

The workload, model and engine settings are benchmarks/peers/offline_vs_hf.py's (96 mixed prompts,
greedy, EOS ignored); the engine runs in this process (``distributed_executor_backend="uni"``)
on ``--threads`` torch threads, so with one thread the process's CPU time is the engine's work
(no thread pool spinning). Each round prints wall seconds, CPU seconds, the steps and the model
time. ``--isa avx2`` runs the fp32 GEMM's AVX2 kernel instead of the default (bit-identical
results); ``--enforce-eager`` turns step programs off.

Another tree (an older commit built beside this one) runs its own copy of the workload code:

    PYTHONPATH=/path/to/tree python benchmarks/engine/offline_cpu_time.py --rounds 2
    python benchmarks/engine/offline_cpu_time.py --rounds 2 --isa avx2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--isa", choices=["avx2", "avx512"], default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    # The tree under test: the first PYTHONPATH entry, else this script's own repository.
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    tree = Path(paths[0]) if paths else Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(tree))
    if (tree / "benchmarks" / "peers").is_dir():
        from benchmarks import common
        from benchmarks.peers import offline_vs_hf
    else:  # a tree from before the benchmarks were grouped: one flat benchmarks/ folder
        sys.path.insert(0, str(tree / "benchmarks"))
        import common  # type: ignore[no-redef]
        import offline_vs_hf  # type: ignore[no-redef]

    common.set_threads(args.threads)
    import trillm

    if not Path(trillm.__file__).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"trillm comes from {trillm.__file__}, not from {tree}")
    folder = common.build_bench_model()
    jobs = common.make_workload(96, 0)
    settings = argparse.Namespace(max_num_seqs=128, max_num_batched_tokens=2048, backend="uni")
    if args.enforce_eager:
        original = trillm.LLM
        trillm.LLM = lambda *a, **k: original(*a, enforce_eager=True, **k)  # type: ignore[misc]
    llm = offline_vs_hf.open_llm(folder, settings)
    offline_vs_hf.run_trillm(llm, common.make_workload(4, seed=99, output_range=(4, 8)))
    steps = offline_vs_hf.record_steps(llm)
    isa: Any = contextlib.nullcontext()
    if args.isa is not None:
        from trillm.kernels import linear_cpu

        isa = linear_cpu.use_isa(args.isa)
    with isa:
        rounds = [one_round(llm, jobs, steps, offline_vs_hf, tree.name) for _ in range(args.rounds)]
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                dict(tree=str(tree), args=vars(args) | {"out": None}, rounds=rounds),
                indent=1,
                default=str,
            )
        )


def one_round(llm: Any, jobs: list, steps: list, offline_vs_hf: Any, name: str) -> dict:
    cpu0, wall0 = time.process_time(), time.perf_counter()
    result = offline_vs_hf.run_trillm(llm, jobs, steps)
    row = dict(
        wall_s=time.perf_counter() - wall0,
        cpu_s=time.process_time() - cpu0,
        steps=result.get("steps"),
        model_s=result.get("model_s_sum"),
    )
    print(
        f"{name}: wall {row['wall_s']:.2f} s, CPU {row['cpu_s']:.2f} s, {row['steps']} steps",
        flush=True,
    )
    return row


if __name__ == "__main__":
    main()
