"""Special tokens added to a checkpoint's tokenizer, inside the model's vocabulary (the
embedding grows, to a multiple of 16, when the tokenizer outgrows it; new rows are zero, so the
new tokens score 0 and the rest of the model is unchanged): a reasoning model's ``<think>`` /
``</think>`` (``build_reasoning_model``), a chat family's role markers (``family_chat.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

THINK_TOKENS = ("<think>", "</think>")


def add_special_tokens(src: str | Path, out: str | Path, tokens: list[str]) -> list[int]:
    """Copy the checkpoint ``src`` to ``out`` with ``tokens`` added as special tokens; -> their
    ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    shutil.copytree(src, out)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_special_tokens({"additional_special_tokens": list(tokens)})
    tok.save_pretrained(str(out))
    model: Any = AutoModelForCausalLM.from_pretrained(str(out))
    old = model.get_input_embeddings().weight.shape[0]
    if len(tok) > old:
        model.resize_token_embeddings(len(tok), pad_to_multiple_of=16, mean_resizing=False)
        with torch.no_grad():
            model.get_input_embeddings().weight[old:] = 0
            head = model.get_output_embeddings()
            if head is not None:
                head.weight[old:] = 0
        model.save_pretrained(str(out), safe_serialization=True)
    vocab = tok.get_vocab()
    return [vocab[t] for t in tokens]


def build_reasoning_model(src: str | Path, out: str | Path) -> tuple[Path, int, int]:
    """Copy the checkpoint ``src`` to ``out`` with the think tokens -> (out, <think> id,
    </think> id)."""
    start, end = add_special_tokens(src, out, list(THINK_TOKENS))
    return Path(out), start, end
