"""What ``numerics="transformers"`` costs: offline throughput of a model in the two numerics.

16 random 128-token prompts, 64 greedy tokens each (EOS ignored), one ``generate`` call timed
after a warm-up in a fresh engine per run; the two numerics alternated ``--rounds`` times in
one process.

    python benchmarks/numerics/numerics_speed.py ~/.cache/trillm-peer/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import random
import time

from trillm import LLM, SamplingParams

NEW_TOKENS = 64


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    args = p.parse_args()
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randint(100, 40000) for _ in range(128)]}
        for _ in range(args.prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    times: dict[str, list[float]] = {"fast": [], "transformers": []}
    for rnd in range(args.rounds):
        for numerics, runs in times.items():
            llm = LLM(args.model, dtype=args.dtype, numerics=numerics, max_model_len=512)
            try:
                llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                runs.append(time.perf_counter() - start)
            finally:
                llm.shutdown()
            rate = len(prompts) * NEW_TOKENS / runs[-1]
            print(f"round {rnd} {numerics:>12}: {runs[-1]:.2f} s, {rate:.1f} output tok/s")
    fast, exact = min(times["fast"]), min(times["transformers"])
    print(f"transformers / fast throughput (best of each): {fast / exact:.2f}")


if __name__ == "__main__":
    main()
