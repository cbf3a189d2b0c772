"""Stage 3 for Qwen2-VL / Qwen2.5-VL: the Qwen2-VL image processor on its PIL path (dynamic
resolution: each image resized within ``min_pixels`` .. ``max_pixels`` to whole merged
patches), its patches kept as [t, h, w, patch_dim] (the grid transformers calls
``image_grid_thw``, carried by the item's shape), and a chat image part's placeholder
``<|vision_start|><|image_pad|><|vision_end|>``, as the model's chat template writes it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from trillm.engine import video_sampling
from trillm.engine.media import MultiModalInputError

if TYPE_CHECKING:
    from trillm.tokenizer_protocol import Tokenizer

# The processor's keys that are the vision tower's geometry (fixed by its weights)
_TOWER_KWARGS = ("patch_size", "temporal_patch_size", "merge_size")
_PIXEL_BUDGET_KWARGS = ("min_pixels", "max_pixels")


def is_qwen2_vl_processor(data: dict[str, Any]) -> bool:
    return str(data.get("image_processor_type", "")).startswith("Qwen2VLImageProcessor")


def load_processor(kwargs: dict[str, Any]) -> Any:
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**kwargs)


def image_placeholder(mm_config: dict[str, Any], tokenizer: Tokenizer, image_token_id: int) -> str:
    ids = [mm_config.get("vision_start_token_id"), image_token_id]
    ids.append(mm_config.get("vision_end_token_id"))
    return "".join(str(tokenizer.convert_ids_to_tokens(int(i))) for i in ids if i is not None)


def check_kwargs(kwargs: dict[str, Any], param: str, max_pixels: int) -> None:
    """The tower's geometry is not the caller's; pixel budgets are whole numbers within the
    image limit (they size what resizing allocates)."""
    fixed = sorted(k for k in kwargs if k in _TOWER_KWARGS)
    if fixed:
        raise MultiModalInputError(
            f"{param}: {', '.join(map(repr, fixed))} is the vision tower's own (its weights "
            "fix it); it cannot be set.",
            param,
        )
    video_sampling.check(kwargs, param)
    size = kwargs.get("size")
    values = [kwargs.get(k) for k in _PIXEL_BUDGET_KWARGS if k in kwargs]
    if size is not None:
        values += list(size.values()) if isinstance(size, dict) else [size]
    if not all(isinstance(v, int) and 0 < v <= max_pixels for v in values):
        raise MultiModalInputError(
            f"{param}: min_pixels, max_pixels and size's values are whole numbers in "
            f"[1, {max_pixels}], got {dict((k, kwargs[k]) for k in kwargs)!r}.",
            param,
        )


def processor_kwargs(processor: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``min_pixels`` / ``max_pixels`` (vLLM's keys) as the ``size`` they set: the processor
    deprecates them at call time; the frame keys left out (applied before: video_sampling)."""
    kwargs = video_sampling.without_frame_kwargs(kwargs)
    if not any(k in kwargs for k in _PIXEL_BUDGET_KWARGS):
        return kwargs
    out = dict(kwargs)
    size = dict(out.pop("size", None) or processor.size)
    if (low := out.pop("min_pixels", None)) is not None:
        size["shortest_edge"] = low
    if (high := out.pop("max_pixels", None)) is not None:
        size["longest_edge"] = high
    return {**out, "size": size}


def patches(processed: Any) -> np.ndarray:  # [t, h, w, patch_dim] float32
    """One image's processed patches with their grid as the shape."""
    t, h, w = (int(x) for x in processed["image_grid_thw"][0])
    return np.ascontiguousarray(processed["pixel_values"].reshape(t, h, w, -1), dtype=np.float32)
