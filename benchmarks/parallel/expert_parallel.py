"""Bytes each rank sends in the experts' all-to-alls under ``--enable-expert-parallel``, per
forward step, for a prefill and for a decode step of a batch.

A random Mixtral-shaped checkpoint (``--hidden``, ``--experts``, top-2, ``--layers``; float32)
runs at tensor_parallel_size 2 with expert parallelism in a child process, twice: the batch's
prompts with max_tokens 1 (its prefill steps) and with max_tokens 1 + ``--decode-steps``. On
shutdown every rank prints ``tensor-parallel rank r: S forward steps, ... B bytes sent in X
expert all-to-alls``; a decode step's bytes are the two runs' difference over the decode
steps. The model's routing is random, so about half of a token's pairs go to the other rank.

``--tpot``: a lone greedy request's time per output token (TPOT, first to last token over the
tokens after the first) at one rank (with the machine's threads, and with one thread as each
rank of the others gets on 2 cores), ``-tp 2 -ep`` and ``-dp 2 -ep`` (one core serves it, the
other idle, sending a dummy forward, every MoE layer's exchanges with no tokens, for each of
its forwards), each layout a fresh child process (a warm-up request, then ``--repeats`` lone
requests), the layouts alternating within each of ``--rounds``; medians per layout. Then each
expert-parallel rank's bytes sent per decode step: one more child per layout whose requests
stop after their first token, the difference over the decode steps. ``--hidden 0``: the tiny
MoE checkpoint the tests use (tests/parallel/test_expert_parallel*.py: hidden 64, 4 experts,
intermediate size 37).

    python benchmarks/parallel/expert_parallel.py --out benchmarks/parallel/results/expert_parallel.json
    python benchmarks/parallel/expert_parallel.py --tpot --hidden 0 --out benchmarks/parallel/results/expert_parallel_tpot_tiny.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

RANK_LINE = re.compile(
    r"tensor-parallel rank (\d+)(?: of engine core (\d+))?: (\d+) forward steps, .* (\d+) bytes "
    r"sent in (\d+) expert"
)
LAYOUTS = {  # -> LLM's parallel arguments
    "one rank": {},
    "one rank (1 thread)": {},  # as each rank of the others on 2 cores (ONE_THREAD)
    "-tp 2 -ep": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
    "-dp 2 -ep": {"data_parallel_size": 2, "enable_expert_parallel": True},
}
ONE_THREAD = {"one rank (1 thread)": {"VLLM_CPU_OMP_THREADS_BIND": "0"}}  # the child's env
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
    p.add_argument("--tpot", action="store_true", help="a lone request's TPOT per layout")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="lone requests per child (--tpot)")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="--tpot: comma-separated")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "MAX_TOKENS"), help=argparse.SUPPRESS)
    p.add_argument("--tpot-child", nargs=3, help=argparse.SUPPRESS)  # MODEL LAYOUT MAX_TOKENS
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> Path:
    from trillm.testing.tiny_models import build_tiny_model

    name = f"mixtral-h{args.hidden}-e{args.experts}-l{args.layers}"
    if args.hidden == 0:
        name = "mixtral-tests-l2-i37"
    folder = Path.home() / ".cache" / "trillm-bench" / name
    if args.hidden == 0 and not (folder / "config.json").exists():
        build_tiny_model("mixtral", folder, num_hidden_layers=2, intermediate_size=37)
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


def tpot_child(args: argparse.Namespace) -> None:
    """A warm-up request, then ``--repeats`` lone requests; prints their TPOTs (s)."""
    from trillm.engine.llm import LLM
    from trillm.sampling_params import SamplingParams

    model, layout, max_tokens = args.tpot_child
    params = SamplingParams(max_tokens=int(max_tokens), temperature=0, ignore_eos=True)
    tpots = []
    with LLM(
        model,
        **LAYOUTS[layout],
        max_model_len=256,
        kv_cache_memory="64MiB",
        enable_prefix_caching=False,
    ) as llm:
        for i in range(1 + args.repeats):
            (out,) = llm.generate([PROMPT], params, use_tqdm=False)
            m, n = out.metrics, len(out.outputs[0].token_ids)
            if i and m is not None and n > 1:
                tpots.append((m.last_token_time - m.first_token_time) / (n - 1))
    print(json.dumps({"tpot_s": tpots}))


def run_tpot(model: Path, layout: str, max_tokens: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--tpot-child", str(model), layout, str(max_tokens)]
    env = {**os.environ, **ONE_THREAD.get(layout, {})}
    done = subprocess.run(
        [*cmd, "--repeats", str(args.repeats)], capture_output=True, text=True, check=True, env=env
    )
    ranks = {
        f"core {m[2] or 0} rank {m[1]}": {"bytes": int(m[4]), "all_to_alls": int(m[5])}
        for m in RANK_LINE.finditer(done.stderr)
    }
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "ranks": ranks}


def tpot_main(args: argparse.Namespace, model: Path) -> dict:
    layouts = args.layouts.split(",")
    tpots: dict[str, list[float]] = {layout: [] for layout in layouts}
    load = [os.getloadavg()[0]]
    for rnd in range(args.rounds):
        order = layouts if rnd % 2 == 0 else layouts[::-1]
        for layout in order:
            tpots[layout] += run_tpot(model, layout, args.output_len, args)["tpot_s"]
            load.append(os.getloadavg()[0])
            print(f"round {rnd} {layout}: {tpots[layout][-args.repeats :]}", file=sys.stderr)
    decode_steps = (1 + args.repeats) * (args.output_len - 1)
    step_bytes = {}
    for layout in ("-tp 2 -ep", "-dp 2 -ep"):
        prefill = run_tpot(model, layout, 1, args)["ranks"]
        whole = run_tpot(model, layout, args.output_len, args)["ranks"]
        step_bytes[layout] = {
            rank: (whole[rank]["bytes"] - prefill[rank]["bytes"]) / decode_steps for rank in whole
        }
    return {
        "model": str(model.name),
        "output_len": args.output_len,
        "requests_per_layout": args.rounds * args.repeats,
        "tpot_ms_median": {k: 1e3 * statistics.median(v) for k, v in tpots.items()},
        "tpot_ms": {k: [round(1e3 * t, 3) for t in v] for k, v in tpots.items()},
        "decode_step_bytes_per_rank": step_bytes,
        "load_1min": [round(x, 1) for x in load],
    }


def run(model: Path, max_tokens: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", str(model), str(max_tokens)]
    cmd += ["--num-prompts", str(args.num_prompts), "--prompt-repeats", str(args.prompt_repeats)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    ranks = {
        int(m[1]): {"steps": int(m[3]), "bytes": int(m[4]), "all_to_alls": int(m[5])}
        for m in RANK_LINE.finditer(done.stderr)
    }
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "ranks": ranks}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        child(args)
        return
    if args.tpot_child:
        tpot_child(args)
        return
    model = build(args)
    if args.tpot:
        result = tpot_main(args, model)
        print(json.dumps(result, indent=2))
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
        return
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
