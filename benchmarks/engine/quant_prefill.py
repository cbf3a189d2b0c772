"""One fresh prompt's prefill on a quantized GGUF against the bf16 checkpoint, alternated in one
process: ``LLM.generate`` with ``max_tokens=1`` on a random prompt of ``--prompt-len`` tokens,
the engine in this process (``uni``) so the process's CPU time (all threads) is the prefill's
(on a shared machine the wall time follows the load, the CPU seconds much less). Medians over
``--rounds`` after one warm-up round.

    python benchmarks/engine/quant_prefill.py \
        --gguf ~/.cache/trillm-peer/llama-3.2-1b-shape/llama-3.2-1b-q4_0.gguf \
        --hf ~/.cache/trillm-peer/llama-3.2-1b-shape/llama-3.2-1b --prompt-len 1024 --rounds 3

``--max-num-batched-tokens 2048`` chunks a longer prompt as the server does (its default budget).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

import torch  # noqa: E402

from trillm import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--hf", type=Path, required=True, help="the bf16 checkpoint (tokenizer)")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the step budget (chunk size of a longer prompt); default: the LLM class's (4,096 on "
        "CPU); 2,048 is the server's",
    )
    args = parser.parse_args()
    kw = dict(
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=args.prompt_len + 16,
        max_num_seqs=1,
        kv_cache_memory="1GiB",
        enable_prefix_caching=False,
        distributed_executor_backend="uni",
    )
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    llms = {
        args.gguf.name: LLM(model=str(args.gguf), tokenizer=str(args.hf), **kw),
        "bf16": LLM(model=str(args.hf), **kw),
    }
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in llms}
    for r in range(args.rounds + 1):
        for name, llm in llms.items():
            ids = torch.randint(1000, 30000, (args.prompt_len,), generator=g).tolist()
            c, w = time.process_time(), time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            cpu, wall = time.process_time() - c, time.perf_counter() - w
            if r:  # round 0 warms up
                samples[name].append((cpu, wall))
            print(
                f"round {r} {name}: CPU {cpu:.2f} s, wall {wall:.2f} s, load {os.getloadavg()[0]:.1f}"
            )
    for name, v in samples.items():
        cpus, walls = zip(*v, strict=True)
        print(
            f"{name}: median CPU {statistics.median(cpus):.2f} s (min {min(cpus):.2f}), "
            f"median wall {statistics.median(walls):.2f} s"
        )


if __name__ == "__main__":
    main()
