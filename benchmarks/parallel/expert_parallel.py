"""Bytes each rank sends in the experts' all-to-alls under ``--enable-expert-parallel``, per
forward step, for a prefill and for a decode step of a batch.

A random Mixtral-shaped checkpoint (``--hidden``, ``--experts``, top-2, ``--layers``; float32)
runs at tensor_parallel_size 2 with expert parallelism in a child process, twice: the batch's
prompts with max_tokens 1 (its prefill steps) and with max_tokens 1 + ``--decode-steps``. On
shutdown every rank prints ``tensor-parallel rank r: S forward steps, ... B bytes sent in X
expert all-to-alls``; a decode step's bytes are the two runs' difference over the decode
steps. The model's routing is random, so about half of a token's pairs go to the other rank.

    python benchmarks/parallel/expert_parallel.py --out benchmarks/parallel/results/expert_parallel.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

RANK_LINE = re.compile(
    r"tensor-parallel rank (\d+): (\d+) forward steps, .* (\d+) bytes sent in (\d+) expert"
)
PROMPT = "The quick brown fox jumps over the lazy dog and runs far away. "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-repeats", type=int, default=4, help="copies of PROMPT per prompt")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--out", type=Path)
    p.add_argument("--child", nargs=2, metavar=("MODEL", "MAX_TOKENS"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> Path:
    from trillm.testing.tiny_models import build_tiny_model

    name = f"mixtral-h{args.hidden}-e{args.experts}-l{args.layers}"
    folder = Path.home() / ".cache" / "trillm-bench" / name
    if not (folder / "config.json").exists():
        build_tiny_model(
            "mixtral",
            folder,
            hidden_size=args.hidden,
            intermediate_size=2 * args.hidden,
            num_hidden_layers=args.layers,
            num_local_experts=args.experts,
            num_attention_heads=8,
            num_key_value_heads=2,
        )
    return folder


def child(args: argparse.Namespace) -> None:
    from trillm.engine.llm import LLM
    from trillm.sampling_params import SamplingParams

    model, max_tokens = args.child
    prompts = [f"{i}: " + PROMPT * args.prompt_repeats for i in range(args.num_prompts)]
    params = SamplingParams(max_tokens=int(max_tokens), temperature=0, ignore_eos=True)
    with LLM(
        model,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        max_model_len=1024,
        max_num_batched_tokens=4096,
        kv_cache_memory="64MiB",
    ) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    print(json.dumps({"prompt_tokens": sum(len(o.prompt_token_ids) for o in outs)}))


def run(model: Path, max_tokens: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", str(model), str(max_tokens)]
    cmd += ["--num-prompts", str(args.num_prompts), "--prompt-repeats", str(args.prompt_repeats)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    ranks = {
        int(m[1]): {"steps": int(m[2]), "bytes": int(m[3]), "all_to_alls": int(m[4])}
        for m in RANK_LINE.finditer(done.stderr)
    }
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "ranks": ranks}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    model = build(args)
    prefill = run(model, 1, args)
    decode = run(model, 1 + args.decode_steps, args)
    per_decode = {
        rank: (decode["ranks"][rank]["bytes"] - prefill["ranks"][rank]["bytes"]) / args.decode_steps
        for rank in prefill["ranks"]
    }
    result = {
        "model": {"hidden": args.hidden, "experts": args.experts, "top_k": 2},
        "layers": args.layers,
        "batch": args.num_prompts,
        "prompt_tokens": prefill["prompt_tokens"],
        "prefill_run": prefill["ranks"],
        "decode_run": decode["ranks"],
        "decode_step_bytes_per_rank": per_decode,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
