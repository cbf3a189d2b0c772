"""transformers' LLaVA-OneVision as the reference for the image tests: the processor's expanded
prompt (``LlavaOnevisionProcessor.replace_image_token``'s count on the image processor's
outputs: the processor class itself cannot be built without torchvision's video processor),
the model's greedy continuation (EOS ignored) and its log-probabilities over the whole
sequence; for videos, the folder's own ``LlavaOnevisionVideoProcessor`` (imported with a
torchvision stand-in) and ``replace_video_token``'s count."""

from __future__ import annotations

from functools import cache
from typing import Any

IMAGE = "<image>"
VIDEO = "<video>"


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
    counter.video_token = VIDEO
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


@cache
def _video_processor(path: str) -> Any:
    """The folder's ``LlavaOnevisionVideoProcessor`` (transformers' own loading), imported with
    the torchvision stand-in; run with ``do_resize=False`` on frames at the tile's size."""
    import importlib

    import transformers.processing_utils  # noqa: F401 (imported before the stand-in)
    import transformers.video_processing_utils  # noqa: F401
    from qwen2_vl_video_reference import _torchvision_stand_in

    name = "transformers.models.llava_onevision.video_processing_llava_onevision"
    with _torchvision_stand_in():
        module = importlib.import_module(name)
        return module.LlavaOnevisionVideoProcessor.from_pretrained(path)


def hf_video_values(path: str, frames: Any, **kwargs: Any) -> Any:
    """transformers' ``pixel_values_videos`` [1, T, 3, S, S] of ``frames`` [T, S, S, 3]."""
    from qwen2_vl_video_reference import _torchvision_stand_in

    processor = _video_processor(path)
    with _torchvision_stand_in():
        out = processor(
            videos=[frames], return_tensors="pt", do_resize=False, do_convert_rgb=False, **kwargs
        )
    return out["pixel_values_videos"]


def hf_video_greedy(
    path: str, text: str, images: list[Any], video: Any | None, n: int = 8, **kwargs: Any
) -> tuple[list[int], list[int], Any]:
    """``hf_greedy`` of a prompt with images and at most one video (frames [T, S, S, 3]), its
    ``<video>`` expanded by ``LlavaOnevisionProcessor.replace_video_token``'s count."""
    import torch

    model, _, _, counter = hf_parts(path)
    enc: dict[str, Any] = {}
    if video is not None:
        values = hf_video_values(path, video, **kwargs)
        count = len(counter.replace_video_token({"pixel_values_videos": values}, 0)) // len(VIDEO)
        assert text.count(VIDEO) == 1
        text = text.replace(VIDEO, VIDEO * count)
        enc["pixel_values_videos"] = values
    enc.update(hf_inputs(path, text, images, **kwargs))
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=0)
        ids = enc["input_ids"][0].tolist()
        tokens = out[0, len(ids) :].tolist()
        assert len(tokens) == n, "the reference must not stop at EOS"
        logits = model(**{**enc, "input_ids": out}).logits[0]
    return ids, tokens, torch.log_softmax(logits.float(), -1)
