"""Greedy bf16 output of trillm against transformers' bf16 output, prompt by prompt.

Twenty fixed chat prompts (the model's chat template), greedy, ``--new-tokens`` tokens with EOS
ignored, through ``trillm.LLM(model, dtype="bfloat16")`` (one batch, as the engine schedules
it) and through transformers' ``AutoModelForCausalLM`` in bf16 with eager attention (one prompt
at a time, a KV cache, the logits of each step kept). Per prompt: equal, or the first differing
step, the two tokens, and transformers' top-2 logit gap at that step next to one bf16 step
(ulp) of its top logit: a gap of at most one ulp is a near-tie, where the order of two
roundings decides the token.

    python benchmarks/numerics/bf16_vs_hf.py --model ~/.cache/trillm-peer/smollm2-135m-instruct \
        --out benchmarks/numerics/results/bf16_vs_hf.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*, trillm

import torch  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three uses of a paperclip.",
    "What is 17 times 23?",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.",
    "Write a Python function that reverses a string.",
    "Who wrote Pride and Prejudice?",
    "Describe a cat to someone who has never seen one.",
    "What are the planets of the solar system?",
    "Summarise the plot of Romeo and Juliet.",
    "How do I make a cup of tea?",
    "What is the difference between weather and climate?",
    "Tell me a short joke about computers.",
    "What does a CPU do?",
    "Name five fruits that are red.",
    "How many days are there in a leap year?",
    "Write a limerick about a dog.",
]


def bf16_ulp(x: float) -> float:
    """One bf16 step at |x| (8 significant bits)."""
    if x == 0:
        return 2.0**-133
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def hf_greedy(model: Any, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each step's logits [V] (bf16 logits as float), KV-cached like
    ``generate``."""
    from transformers import DynamicCache

    cache = DynamicCache()
    x = torch.tensor([ids])
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    with torch.no_grad():
        for _ in range(n):
            out = model(input_ids=x, past_key_values=cache, use_cache=True)
            step = out.logits[0, -1].float()  # [V]
            tok = int(step.argmax())
            tokens.append(tok)
            logits.append(step)
            x = torch.tensor([[tok]])
    return tokens, logits


def hf_batched_greedy(
    model: Any, prompt_ids: list[list[int]], n: int, pad_id: int
) -> list[tuple[list[int], list[torch.Tensor]]]:
    """``hf_greedy`` for all prompts in one left-padded batch (an attention mask, positions
    counted from each prompt's first real token, one KV cache): the same model and dtype, only
    the batch shape differs, as it does in any batching server."""
    from transformers import DynamicCache

    width = max(len(ids) for ids in prompt_ids)
    x = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in prompt_ids])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids])
    cache = DynamicCache()
    tokens: list[list[int]] = [[] for _ in prompt_ids]
    logits: list[list[torch.Tensor]] = [[] for _ in prompt_ids]
    with torch.no_grad():
        for step in range(n):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            if step:
                positions = positions[:, -1:]
            out = model(
                input_ids=x,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )
            last = out.logits[:, -1].float()  # [B, V]
            picked = last.argmax(-1)
            for i, tok in enumerate(picked.tolist()):
                tokens[i].append(int(tok))
                logits[i].append(last[i].clone())
            x = picked[:, None]
            mask = torch.cat([mask, torch.ones(len(prompt_ids), 1, dtype=mask.dtype)], dim=1)
    return list(zip(tokens, logits, strict=True))


def load_reference(
    path: Path | None, prompt_ids: list[list[int]], n: int
) -> list[tuple[list[int], list[torch.Tensor]]] | None:
    """A saved transformers run for exactly these prompts and length, else None."""
    if path is None or not path.exists():
        return None
    saved = torch.load(path)
    if saved["prompt_ids"] != prompt_ids or saved["new_tokens"] != n:
        return None
    return [(tokens, list(logits)) for tokens, logits in saved["runs"]]


def save_reference(
    path: Path, prompt_ids: list[list[int]], n: int, runs: list[tuple[list[int], Any]]
) -> None:
    # the full logits of every step, as bf16 (they are bf16 values): ~20 x 48 x 49k x 2 bytes
    packed = [(tokens, torch.stack(logits).to(torch.bfloat16)) for tokens, logits in runs]
    torch.save({"prompt_ids": prompt_ids, "new_tokens": n, "runs": packed}, path)


def run_trillm(
    model: str, prompt_ids: list[list[int]], n: int, max_num_seqs: int, numerics: str = "fast"
) -> list[Any]:
    from trillm import LLM, SamplingParams

    engine = LLM(
        model,
        dtype="bfloat16",
        max_model_len=512,
        max_num_seqs=max_num_seqs,
        distributed_executor_backend="uni",
        numerics=numerics,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)
        prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
        return engine.generate(prompts, params, use_tqdm=False)
    finally:
        engine.shutdown()


def compare(
    prompt: str, ours: list[int], theirs: list[int], hf_logits: list[torch.Tensor]
) -> dict[str, Any]:
    row: dict[str, Any] = {"prompt": prompt, "equal": ours == theirs}
    if ours == theirs:
        return row
    i = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
    top2 = hf_logits[i].topk(2)
    top, second = float(top2.values[0]), float(top2.values[1])
    ulp = bf16_ulp(top)
    row.update(
        step=i,
        ours=ours[i],
        hf=theirs[i],
        hf_top1=top,
        hf_top2=second,
        hf_logit_of_ours=float(hf_logits[i][ours[i]]),
        gap=top - second,
        ulp=ulp,
        near_tie=top - second <= ulp,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a local HF folder (the real model)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--max-num-seqs", type=int, default=20, help="trillm's batch limit")
    parser.add_argument("--out", type=Path, help="write the per-prompt rows as JSON here")
    parser.add_argument(
        "--hf-cache",
        type=Path,
        help="transformers' tokens and top logits: read from here if present (same prompts "
        "and length), else computed and written here (its run is the slow half)",
    )
    parser.add_argument(
        "--no-bf16-kernel",
        action="store_true",
        help="every bf16 linear through torch's F.linear, as transformers runs them (the "
        "engine runs in this process: distributed_executor_backend='uni')",
    )
    parser.add_argument(
        "--numerics",
        choices=["fast", "transformers"],
        default="fast",
        help="trillm's numerics engine argument (transformers: every op as transformers runs it)",
    )
    parser.add_argument(
        "--against-hf-batched",
        action="store_true",
        help="compare transformers' one-prompt-at-a-time run with transformers itself on all "
        "prompts in one left-padded batch instead of with trillm: how far batching alone moves "
        "bf16 greedy output",
    )
    parser.add_argument(
        "--reference-batched",
        action="store_true",
        help="compare trillm with transformers on all prompts in one left-padded batch (as "
        "trillm batches them) instead of one prompt at a time",
    )
    args = parser.parse_args()
    if args.against_hf_batched and args.reference_batched:
        parser.error("--against-hf-batched and --reference-batched exclude each other")
    if args.no_bf16_kernel:
        from trillm.kernels import linear_cpu

        linear_cpu.available_bf16 = lambda: False  # read when the weights are packed at load
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = str(Path(args.model).expanduser())
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt_ids = [chat_ids(tokenizer, p) for p in PROMPTS]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def load_hf() -> Any:
        return AutoModelForCausalLM.from_pretrained(
            model, dtype=torch.bfloat16, attn_implementation="eager"
        ).eval()

    t0 = time.time()
    if args.reference_batched:
        reference = hf_batched_greedy(load_hf(), prompt_ids, args.new_tokens, pad)
    else:
        reference = load_reference(args.hf_cache, prompt_ids, args.new_tokens)
        if reference is None:
            hf = load_hf()
            reference = [hf_greedy(hf, ids, args.new_tokens) for ids in prompt_ids]
            if args.hf_cache:
                save_reference(args.hf_cache, prompt_ids, args.new_tokens, reference)
    t1 = time.time()
    if args.against_hf_batched:
        batched = hf_batched_greedy(load_hf(), prompt_ids, args.new_tokens, pad)
        ours_all = [tokens for tokens, _ in batched]
    else:
        outs = run_trillm(model, prompt_ids, args.new_tokens, args.max_num_seqs, args.numerics)
        ours_all = [list(out.outputs[0].token_ids) for out in outs]
    t2 = time.time()
    rows = []
    for prompt, (theirs, logits), ours in zip(PROMPTS, reference, ours_all, strict=True):
        rows.append(compare(prompt, ours, theirs, logits))
    equal = sum(r["equal"] for r in rows)
    for r in rows:
        if r["equal"]:
            print(f"equal      {r['prompt']!r}")
        else:
            print(
                f"step {r['step']:>3}   {r['prompt']!r}: ours {r['ours']} hf {r['hf']}; hf top-2 "
                f"{r['hf_top1']:.5g} / {r['hf_top2']:.5g} (gap {r['gap']:.4g}, 1 ulp "
                f"{r['ulp']:.4g}{', near-tie' if r['near_tie'] else ''}); hf logit of ours "
                f"{r['hf_logit_of_ours']:.5g}"
            )
    equal32 = sum(r["equal"] or r["step"] >= 32 for r in rows)
    print(
        f"{equal} / {len(rows)} equal ({args.new_tokens} tokens each; {equal32} / "
        f"{len(rows)} over the first 32); transformers{' batched' * args.reference_batched} "
        f"{t1 - t0:.1f} s, "
        f"{'transformers batched' if args.against_hf_batched else 'trillm'} "
        f"{t2 - t1:.1f} s"
    )
    if args.out:
        summary = {
            "command": " ".join(sys.argv),
            "equal": equal,
            "equal_first_32": equal32,
            "prompts": len(rows),
            "new_tokens": args.new_tokens,
            "max_num_seqs": args.max_num_seqs,
            "no_bf16_kernel": args.no_bf16_kernel,
            "numerics": args.numerics,
            "against_hf_batched": args.against_hf_batched,
            "reference_batched": args.reference_batched,
            "rows": rows,
        }
        args.out.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
