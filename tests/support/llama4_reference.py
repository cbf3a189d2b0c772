"""transformers' Llama 4 (``Llama4ForConditionalGeneration``) as the reference for the image
tests: the prompt expanded by ``Llama4Processor._prompt_split_image`` (the processor class needs
torchvision's image processor to be built, so its expansion is called unbound), the model's
greedy continuation (EOS ignored) and its log-probabilities over the whole sequence.

The pixel values are trillm's processing (``engine/llama4_inputs.py``), which equals
transformers' ``Llama4ImageProcessor`` where torchvision loads (``PROCESSOR_DIGESTS``, recorded
from it)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

IMAGE = "<|image|>"
# (tile, max_patches, (width, height)) -> the (rows, columns) of tiles and the first 16 hex
# digits of the sha256 of the float32 bytes of transformers' pixel_values (bfloat16 values),
# for llava_reference.image(3, (width, height)); recorded with torchvision 0.28 beside torch 2.13.
PROCESSOR_DIGESTS = {
    (32, 4, (50, 40)): ((2, 2), "26f10ba499ba885c"),
    (32, 16, (40, 90)): ((3, 2), "4ac548a4e18f0d73"),
    (32, 16, (500, 300)): ((3, 5), "3cbd8849bf84caeb"),
    (32, 4, (33, 31)): ((1, 2), "fd0d9569e3906039"),
    (336, 16, (1000, 700)): ((3, 3), "029ed313ca4806e5"),
}


@cache
def hf_parts(path: str) -> tuple[Any, Any, Any, int]:
    """(model, tokenizer, trillm's image processing, patch tokens per tile)."""
    import torch
    from transformers import AutoTokenizer, Llama4ForConditionalGeneration

    from trillm.engine.llama4_inputs import load_processor
    from trillm.model_executor.llama4_vision_config import patches_per_tile

    model = Llama4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # references run to max_new_tokens
    hf = json.loads((Path(path) / "config.json").read_text())
    return (
        model,
        AutoTokenizer.from_pretrained(path),
        load_processor(path, hf),
        patches_per_tile(hf),
    )


def hf_inputs(path: str, text: str, images: list[Any]) -> dict[str, Any]:
    """``input_ids`` with each ``<|image|>`` expanded as transformers' processor expands it, and
    the images' ``pixel_values`` [tiles, 3, S, S] float32."""
    import numpy as np
    import torch
    from transformers.models.llama4 import Llama4Processor

    _, tok, processing, per_tile = hf_parts(path)
    enc: dict[str, Any] = {}
    if images:
        done = [processing(img.convert("RGB")) for img in images]
        values = np.concatenate([d["pixel_values"] for d in done])
        enc["pixel_values"] = torch.from_numpy(values)
        pieces = text.split(IMAGE)
        assert len(pieces) == len(images) + 1
        expand = Llama4Processor._prompt_split_image  # its self is unused
        spans = [expand(None, d["aspect_ratio"], per_tile) for d in done]
        text = pieces[0] + "".join(s + p for s, p in zip(spans, pieces[1:], strict=True))
    enc["input_ids"] = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    return enc


def hf_greedy(
    path: str, text: str, images: list[Any], n: int = 8
) -> tuple[list[int], list[int], Any]:
    """(the expanded prompt ids, the greedy continuation of ``n`` tokens, the log-softmax of
    every row of prompt + continuation [P + n, V], row i scoring token i + 1)."""
    import torch

    model = hf_parts(path)[0]
    enc = hf_inputs(path, text, images)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=0)
        ids = enc["input_ids"][0].tolist()
        tokens = out[0, len(ids) :].tolist()
        assert len(tokens) == n, "the reference must not stop at EOS"
        logits = model(**{**enc, "input_ids": out}).logits[0]
    return ids, tokens, torch.log_softmax(logits.float(), -1)
