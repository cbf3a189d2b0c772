"""``trillm bench throughput``: every prompt handed to the offline engine at once; tokens/s."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from trillm.bench import datasets
from trillm.bench.engine_args import engine_kwargs_from_namespace, model_from_namespace

DEFAULT_INPUT_LEN = 1024
DEFAULT_OUTPUT_LEN = 128


def build_requests(args: argparse.Namespace) -> list[datasets.BenchRequest]:
    tokenizer = datasets.find_tokenizer(args.tokenizer, model_from_namespace(args))
    input_len = args.input_len or DEFAULT_INPUT_LEN
    output_len = args.output_len or DEFAULT_OUTPUT_LEN
    if args.dataset_name == "sharegpt":
        if args.dataset_path is None or tokenizer is None:
            raise datasets.DatasetError(
                "--dataset-name sharegpt needs --dataset-path and a local tokenizer "
                "(--tokenizer, or a model folder)."
            )
        return datasets.build_sharegpt(
            args.dataset_path,
            args.num_prompts,
            tokenizer,
            output_len=args.output_len,
            seed=args.seed or 0,
        )
    if args.dataset_name == "prefix-repetition":
        return datasets.build_prefix_repetition(
            args.num_prompts,
            args.prefix_len,
            input_len,
            1,
            output_len,
            seed=args.seed or 0,
            tokenizer=tokenizer,
        )
    return datasets.build_random(
        args.num_prompts,
        input_len,
        output_len,
        args.random_range_ratio,
        args.prefix_len,
        seed=args.seed or 0,
        tokenizer=tokenizer,
    )


def engine_prompt(req: datasets.BenchRequest) -> str | dict[str, list[int]]:
    return req.prompt if isinstance(req.prompt, str) else {"prompt_token_ids": list(req.prompt)}


def throughput_record(outputs: list[Any], elapsed: float) -> dict[str, Any]:
    """vLLM's JSON keys plus the output-token rate; counts come from the engine's outputs."""
    prompt_tokens = sum(len(o.prompt_token_ids or []) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_num_tokens": prompt_tokens + output_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }


def run_throughput(args: argparse.Namespace) -> int:
    from trillm.engine.llm import LLM
    from trillm.sampling_params import SamplingParams

    try:
        if args.num_prompts < 1:
            raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}.")
        model = model_from_namespace(args)
        requests = build_requests(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    prompts = [engine_prompt(r) for r in requests]
    params = [
        SamplingParams(
            temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=r.expected_output_len
        )
        for r in requests
    ]
    with LLM(model, **engine_kwargs_from_namespace(args)) as llm:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
        elapsed = time.perf_counter() - start
    record = throughput_record(outputs, elapsed)
    print(
        f"Throughput: {record['requests_per_second']:.2f} requests/s, "
        f"{record['tokens_per_second']:.2f} total tokens/s, "
        f"{record['output_tokens_per_second']:.2f} output tokens/s"
    )
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(record, indent=2))
        print(f"Saved the result to {args.output_json}")
    return 0
