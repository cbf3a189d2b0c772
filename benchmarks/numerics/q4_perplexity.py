"""Perplexity of a fixed text: a quantized GGUF kept quantized (fp32 and int8 activations) vs f32.

Each variant scores the same text with ``prompt_logprobs`` (teacher forcing, one forward over the
whole text: the prefill, where int8 activations apply from ``INT8_MIN_ROWS`` rows) and reports
exp(-mean log p) over its tokens. Variants: the f32 GGUF, then for each quantized GGUF (Q4_0 /
Q4_1 / Q8_0 / K-quants) fp32 activations (``INT8_MIN_ROWS`` raised past the text) and int8
activations as served.

    python benchmarks/numerics/q4_perplexity.py --f32 F32.gguf --quantized Q8_0.gguf Q4_1.gguf \
        [--text FILE [--max-chars N]] [--out x.json]

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


def perplexity(model: str, int8_min_rows: int, text: str = TEXT) -> tuple[float, int]:
    linear_q_cpu.INT8_MIN_ROWS = int8_min_rows  # the engine runs in this process ("uni")
    llm = LLM(
        model,
        dtype="float32",
        max_model_len=4096,
        kv_cache_memory="512MiB",
        distributed_executor_backend="uni",
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        out = llm.generate([text], params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    ids = out.prompt_token_ids
    logps = [step[tok].logprob for tok, step in zip(ids[1:], out.prompt_logprobs[1:], strict=True)]
    return math.exp(-sum(logps) / len(logps)), len(logps)


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
    args = p.parse_args()
    text = args.text.read_text()[: args.max_chars] if args.text else TEXT
    default = linear_q_cpu.INT8_MIN_ROWS
    variants = {"f32": (args.f32, default)}
    for path in args.quantized:
        kind = _gguf_kind(path)
        variants[f"{kind}, fp32 activations"] = (path, 1 << 30)
        variants[f"{kind}, int8 activations (from {default} rows)"] = (path, default)
    rows = []
    for name, (model, min_rows) in variants.items():
        ppl, tokens = perplexity(str(model), min_rows, text)
        rows.append(dict(variant=name, perplexity=ppl, tokens=tokens))
    base = rows[0]["perplexity"]
    for r in rows:
        r["vs_f32"] = r["perplexity"] / base - 1
        print(
            f"{r['variant']:<44} ppl {r['perplexity']:8.3f} ({r['vs_f32']:+.2%}) "
            f"over {r['tokens']} tokens"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
