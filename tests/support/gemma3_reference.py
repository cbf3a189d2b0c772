"""transformers' Gemma 3 with images as the reference for the image tests: ``Gemma3Processor``'s
expanded prompt and ``token_type_ids`` (the bidirectional image mask), the model's greedy
continuation (EOS ignored) and its log-probabilities over the whole sequence."""

from __future__ import annotations

from functools import cache
from typing import Any

from trillm.testing.tiny_gemma3 import TOKENS_PER_IMAGE

IMAGE = "<start_of_image>"


@cache
def hf_parts(path: str) -> tuple[Any, Any]:
    from transformers import AutoTokenizer, Gemma3ForConditionalGeneration
    from transformers.models.gemma3 import Gemma3ImageProcessorPil, Gemma3Processor

    model = Gemma3ForConditionalGeneration.from_pretrained(path)
    model.eval()
    model.generation_config.eos_token_id = None  # references run to max_new_tokens
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil.from_pretrained(path),
        tokenizer=AutoTokenizer.from_pretrained(path),
        image_seq_length=TOKENS_PER_IMAGE,
    )
    return model, processor


def hf_inputs(path: str, text: str, images: list[Any]) -> dict[str, Any]:
    _, processor = hf_parts(path)
    if not images:
        return dict(processor.tokenizer([text], return_tensors="pt", add_special_tokens=False))
    enc = processor(text=[text], images=[images], return_tensors="pt", add_special_tokens=False)
    return dict(enc)


def hf_greedy(
    path: str, text: str, images: list[Any], n: int = 8
) -> tuple[list[int], list[int], Any]:
    """(the expanded prompt ids, the greedy continuation of ``n`` tokens, the log-softmax of
    every row of prompt + continuation [P + n, V], row i scoring token i + 1)."""
    import torch

    model, _ = hf_parts(path)
    enc = hf_inputs(path, text, images)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=0)
        ids = enc["input_ids"][0].tolist()
        tokens = out[0, len(ids) :].tolist()
        assert len(tokens) == n, "the reference must not stop at EOS"
        whole = {k: v for k, v in enc.items() if k in ("pixel_values", "token_type_ids")}
        if "token_type_ids" in whole:
            types = whole["token_type_ids"]
            whole["token_type_ids"] = torch.cat([types, torch.zeros(1, n, dtype=types.dtype)], 1)
        logprobs = torch.log_softmax(model(input_ids=out, **whole).logits[0].float(), -1)
    return ids, tokens, logprobs
