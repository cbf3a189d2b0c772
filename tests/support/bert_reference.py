"""transformers' answers for the tiny BERT-family checkpoints (trillm/testing/tiny_bert.py):
sentence-transformers' pooling computed with torch on ``AutoModel``'s hidden states, and a
cross-encoder's score of a pair tokenized as the tokenizer joins one (segment ids included)."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_embeddings(path: Path, texts: list[str], mode: str, normalize: bool) -> torch.Tensor:
    """[N, H]: ``mode`` mean (over the attention mask, special tokens included), cls or last."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state  # [N, S, H]
    mask = enc["attention_mask"]
    if mode == "mean":
        vecs = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    elif mode == "cls":
        vecs = hidden[:, 0]
    else:
        vecs = hidden[torch.arange(len(texts)), mask.sum(1) - 1]
    return torch.nn.functional.normalize(vecs, dim=-1) if normalize else vecs


def hf_pair_logits(path: Path, firsts: list[str], seconds: list[str]) -> torch.Tensor:
    """[N]: the one-label cross-encoder's logit for each (first, second) pair."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    enc = tok(firsts, seconds, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).logits[:, 0]


def hf_pair_logits_one_segment(path: Path, first: str, second: str) -> float:
    """The same pair with every segment id 0: what the score would be if they were lost."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    enc = tok(first, second, return_tensors="pt")
    enc["token_type_ids"] = torch.zeros_like(enc["input_ids"])
    with torch.no_grad():
        return float(model(**enc).logits[0, 0])
