"""transformers as the reference for Qwen2-VL / Qwen2.5-VL videos: its own
``Qwen2VLVideoProcessor`` (pixel_values_videos, video_grid_thw) and the model's greedy
continuation and log-probabilities for a prompt mixing images and videos.

The video processor's module imports torchvision (not installable beside the CPU torch build)
for its resize and normalize; it is imported here with an empty stand-in module, and run with
``do_resize=False`` on frames already on the patch grid, its normalize being torchvision's
definition ((x - mean) / std per channel). Everything else (frame grouping, padding,
patch layout, grids) is transformers' own code."""

from __future__ import annotations

import importlib
import sys
import types
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch
from qwen2_vl_reference import IMAGE_PAD, hf_parts

VIDEO_PAD = "<|video_pad|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
BARE_FPS = 24  # transformers' sampled fps of frames given without metadata
_TV = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2")
_TVF = "torchvision.transforms.v2.functional"


def _normalize(image: torch.Tensor, mean: Any, std: Any, inplace: bool = False) -> torch.Tensor:
    """torchvision's ``normalize``: per channel, the channel axis third from last."""
    mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
    return (image - mean) / std


@contextmanager
def _torchvision_stand_in():
    import transformers.image_processing_backends as backends

    functional = types.ModuleType(_TVF)
    functional.normalize = _normalize  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in (*_TV, _TVF)}
    sys.modules.update({name: types.ModuleType(name) for name in _TV})
    sys.modules[_TVF] = functional
    had = hasattr(backends, "tvF")
    backends.tvF = functional  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        if not had:
            del backends.tvF


@cache
def _video_processor_class() -> Any:
    import transformers.processing_utils  # noqa: F401 (imported before the stand-in)
    import transformers.video_processing_utils  # noqa: F401

    with _torchvision_stand_in():  # the module itself (the package's lazy attribute is a dummy)
        module = importlib.import_module("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    return module.Qwen2VLVideoProcessor


def hf_video_values(path: str, frames: Any) -> dict[str, Any]:
    """transformers' ``pixel_values_videos`` [N, patch_dim] and ``video_grid_thw`` [1, 3]."""
    image_processor = hf_parts(path)[2]
    processor = _video_processor_class()(
        patch_size=image_processor.patch_size,
        merge_size=image_processor.merge_size,
        temporal_patch_size=image_processor.temporal_patch_size,
        size=dict(image_processor.size),
        do_resize=False,
        do_convert_rgb=False,
        cap_pixels_per_frame=False,
    )
    with _torchvision_stand_in():
        return dict(processor(videos=[frames], return_tensors="pt"))


def hf_mixed_inputs(
    path: str, text: str, images: list[Any], videos: list[Any], fps: float = BARE_FPS
) -> dict[str, Any]:
    """The processor's outputs for a prompt with images and videos (sampled at ``fps``), each
    pad expanded."""
    _, tok, image_processor = hf_parts(path)
    enc: dict[str, Any] = {}
    merge = image_processor.merge_size**2
    if images:
        enc.update(image_processor(images=images, return_tensors="pt"))
    if videos:
        parts = [hf_video_values(path, v) for v in videos]
        enc["pixel_values_videos"] = torch.cat([p["pixel_values_videos"] for p in parts])
        enc["video_grid_thw"] = torch.cat([p["video_grid_thw"] for p in parts])
        tp = image_processor.temporal_patch_size
        enc["second_per_grid_ts"] = torch.tensor([tp / fps] * len(videos))
    for pad, key in ((IMAGE_PAD, "image_grid_thw"), (VIDEO_PAD, "video_grid_thw")):
        if key in enc:
            counts = (enc[key].prod(-1) // merge).tolist()
            pieces = text.split(pad)
            assert len(pieces) == len(counts) + 1
            text = pieces[0] + "".join(pad * n + p for n, p in zip(counts, pieces[1:]))
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    types_ = (ids == tok.convert_tokens_to_ids(IMAGE_PAD)).int()
    types_ += 2 * (ids == tok.convert_tokens_to_ids(VIDEO_PAD)).int()
    return {**enc, "input_ids": ids, "mm_token_type_ids": types_}


def hf_mixed_greedy(
    path: str, text: str, images: list[Any], videos: list[Any], n: int = 8, fps: float = BARE_FPS
) -> tuple[list[int], list[int], Any]:
    """(the expanded prompt ids, the greedy continuation, log-softmax rows [P + n, V])."""
    model = hf_parts(path)[0]
    enc = hf_mixed_inputs(path, text, images, videos, fps)
    if "second_per_grid_ts" in enc and "Qwen2VL" in type(model).__name__:
        del enc["second_per_grid_ts"]  # Qwen2-VL's time step is 1
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=0)
        ids = enc["input_ids"][0].tolist()
        tokens = out[0, len(ids) :].tolist()
        types_ = enc["mm_token_type_ids"]
        whole = {**enc, "input_ids": out}
        whole["mm_token_type_ids"] = torch.cat([types_, torch.zeros(1, n, dtype=types_.dtype)], 1)
        logprobs = torch.log_softmax(model(**whole).logits[0].float(), -1)
    return ids, tokens, logprobs
