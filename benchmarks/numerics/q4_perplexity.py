"""Perplexity of a fixed text: a quantized GGUF kept quantized (fp32 and int8 activations) vs f32.

Each variant scores the same text with ``prompt_logprobs`` (teacher forcing, one forward over the
whole text: the prefill, where int8 activations apply from ``INT8_MIN_ROWS`` rows) and reports
exp(-mean log p) over its tokens. Variants: the f32 GGUF, then for each quantized GGUF (Q4_0 /
Q4_1 / Q8_0 / K-quants) fp32 activations (``INT8_MIN_ROWS`` raised past the text) and int8
activations as served.

    python benchmarks/numerics/q4_perplexity.py --f32 F32.gguf --quantized Q8_0.gguf Q4_1.gguf \
        [--text FILE [--max-chars N]] [--out x.json] [--dtypes float32:bfloat16 bfloat16:auto]
        [--greedy 64]

``--dtypes DTYPE:KV_CACHE_DTYPE ...`` adds, per quantized GGUF, a row as served (int8
activations) for each pair (the rows above run float32 with the cache in float32).
``--greedy N`` also generates N greedy tokens from a few fixed prompts with every variant and
counts the tokens each matches the f32 GGUF's (up to its first differing token).

``--text`` scores a file's text instead of the built-in paragraph (187 tokens of SmolLM2's
tokenizer): ``benchmarks/numerics/perplexity_text.txt`` is 2,722 tokens of prose written for this
(narrative, a recipe, letters, a little mathematics); ``--max-chars`` keeps the first N
characters.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

from benchmarks import common  # noqa: F401 - puts the repository root on sys.path
from trillm import LLM, SamplingParams
from trillm.kernels import linear_q_cpu

TEXT = (
    "The river rose slowly through the night, and by morning the lower fields were under water. "
    "Farmers moved their animals to the hills, and the school in the valley closed for a week. "
    "Engineers from the city arrived to inspect the old stone bridge, which had stood for more "
    "than two hundred years. They measured the cracks in its arches, tested the mortar, and "
    "found that the foundations were sound, although the railings would need to be replaced. "
    "When the water finally fell, the villagers cleared the mud from their houses and counted "
    "what had been lost. Most of the harvest was gone, but the seed stores had stayed dry, and "
    "the council agreed to share them so that every family could plant again in the spring. "
    "Years later, children would still ask their grandparents about the flood, and the story "
    "was always the same: the water came quietly, it took what it wanted, and the people who "
    "worked together were the ones who recovered first."
)


GREEDY_PROMPTS = (
    "The three primary colors are",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "The capital of France is Paris. The capital of Germany is",
    "Once upon a time, in a small village,",
    "Explain why the sky is blue.",
    "1, 2, 3, 5, 8, 13,",
    "The best way to learn a language is",
)


def perplexity(
    model: str,
    int8_min_rows: int,
    text: str = TEXT,
    dtype: str = "float32",
    kv_cache_dtype: str = "auto",
    greedy: int = 0,
) -> tuple[float, int, list[list[int]]]:
    """(perplexity, tokens scored, each GREEDY_PROMPTS' ``greedy`` greedy token ids)."""
    linear_q_cpu.INT8_MIN_ROWS = int8_min_rows  # the engine runs in this process ("uni")
    llm = LLM(
        model,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=4096,
        kv_cache_memory="512MiB",
        distributed_executor_backend="uni",
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        out = llm.generate([text], params, use_tqdm=False)[0]
        tokens: list[list[int]] = []
        if greedy:
            gen = SamplingParams(temperature=0, max_tokens=greedy, ignore_eos=True)
            outs = llm.generate(list(GREEDY_PROMPTS), gen, use_tqdm=False)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()
    ids = out.prompt_token_ids
    logps = [step[tok].logprob for tok, step in zip(ids[1:], out.prompt_logprobs[1:], strict=True)]
    return math.exp(-sum(logps) / len(logps)), len(logps), tokens


def _prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _gguf_kind(path: Path) -> str:
    """The GGML type of the file's first-layer gate projection: its format, for the table."""
    from trillm.model_executor.gguf_loader import GGUFFile

    return GGUFFile(path).tensor_types.get("blk.0.ffn_gate.weight", path.name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--f32", type=Path, required=True)
    p.add_argument("--quantized", "--q4", dest="quantized", type=Path, nargs="+", required=True)
    p.add_argument("--text", type=Path, default=None)
    p.add_argument("--max-chars", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--dtypes", nargs="*", default=[], help="DTYPE:KV_CACHE_DTYPE pairs")
    p.add_argument("--greedy", type=int, default=0)
    args = p.parse_args()
    text = args.text.read_text()[: args.max_chars] if args.text else TEXT
    default = linear_q_cpu.INT8_MIN_ROWS
    variants = {"f32": (args.f32, default, "float32", "auto")}
    for path in args.quantized:
        kind = _gguf_kind(path)
        variants[f"{kind}, fp32 activations"] = (path, 1 << 30, "float32", "auto")
        variants[f"{kind}, int8 activations (from {default} rows)"] = (
            path, default, "float32", "auto"
        )  # fmt: skip
        for pair in args.dtypes:
            dtype, kv = pair.split(":")
            variants[f"{kind}, int8 activations, dtype {dtype}, kv {kv}"] = (
                path, default, dtype, kv
            )  # fmt: skip
    rows = []
    for name, (model, min_rows, dtype, kv) in variants.items():
        ppl, tokens, greedy = perplexity(str(model), min_rows, text, dtype, kv, args.greedy)
        rows.append(dict(variant=name, perplexity=ppl, tokens=tokens, greedy=greedy))
    base = rows[0]["perplexity"]
    for r in rows:
        r["vs_f32"] = r["perplexity"] / base - 1
        line = (
            f"{r['variant']:<56} ppl {r['perplexity']:8.3f} ({r['vs_f32']:+.2%}) "
            f"over {r['tokens']} tokens"
        )
        if args.greedy:
            shared = [_prefix(a, b) for a, b in zip(r["greedy"], rows[0]["greedy"], strict=True)]
            r["greedy_prefix_vs_f32"] = shared
            same = sum(n == args.greedy for n in shared)
            line += f"; greedy vs f32: {same}/{len(shared)} identical, prefixes {shared}"
        print(line)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
