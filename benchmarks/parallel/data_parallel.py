"""Offline throughput at data_parallel_size 1 and 2 (or more).

Each (round, DP size) runs in a fresh child process (``--child``): it opens ``LLM`` with the
size (K engine cores, each with its own worker process, scheduler and KV cache), runs a
one-request warm-up, then the workload (greedy, ``ignore_eos``, fixed lengths, distinct
prompts, prefix caching off so that routing is by load alone), and reports the wall time and
how many requests each core took. The sizes alternate within each round.

On CPU the cores' workers share the machine's cores (each takes cores // K threads), so on
this 2-core machine expect little or no gain: data parallelism adds compute only where there
are more devices (one GPU per engine core).

    python benchmarks/parallel/data_parallel.py --out benchmarks/parallel/results/data_parallel.json
    # a multi-GPU machine (one GPU per engine core):
    python benchmarks/parallel/data_parallel.py --device cuda --dp-sizes 1,2 --num-prompts 256
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

from benchmarks import common


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp-sizes", default="1,2")
    common.add_offline_args(p)
    return p.parse_args(argv)


def _routed(llm: Any) -> list[int] | None:
    """Engine requests each core was given so far (None: one core, no router)."""
    router = llm.engine.router
    return list(router.routed) if router is not None else None


def run_child(args: argparse.Namespace) -> None:
    """One LLM at data_parallel_size ``args.child``; prints a JSON line on stdout."""
    result = common.run_offline(args, "512MiB", _routed, data_parallel_size=args.child)
    before, after = result.pop("probe")
    result["routed"] = (
        [a - b for a, b in zip(after, before)] if before is not None else [args.num_prompts]
    )
    print(json.dumps(result), flush=True)


def measure(args: argparse.Namespace, dp: int) -> dict[str, Any]:
    result, _ = common.run_offline_child(__file__, args, ["--child", str(dp)], f"DP={dp}")
    return {
        "dp": dp,
        "seconds": result["seconds"],
        "output_tok_s": result["output_tokens"] / result["seconds"],
        "routed": "/".join(str(n) for n in result["routed"]),
    }


def main() -> None:
    args = parse_args()
    if args.child is not None:
        run_child(args)
        return
    args.model = args.model or str(common.build_bench_model())
    sizes = [int(s) for s in args.dp_sizes.split(",")]
    machine = common.machine_info()
    load_before = os.getloadavg()[0]
    rows = common.run_rounds(args.rounds, sizes, lambda dp: measure(args, dp))
    columns = [
        ("round", "d"),
        ("dp", "d"),
        ("seconds", ".2f"),
        ("output_tok_s", ".1f"),
        ("routed", "s"),
        ("load_1m", ".1f"),
    ]
    if rows:
        common.print_table(rows, columns)
    command = "python benchmarks/parallel/data_parallel.py " + " ".join(sys.argv[1:])
    common.write_json(
        args.out,
        {
            "machine": machine,
            "command": command,
            "args": vars(args) | {"out": None},
            "load_1m_before": load_before,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
