"""bf16 prefill on the real model: fresh prompts through the fresh-prompt kernel
(``ext/cpu_prefill_attention.cpp``, its bf16 path) against the paged kernel, alternated in one
process. ``--prompts`` random prompts of ``--prompt-len`` tokens through
``LLM.generate`` with ``max_tokens=1``; prefill tokens/s per round.

    python benchmarks/engine/bf16_prefill.py --model ~/.cache/trillm-peer/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

import torch  # noqa: E402

from trillm import LLM, SamplingParams  # noqa: E402
from trillm.kernels import paged_attention_cpu  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    supported = paged_attention_cpu.prefill_supports_layout
    variants = {
        "prefill kernel": supported,
        "paged kernel": lambda *a: False,  # the routing before: bf16 prompts to the paged kernel
    }
    g = torch.Generator().manual_seed(0)

    def fresh_prompts(n: int) -> list[dict]:
        # new random ids for every call: nothing for the prefix cache to reuse
        shape = (args.prompt_len,)
        return [
            {"prompt_token_ids": torch.randint(100, 40000, shape, generator=g).tolist()}
            for _ in range(n)
        ]

    engine = LLM(
        str(Path(args.model).expanduser()),
        dtype="bfloat16",
        max_model_len=args.prompt_len + 16,
        max_num_seqs=args.prompts,
        max_num_batched_tokens=args.prompts * args.prompt_len,
        distributed_executor_backend="uni",
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    try:
        engine.generate(fresh_prompts(2), params, use_tqdm=False)  # warm-up
        for _ in range(args.rounds):
            for name, fn in variants.items():
                paged_attention_cpu.prefill_supports_layout = fn
                prompts = fresh_prompts(args.prompts)
                t = time.perf_counter()
                engine.generate(prompts, params, use_tqdm=False)
                rates[name].append(args.prompts * args.prompt_len / (time.perf_counter() - t))
    finally:
        paged_attention_cpu.prefill_supports_layout = supported
        engine.shutdown()
    for name, r in rates.items():
        print(
            f"{name}: prefill {statistics.median(r):,.0f} tok/s (rounds: "
            f"{', '.join(f'{x:,.0f}' for x in r)})"
        )


if __name__ == "__main__":
    main()
