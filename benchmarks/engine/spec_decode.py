"""Batch-1 decode speed with and without speculative decoding (n-gram or a draft model), in one run.

Workload: chat prompts whose answer repeats the prompt (repeat / correct / edit a given text),
and, as controls, prompts whose answer does not (free writing; a list of random words to
summarize, where drafts keep failing and the back-off must keep the cost down). Each prompt runs alone
(batch 1), greedy, on two engines of the same model built side by side: without speculation
and with ``--speculative-config`` (the same JSON). Runs alternate engine by engine, prompt by
prompt, so machine noise hits both alike. Reported per workload: output tokens/s of each, the
speed-up, the acceptance rate (accepted / drafted tokens), the mean tokens per verifying
forward, and whether the texts are identical (they must be: greedy).

    python benchmarks/engine/spec_decode.py [--model PATH] [--out benchmarks/engine/results/spec_decode.json]
    python benchmarks/engine/spec_decode.py --draft-layers 6   # draft: the model's first 6 layers

``--model`` defaults to ~/.cache/trillm-peer/smollm2-135m-instruct when present, else the
embedded default model. ``--draft-layers N`` writes a truncated copy of the model (its first N
layers, its final norm and head; same tokenizer) beside it once and speculates with it as a
draft model (``--num-speculative-tokens`` drafts).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

from benchmarks.common import machine_info, print_table, write_json
from trillm import LLM, SamplingParams

PEER_MODEL = Path("~/.cache/trillm-peer/smollm2-135m-instruct").expanduser()
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the "
    "clocks were striking thirteen. The committee met on Tuesday to review the budget for the "
    "coming year and agreed to postpone the decision until the next meeting.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon "
    "dioxide to produce glucose and oxygen. It takes place mainly in the leaves, inside the "
    "chloroplasts, which contain the green pigment chlorophyll.",
    "def total_price(items):\n    total = 0\n    for item in items:\n        total += "
    "item.price * item.quantity\n    return total\n\n\ndef average_price(items):\n    if not "
    "items:\n        return 0\n    return total_price(items) / len(items)\n",
    "Dear team, thank you for your hard work this quarter. Sales grew by twelve percent, the "
    "new warehouse opened on schedule, and customer complaints fell for the third month in a "
    "row. Please join us on Friday afternoon for a small celebration in the main hall.",
]
REPEAT = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Correct any spelling mistakes in this text and return the whole text:\n\n{}",
    "Rewrite this text exactly as it is, keeping every line:\n\n{}",
]
WORDS = (
    "river window orange seven engine marble quiet ladder violet thunder pencil garden "
    "copper whisper island candle frozen basket silver planet jacket meadow rocket velvet "
    "harbor lemon anchor puzzle falcon desert mirror cotton jungle saddle canyon tulip"
).split()
RANDOM = [
    "Summarize the mood of these words in two sentences: "
    + " ".join(random.Random(seed).choices(WORDS, k=60))
    for seed in range(4)
]
FREE = [
    "Write a short story about a lighthouse keeper.",
    "Explain why the sky is blue to a ten-year-old.",
    "List five ideas for a weekend trip and say why each is fun.",
    "Describe your favourite meal and how to cook it.",
]


def truncated_draft(model: str, layers: int) -> str:
    """A copy of ``model`` with its first ``layers`` decoder layers (plus embeddings, final
    norm, head and tokenizer), written beside it once; its folder."""
    from safetensors.torch import load_file, save_file

    src = Path(model)
    out = src.parent / f"{src.name}-first{layers}layers"
    if (out / "model.safetensors").exists():
        return str(out)
    out.mkdir(exist_ok=True)
    keep = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if ".layers." in name and int(name.split(".layers.")[1].split(".")[0]) >= layers:
            continue
        keep[name] = tensor
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in (
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    save_file(keep, out / "model.safetensors", metadata={"format": "pt"})
    return str(out)


def run_one(llm: LLM, prompt: str, params: SamplingParams) -> tuple[float, int, str]:
    start = time.perf_counter()
    out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0].outputs[0]
    return time.perf_counter() - start, len(out.token_ids), out.text


def spec_counts(llm: LLM) -> tuple[int, int, int]:
    s = llm.engine.get_stats().spec_decoding
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens


def measure(base: LLM, spec: LLM, prompts: list[str], params: SamplingParams) -> dict[str, Any]:
    t_base = t_spec = 0.0
    n_base = n_spec = 0
    identical = 0
    drafts0, drafted0, accepted0 = spec_counts(spec)
    for prompt in prompts:
        tb, nb, text_b = run_one(base, prompt, params)
        ts, ns, text_s = run_one(spec, prompt, params)
        t_base, n_base, t_spec, n_spec = t_base + tb, n_base + nb, t_spec + ts, n_spec + ns
        identical += text_b == text_s
    drafts1, drafted1, accepted1 = spec_counts(spec)
    drafts, drafted, accepted = drafts1 - drafts0, drafted1 - drafted0, accepted1 - accepted0
    return {
        "prompts": len(prompts),
        "output_tokens": n_base,
        "base_tok_s": n_base / t_base,
        "spec_tok_s": n_spec / t_spec,
        "speedup": (n_spec / t_spec) / (n_base / t_base),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_verify": (drafts + accepted) / drafts if drafts else 0.0,
        "identical": f"{identical}/{len(prompts)}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(PEER_MODEL) if PEER_MODEL.is_dir() else None)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--speculative-config", default=json.dumps(SPEC))
    parser.add_argument("--draft-layers", type=int, default=None)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=None, help="per workload, at most")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.draft_layers is not None:
        draft = truncated_draft(args.model, args.draft_layers)
        args.speculative_config = json.dumps(
            {
                "method": "draft_model",
                "model": draft,
                "num_speculative_tokens": args.num_speculative_tokens,
            }
        )
    kw: dict[str, Any] = {
        "max_model_len": 1024,
        "kv_cache_memory": "256MiB",
        "distributed_executor_backend": "uni",
    }
    base = LLM(args.model, **kw)
    spec = LLM(args.model, speculative_config=args.speculative_config, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    run_one(base, "Hello", params)  # warm-up, both engines
    run_one(spec, "Hello", params)
    rows = []
    repeat = [t.format(text) for t in REPEAT for text in TEXTS]
    for name, prompts in (
        ("repeat/edit the prompt", repeat),
        ("free writing (control)", FREE),
        ("random words (control)", RANDOM),
    ):
        row = {"workload": name, **measure(base, spec, prompts[: args.prompts], params)}
        rows.append(row)
    print_table(
        rows,
        [
            ("workload", "s"),
            ("prompts", "d"),
            ("output_tokens", "d"),
            ("base_tok_s", ".1f"),
            ("spec_tok_s", ".1f"),
            ("speedup", ".2f"),
            ("acceptance_rate", ".3f"),
            ("tokens_per_verify", ".2f"),
            ("identical", "s"),
        ],
    )
    write_json(
        args.out,
        {
            "model": args.model or "embedded default",
            "speculative_config": json.loads(args.speculative_config),
            "max_tokens": args.max_tokens,
            "machine": machine_info(),
            "rows": rows,
        },
    )
    base.shutdown()
    spec.shutdown()


if __name__ == "__main__":
    main()
