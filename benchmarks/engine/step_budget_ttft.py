"""Mean TTFT of prompts arriving together against the step's token budget
(``max_num_batched_tokens``), in the CPU seconds of the engine's process: a measure that other
load on the machine barely moves (the served wall clock does).

``--prompts`` random prompts of ``--prompt-len`` tokens, ``--output-len`` tokens each (greedy,
EOS ignored), all submitted at once to an in-process engine (``distributed_executor_backend``
uni) on ``--threads`` torch threads (1 by default: the process's CPU time is then the engine's
work, no thread pool spinning). Each step's end is stamped with the process CPU time; a
request's TTFT is the CPU time (since the submission) at the end of the step that gave its
first token, its TPOT the CPU time from there to its last token over the tokens between; also
the total CPU time. Budgets are alternated within each round, one engine per budget (all open
at once), so a slow stretch of the machine falls on each in turn.

    python benchmarks/engine/step_budget_ttft.py --model ~/.cache/trillm-peer/smollm2-135m-instruct \
        --budgets 4096 2048 1024 512 --rounds 2
    python benchmarks/engine/step_budget_ttft.py --shape llama-3.2-1b-2l --prompt-len 1024 ...

``--shape llama-3.2-1b-2l``: a random checkpoint of Llama-3.2-1B's layer shape cut to 2 layers
(hidden 2048, 32/8 heads of 64, intermediate 8192; a 32,000-token vocabulary), written once to
``~/.cache/trillm-bench``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root

from benchmarks import common  # noqa: E402

SHAPES = {
    "llama-3.2-1b-2l": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        num_hidden_layers=2,
        vocab_size=32000,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
}


def model_folder(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return Path(args.model).expanduser()
    from trillm.testing.tiny_models import build_tiny_model

    folder = Path("~/.cache/trillm-bench").expanduser() / args.shape
    if not (folder / "config.json").is_file():
        build_tiny_model("llama", folder, dtype="bfloat16", **SHAPES[args.shape])
    return folder


class Stamps:
    """Wraps the engine core's ``step``: per request, the process CPU time at the end of the
    step that gave its first token and of the one that gave its last."""

    def __init__(self, llm: Any) -> None:
        core = llm.engine.cores[0]
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.tokens: dict[str, int] = {}
        self.steps = 0
        step = core.step

        async def stamped() -> Any:
            result = await step()
            now = time.process_time()
            if result is not None and result.num_scheduled_tokens:
                self.steps += 1
            for out in result.outputs if result is not None else ():
                if out.new_token_ids:
                    self.first.setdefault(out.request_id, now)
                    self.last[out.request_id] = now
                    self.tokens[out.request_id] = self.tokens.get(out.request_id, 0) + len(
                        out.new_token_ids
                    )
            return result

        core.step = stamped

    def clear(self) -> None:
        self.first.clear()
        self.last.clear()
        self.tokens.clear()
        self.steps = 0


def one_run(llm: Any, stamps: Stamps, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    import numpy as np

    from trillm import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = llm.get_tokenizer().vocab_size if args.model else SHAPES[args.shape]["vocab_size"]
    prompts = [
        {"prompt_token_ids": rng.integers(100, min(vocab, 30000), args.prompt_len).tolist()}
        for _ in range(args.prompts)
    ]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    stamps.clear()
    c0, w0 = time.process_time(), time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    ttft = [t - c0 for t in stamps.first.values()]
    tpot = [
        (stamps.last[r] - stamps.first[r]) / (stamps.tokens[r] - 1)
        for r in stamps.first
        if stamps.tokens[r] > 1
    ]
    return dict(
        mean_ttft_cpu_s=statistics.mean(ttft),
        max_ttft_cpu_s=max(ttft),
        mean_tpot_cpu_ms=1e3 * statistics.mean(tpot),
        total_cpu_s=cpu,
        wall_s=wall,
        steps=stamps.steps,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a checkpoint folder (else --shape)")
    p.add_argument("--shape", choices=list(SHAPES), default="llama-3.2-1b-2l")
    p.add_argument("--budgets", type=int, nargs="+", default=[4096, 2048, 1024, 512])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    common.set_threads(args.threads)
    from trillm import LLM

    folder = model_folder(args)
    engines = {}
    for budget in args.budgets:
        llm = LLM(
            str(folder),
            dtype="bfloat16",
            device="cpu",
            kv_cache_memory=args.kv_cache_memory,
            max_model_len=args.prompt_len + args.output_len + 16,
            max_num_batched_tokens=budget,
            enable_prefix_caching=False,  # the rounds' prompts differ anyway
            distributed_executor_backend="uni",
        )
        engines[budget] = (llm, Stamps(llm))
        one_run(llm, engines[budget][1], argparse.Namespace(**{**vars(args), "prompts": 2}), 99)
    runs: dict[int, list[dict[str, Any]]] = {b: [] for b in args.budgets}
    for r in range(args.rounds):
        for budget, (llm, stamps) in engines.items():
            run = one_run(llm, stamps, args, r)
            runs[budget].append(run)
            print(
                f"round {r + 1} budget {budget:5d}: mean TTFT {run['mean_ttft_cpu_s']:7.2f} CPU s"
                f" (last {run['max_ttft_cpu_s']:7.2f}), mean TPOT {run['mean_tpot_cpu_ms']:7.1f}"
                f" CPU ms, total {run['total_cpu_s']:7.2f} CPU s, wall {run['wall_s']:7.2f} s,"
                f" {run['steps']} steps",
                flush=True,
            )
    base = args.budgets[0]
    print(f"medians over {args.rounds} rounds (ratios to budget {base}, round by round, median)")
    for budget in args.budgets:

        def med(key: str, budget: int = budget) -> float:
            return statistics.median(x[key] for x in runs[budget])

        def ratio(key: str, budget: int = budget) -> float:
            pairs = zip(runs[budget], runs[base], strict=True)
            return statistics.median(a[key] / b[key] for a, b in pairs)

        print(
            f"budget {budget:5d}: mean TTFT {med('mean_ttft_cpu_s'):7.2f} CPU s"
            f" ({ratio('mean_ttft_cpu_s'):.2f}x), mean TPOT {med('mean_tpot_cpu_ms'):7.1f} CPU ms"
            f" ({ratio('mean_tpot_cpu_ms'):.2f}x), total {med('total_cpu_s'):7.2f} CPU s"
            f" ({ratio('total_cpu_s'):.2f}x)"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(dict(argv=sys.argv[1:], runs=runs), indent=1) + "\n")


if __name__ == "__main__":
    main()
