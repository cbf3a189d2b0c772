"""Concurrency-1 decode speed of ``trillm serve`` with and without ``--speculative-config``.

Servers of the same model run side by side: one without speculation, one per
``--speculative-config`` (the flag may be repeated, e.g. ``num_speculative_tokens`` 2 and 3);
``trillm bench serve`` sends each the same chat prompts (none of them among ``eagle_train.py``'s
training prompts), one at a time, greedy, ``ignore_eos``, ``--output-len`` tokens each. Runs
alternate server by server and round by round (each round starts one server later in the
list), so the machine's load hits all alike: on a shared machine only the ratios of one round
mean anything. Reported per round and configuration: TPOT (median, mean) and output tokens/s
of it and of the plain server, their ratios, and whether the greedy texts are identical (they
must be); then each configuration's acceptance over all rounds from its server's /metrics
(vLLM's series): per draft position
(``vllm:spec_decode_num_accepted_tokens_per_pos`` / ``vllm:spec_decode_num_drafts``), overall
(accepted / drafted) and the mean acceptance length (1 + accepted / drafts).

    python benchmarks/serving/spec_decode_served.py --model ~/.cache/trillm-eagle/smollm2-135m-instruct \\
        --speculative-config '{"method": "eagle", "model": "HEAD", "num_speculative_tokens": 3}' \\
        --out benchmarks/serving/results/eagle_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

from benchmarks.common import machine_info, print_table, run_bench_serve, trillm_server, write_json

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain why the sky is blue to a ten-year-old.",
    "List five ideas for a weekend trip and say why each is fun.",
    "Describe your favourite meal and how to cook it.",
    "Write a short story about an old clockmaker and his apprentice.",
    "Explain how a rainbow forms.",
    "Describe a walk through a busy harbour at dawn.",
    "Give me some advice for learning to play the guitar.",
]
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PER_POS = "num_accepted_tokens_per_pos"


def spec_counters(url: str) -> dict[str, list[float]]:
    """The speculating server's vllm:spec_decode_* counters, summed over engines
    (per position: a list)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list[float]] = {name: [0.0] for name in SPEC_COUNTERS}
    out[PER_POS] = []
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix("vllm:spec_decode_")
        if not family.name.startswith("vllm:spec_decode_") or name not in out:
            continue
        for sample in family.samples:
            pos = int(sample.labels.get("position", 0))
            values = out[name]
            values.extend([0.0] * (pos + 1 - len(values)))
            values[pos] += sample.value
    return out


def acceptance(before: dict[str, list[float]], after: dict[str, list[float]]) -> dict[str, Any]:
    diff = {k: [a - b for a, b in zip(after[k], before[k] or [0.0] * len(after[k]))] for k in after}
    drafts, drafted, accepted = (diff[k][0] for k in SPEC_COUNTERS)
    return {
        "num_drafts": drafts,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_per_position": [a / drafts if drafts else 0.0 for a in diff[PER_POS]],
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
    }


def bench_args(model: str, prompts_file: Path, args: argparse.Namespace) -> list[str]:
    return [
        "--model",
        model,
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(prompts_file),
        "--disable-shuffle",
        "--custom-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.prompts),
        "--max-concurrency",
        "1",
        "--ignore-eos",
        "--temperature",
        "0",
        "--save-detailed",
    ]


def server_order(rounds: int, names: list[str]) -> Iterator[tuple[int, list[str]]]:
    for r in range(rounds):
        first = r % len(names)
        yield r, names[first:] + names[:first]


def round_row(r: int, config: int, base: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    # trillm bench serve lists the texts in no fixed prompt order: compare them as multisets
    same = sum((Counter(base["generated_texts"]) & Counter(spec["generated_texts"])).values())
    return {
        "round": r,
        "config": config,
        "base_median_tpot_ms": base["median_tpot_ms"],
        "spec_median_tpot_ms": spec["median_tpot_ms"],
        "median_tpot_ratio": base["median_tpot_ms"] / spec["median_tpot_ms"],
        "mean_tpot_ratio": base["mean_tpot_ms"] / spec["mean_tpot_ms"],
        "base_tok_s": base["output_throughput"],
        "spec_tok_s": spec["output_throughput"],
        "tok_s_ratio": spec["output_throughput"] / base["output_throughput"],
        "identical": f"{same}/{len(base['generated_texts'])}",
    }


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    prompts_file = work / "prompts.jsonl"
    prompts = PROMPTS[: args.prompts]
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    common = ["--max-model-len", "1024", "--kv-cache-memory", "512MiB", "--seed", "0"]
    specs = [f"spec{i}" for i in range(len(args.speculative_config))]
    flags = {"base": []} | {
        name: ["--speculative-config", config]
        for name, config in zip(specs, args.speculative_config, strict=True)
    }
    with ExitStack() as stack:
        urls = {
            name: stack.enter_context(trillm_server(args.model, common + extra))[0]
            for name, extra in flags.items()
        }
        before = {name: spec_counters(urls[name]) for name in specs}
        rows, raw = [], []
        for r, order in server_order(args.rounds, list(flags)):
            runs = {
                name: run_bench_serve(
                    urls[name], bench_args(args.model, prompts_file, args), work / f"{name}{r}.json"
                )
                for name in order
            }
            rows += [round_row(r, i, runs["base"], runs[name]) for i, name in enumerate(specs)]
            raw.append(
                {n: {k: v for k, v in run.items() if k != "itls"} for n, run in runs.items()}
            )
        after = {name: spec_counters(urls[name]) for name in specs}
    configs = [
        {
            "speculative_config": json.loads(config),
            "acceptance": acceptance(before[name], after[name]),
            "median_tok_s_ratio": statistics.median(
                row["tok_s_ratio"] for row in rows if row["config"] == i
            ),
        }
        for i, (name, config) in enumerate(zip(specs, args.speculative_config, strict=True))
    ]
    return {"configs": configs, "rows": rows, "runs": raw}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--speculative-config",
        required=True,
        action="append",
        help="JSON, as trillm serve's; repeated: one server each",
    )
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="the first N of them")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="spec-served-") as work:
        result = measure(args, Path(work))
    rows = result["rows"]
    print_table(
        rows,
        [
            ("round", "d"),
            ("config", "d"),
            ("base_median_tpot_ms", ".1f"),
            ("spec_median_tpot_ms", ".1f"),
            ("median_tpot_ratio", ".2f"),
            ("mean_tpot_ratio", ".2f"),
            ("base_tok_s", ".2f"),
            ("spec_tok_s", ".2f"),
            ("tok_s_ratio", ".2f"),
            ("identical", "s"),
        ],
    )
    for i, config in enumerate(result["configs"]):
        acc = config["acceptance"]
        print(f"config {i} {json.dumps(config['speculative_config'])}:")
        print(f"  acceptance {acc['acceptance_rate']:.3f}; per position", end=" ")
        print(" ".join(f"{a:.3f}" for a in acc["acceptance_per_position"]), end="; ")
        print(f"mean acceptance length {acc['mean_acceptance_length']:.2f}")
        ratio = config["median_tok_s_ratio"]
        print(f"  median output tok/s ratio (spec / base) over {args.rounds} rounds: {ratio:.2f}")
    write_json(
        args.out,
        {
            "command": " ".join(sys.argv),
            "model": args.model,
            "output_len": args.output_len,
            "prompts": PROMPTS[: args.prompts],
            "load_avg_at_start": load_at_start,  # 1, 5, 15 min; machine: at the end
            "machine": machine_info(),
            **result,
        },
    )


if __name__ == "__main__":
    main()
