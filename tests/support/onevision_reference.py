"""transformers' LLaVA-OneVision as the reference for the image tests: the processor's expanded
prompt (``LlavaOnevisionProcessor.replace_image_token``'s count on the image processor's
outputs: the processor class itself cannot be built without torchvision's video processor),
the model's greedy continuation (EOS ignored) and its log-probabilities over the whole
sequence."""

from __future__ import annotations

from functools import cache
from typing import Any

IMAGE = "<image>"


@cache
def hf_parts(path: str) -> tuple[Any, Any, Any, Any]:
    """(model, tokenizer, image processor, a bare processor holding the counting fields)."""
    import json
    from pathlib import Path

    from transformers import AutoTokenizer, LlavaOnevisionForConditionalGeneration
    from transformers.models.llava_onevision import (
        LlavaOnevisionImageProcessorPil,
        LlavaOnevisionProcessor,
    )

    model = LlavaOnevisionForConditionalGeneration.from_pretrained(path).eval()
    model.generation_config.eos_token_id = None  # references run to max_new_tokens
    images = LlavaOnevisionImageProcessorPil.from_pretrained(path)
    fields = json.loads((Path(path) / "processor_config.json").read_text())
    counter = object.__new__(LlavaOnevisionProcessor)  # its __init__ needs the video processor
    counter.image_processor = images
    counter.num_image_tokens = fields["num_image_tokens"]
    counter.vision_feature_select_strategy = fields["vision_feature_select_strategy"]
    counter.vision_aspect_ratio = fields["vision_aspect_ratio"]
    counter.image_token = IMAGE
    return model, AutoTokenizer.from_pretrained(path), images, counter


def hf_inputs(path: str, text: str, images: list[Any], **kwargs: Any) -> dict[str, Any]:
    """The processor's outputs: each ``<image>`` expanded to its image's feature count."""
    import torch

    _, tok, processor, counter = hf_parts(path)
    enc: dict[str, Any] = {}
    if images:
        enc = dict(processor(images=images, return_tensors="pt", **kwargs))
        pieces = text.split(IMAGE)
        assert len(pieces) == len(images) + 1
        counts = [
            len(counter.replace_image_token(enc, i)) // len(IMAGE) for i in range(len(images))
        ]
        text = pieces[0] + "".join(IMAGE * n + p for n, p in zip(counts, pieces[1:]))
    enc["input_ids"] = torch.tensor([tok(text)["input_ids"]])
    return enc


def hf_greedy(
    path: str, text: str, images: list[Any], n: int = 8, **kwargs: Any
) -> tuple[list[int], list[int], Any]:
    """(the expanded prompt ids, the greedy continuation of ``n`` tokens, the log-softmax of
    every row of prompt + continuation [P + n, V], row i scoring token i + 1)."""
    import torch

    model = hf_parts(path)[0]
    enc = hf_inputs(path, text, images, **kwargs)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=0)
        ids = enc["input_ids"][0].tolist()
        tokens = out[0, len(ids) :].tolist()
        assert len(tokens) == n, "the reference must not stop at EOS"
        logits = model(**{**enc, "input_ids": out}).logits[0]
    return ids, tokens, torch.log_softmax(logits.float(), -1)
