"""Structured-output overhead: decode steps at batch 64, every request constrained by a JSON
schema vs none, side by side in one process (alternating rounds).

The whole engine runs (scheduler, worker subprocess behind the ring, sampler, detokenizer) on
the benchmark model of ``common.py``. Each round submits 64 requests with the same prompt
length and ``max_tokens``; the constrained rounds use a JSON schema whose shortest output is
longer than ``max_tokens`` (an array of at least 200 small enums, compact), so every request
decodes to the end and the batch stays at 64 throughout. A step counts as a batch-64 decode
step when all 64 requests got exactly one token from it; the figure is the median engine step
time (``EngineCoreOutputs.step_time_s``: schedule, execute, bitmask, sample, update) of those
steps. ``fill`` is the engine-side bitmask time of a step (it overlaps the forward pass).

    python benchmarks/engine/structured_output.py [--rounds 6] [--tokens 16] [--out x.json]
    python benchmarks/engine/structured_output.py --out benchmarks/engine/results/structured_output.json

The headline is the median over adjacent (none, JSON) round pairs of the step-time ratio: on a
shared machine the load drifts between rounds, and neighbours see the most similar load. The
grammar's own work is also timed directly (engine fill and P4 accept, the worker's mask alone).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

import trio

from benchmarks import common  # benchmarks/common.py: the benchmark model, built once
from trillm import SamplingParams, open_engine
from trillm.sampling_params import StructuredOutputsParams

BATCH = 64
PROMPT_LEN = 32
SCHEMA = {
    "type": "object",
    "properties": {
        "ids": {"type": "array", "items": {"enum": [1, 2, 3, 4]}, "minItems": 200},
    },
    "required": ["ids"],
}


async def _round(engine: Any, constrained: bool, tokens: int, tag: str) -> dict[str, Any]:
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True) if constrained else None
    params = SamplingParams(
        temperature=1.0, seed=0, max_tokens=tokens, ignore_eos=True, structured_outputs=so
    )
    core = engine.cores[0]
    steps: list[float] = []
    fills: list[float] = []
    accepts: list[float] = []
    sample_rows: dict[str, bytes] = {}
    real_step, real_fill, real_accept = core.step, core._grammar_bitmask, core._advance_grammars

    def accept(outputs):
        t0 = time.perf_counter()
        real_accept(outputs)
        accepts.append(time.perf_counter() - t0)

    def fill(sched):
        t0 = time.perf_counter()
        out = real_fill(sched)
        if out is not None:
            fills.append(time.perf_counter() - t0)
            if len(out.bitmask) == BATCH:
                sample_rows.update(out.bitmask)
        return out

    async def step():
        result = await real_step()
        if result is not None:
            outs = [o for o in result.outputs if len(o.new_token_ids) == 1]
            if len(outs) == BATCH == len(result.outputs):
                steps.append(result.step_time_s)
        return result

    core.step, core._grammar_bitmask, core._advance_grammars = step, fill, accept
    finish: list[str] = []

    async def one(i: int) -> None:
        prompt = {"prompt_token_ids": [100 + (7 * i + j) % 3900 for j in range(PROMPT_LEN)]}
        last = None
        async with engine.generate(prompt, params, f"{tag}-{i}") as outputs:
            async for last in outputs:  # noqa: B007
                pass
        finish.append(last.outputs[0].finish_reason if last else "none")

    t0 = time.perf_counter()
    try:
        async with trio.open_nursery() as nursery:
            for i in range(BATCH):
                nursery.start_soon(one, i)
    finally:
        core.step, core._grammar_bitmask, core._advance_grammars = real_step, real_fill, real_accept
    return {
        "constrained": constrained,
        "wall_s": time.perf_counter() - t0,
        "decode_steps_b64": len(steps),
        "step_ms_median": 1e3 * statistics.median(steps) if steps else None,
        "fill_ms_median": 1e3 * statistics.median(fills) if fills else 0.0,
        "accept_ms_median": 1e3 * statistics.median(accepts) if accepts else 0.0,
        "all_length": all(f == "length" for f in finish),
        "rows": sample_rows,
    }


def worker_side_ms(rows: dict[str, bytes], vocab: int, repeats: int = 50) -> float:
    """The worker's share, timed alone: ``step_sampling.bitmask_tensor`` masking [64, vocab]
    fp32 logits with the step's rows (what the sampler then sees)."""
    import torch

    from trillm.worker.step_sampling import bitmask_tensor

    ids = list(rows)
    logits = torch.randn(len(ids), vocab)
    t0 = time.perf_counter()
    for _ in range(repeats):
        bitmask_tensor(rows, ids, logits, vocab, torch.device("cpu"))
    return 1e3 * (time.perf_counter() - t0) / repeats


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model = common.build_bench_model()
    async with open_engine(
        str(model),
        max_model_len=512,
        max_num_seqs=BATCH,
        kv_cache_memory="256MiB",
        enable_prefix_caching=False,
    ) as engine:
        await _round(engine, True, 8, "warm-c")  # compile the grammar, warm the caches
        await _round(engine, False, 8, "warm-p")
        rounds = []
        for r in range(args.rounds):
            for constrained in (False, True):
                rounds.append(await _round(engine, constrained, args.tokens, f"r{r}{constrained}"))
    rows = next(x.pop("rows") for x in rounds if x["constrained"])
    for x in rounds:
        x.pop("rows", None)
    vocab = engine.model_config.vocab_size
    worker_ms = worker_side_ms(rows, vocab)
    none = [x["step_ms_median"] for x in rounds if not x["constrained"]]
    json_ = [x["step_ms_median"] for x in rounds if x["constrained"]]
    # Adjacent rounds (none, then JSON) share the machine's load best: the median of their
    # ratios is the headline; the medians of all rounds are kept too.
    pairs = [100.0 * (j / n - 1.0) for n, j in zip(none, json_, strict=True)]
    base, constrained_ms = statistics.median(none), statistics.median(json_)
    fill_ms = statistics.median(x["fill_ms_median"] for x in rounds if x["constrained"])
    accept_ms = statistics.median(x["accept_ms_median"] for x in rounds if x["constrained"])
    return {
        "benchmark": "structured_output",
        "command": "python benchmarks/engine/structured_output.py " + " ".join(args.argv),
        "machine": common.machine_info(),
        "batch": BATCH,
        "prompt_len": PROMPT_LEN,
        "max_tokens": args.tokens,
        "schema": SCHEMA,
        "rounds": rounds,
        "step_ms_none": base,
        "step_ms_json": constrained_ms,
        "overhead_pct_pairs": pairs,
        "overhead_pct": statistics.median(pairs),
        "overhead_pct_of_medians": 100.0 * (constrained_ms - base) / base,
        "worker_mask_ms": worker_ms,
        "overhead_pct_min": 100.0 * (min(json_) - min(none)) / min(none),
        "fill_pct_of_step": 100.0 * fill_ms / constrained_ms,
        "accept_ms_median": accept_ms,
        "grammar_pct_of_step": 100.0 * (fill_ms + accept_ms + worker_ms) / constrained_ms,
        "fill_ms_median": fill_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    import sys

    args = parser.parse_args()
    args.argv = sys.argv[1:]
    result = trio.run(run, args)
    common.print_table(
        result["rounds"],
        [
            ("constrained", ""),
            ("decode_steps_b64", "d"),
            ("step_ms_median", ".2f"),
            ("fill_ms_median", ".2f"),
            ("accept_ms_median", ".2f"),
            ("wall_s", ".2f"),
            ("all_length", ""),
        ],
    )
    print(
        f"batch-64 decode step: none {result['step_ms_none']:.2f} ms, JSON schema "
        f"{result['step_ms_json']:.2f} ms: overhead {result['overhead_pct']:+.1f}% (of the "
        f"fastest rounds {result['overhead_pct_min']:+.1f}%); grammar work "
        f"{result['grammar_pct_of_step']:.2f}% of the step (worker mask "
        f"{result['worker_mask_ms']:.2f} ms, P4 accept {result['accept_ms_median']:.2f} ms) "
        f"(bitmask fill {result['fill_ms_median']:.2f} ms = {result['fill_pct_of_step']:.2f}% of "
        "the step, overlapping the forward)"
    )
    common.write_json(args.out, result)


if __name__ == "__main__":
    main()
