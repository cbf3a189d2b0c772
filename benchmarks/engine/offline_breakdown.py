"""Where the offline workload's CPU time goes, kernel by kernel: benchmarks/peers/offline_vs_hf.py's
workload and engine settings, the engine in this process on one thread, and every native kernel
call (the wrappers call their kernels through ``kernels/recording.py``) timed in thread CPU time;
what is left of the process's CPU time is Python and torch glue (the runner's forward, the
engine core, sampling, detokenizing). Step programs' replays call their kernels directly, so
``--enforce-eager`` (the default here) keeps every call visible.

    python benchmarks/engine/offline_breakdown.py [--rounds 2] [--programs]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

from benchmarks import common  # benchmarks/common.py
from benchmarks.peers import offline_vs_hf
from trillm.kernels import recording


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--programs", action="store_true", help="keep step programs on")
    args = parser.parse_args()
    common.set_threads(1)
    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    native_call, native_attention = recording.call, recording.attention

    def timed_call(kernel: Any, *a: Any, **kw: Any) -> None:
        name = str(getattr(kernel, "__name__", type(kernel).__name__))
        start = time.thread_time()
        native_call(kernel, *a, **kw)
        spent[name] += time.thread_time() - start
        calls[name] += 1

    def timed_attention(plan: Any, native: Any, **kw: Any) -> None:
        start = time.thread_time()
        native_attention(plan, native, **kw)
        spent["paged_attention"] += time.thread_time() - start
        calls["paged_attention"] += 1

    recording.call, recording.attention = timed_call, timed_attention  # type: ignore[assignment]
    settings = argparse.Namespace(max_num_seqs=128, max_num_batched_tokens=2048, backend="uni")
    if not args.programs:
        import trillm

        original = trillm.LLM
        trillm.LLM = lambda *a, **k: original(*a, enforce_eager=True, **k)  # type: ignore[misc]
    llm = offline_vs_hf.open_llm(common.build_bench_model(), settings)
    offline_vs_hf.run_trillm(llm, common.make_workload(4, seed=99, output_range=(4, 8)))
    jobs = common.make_workload(96, 0)
    for r in range(args.rounds):
        spent.clear()
        calls.clear()
        start = time.process_time()
        offline_vs_hf.run_trillm(llm, jobs)
        total = time.process_time() - start
        kernels = sum(spent.values())
        print(f"round {r}: process CPU {total:.2f} s, native kernels {kernels:.2f} s")
        for name, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
            print(
                f"  {name:24s} {seconds:6.2f} s {100 * seconds / total:5.1f}%  {calls[name]} calls"
            )
        print(
            f"  {'(rest: Python, glue)':24s} {total - kernels:6.2f} s "
            f"{100 * (total - kernels) / total:5.1f}%"
        )


if __name__ == "__main__":
    main()
