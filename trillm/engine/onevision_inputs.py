"""Stage 3 for LLaVA-OneVision: its image processor on the PIL path (the base tile and the
best grid pinpoint's tiles, [tiles, 3, S, S]), an item's data as those tiles followed by the
image's (height, width) (``models/llava_onevision.py`` reads both), and its placeholder count
as transformers' ``LlavaOnevisionProcessor`` counts it: each image tiled (vLLM's and the
processor's rule for a flat list of images, one prompt holding several included)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from trillm.engine.media import MultiModalInputError
from trillm.model_executor.onevision_config import (
    ONEVISION_ARCHITECTURE,
    grid_pinpoints,
    max_tiles,
    onevision_field,
)

# The processor's keys that fix the tiling (the model's config holds the same geometry)
_GEOMETRY_KWARGS = (
    "image_grid_pinpoints", "size", "crop_size", "do_resize", "do_center_crop", "do_pad",
    "pad_size",
)  # fmt: skip
_NOT_KWARGS = ("image_processor_type", "processor_class", "_processor_class")


def load_processor(folder: str, mm_config: dict[str, Any]) -> Any:
    """The folder's image processor (``preprocessor_config.json``, or the one nested in
    ``processor_config.json``), its tiling checked against the model's."""
    from transformers.models.llava_onevision import LlavaOnevisionImageProcessorPil

    check_processor_fields(Path(folder), mm_config)
    data = _processor_data(Path(folder))
    kwargs = {k: v for k, v in data.items() if k not in _NOT_KWARGS}
    processor = LlavaOnevisionImageProcessorPil(**kwargs)
    pinpoints = [list(p) for p in processor.image_grid_pinpoints]
    if pinpoints != grid_pinpoints(mm_config):
        raise ValueError(
            f"{ONEVISION_ARCHITECTURE}: the image processor's image_grid_pinpoints differ from "
            "config.json's; the features would not fill the placeholders."
        )
    tile = int(mm_config["vision_config"].get("image_size", 384))
    size = processor.size
    if (size.get("height"), size.get("width")) != (tile, tile):
        raise ValueError(
            f"{ONEVISION_ARCHITECTURE}: the image processor's size {dict(size)} is not the "
            f"vision tower's {tile}x{tile}."
        )
    return processor


def check_processor_fields(folder: Path, mm_config: dict[str, Any]) -> None:
    """``processor_config.json``'s own fields agree with config.json (transformers' processor
    counts placeholders by them, its model packs features by config.json's)."""
    path = folder / "processor_config.json"
    fields = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    vc = mm_config["vision_config"]
    side = int(vc.get("image_size", 384)) // int(vc.get("patch_size", 14))
    expected = {
        "num_image_tokens": side * side,
        "vision_feature_select_strategy": onevision_field(
            mm_config, "vision_feature_select_strategy"
        ),
        "vision_aspect_ratio": onevision_field(mm_config, "vision_aspect_ratio"),
    }
    for key, value in expected.items():
        if fields.get(key, value) != value:
            raise ValueError(
                f"{ONEVISION_ARCHITECTURE}: processor_config.json's {key} {fields[key]!r} is not "
                f"the model's {value!r} (config.json); the placeholders would not match the "
                "features."
            )


def _processor_data(folder: Path) -> dict[str, Any]:
    nested = folder / "processor_config.json"
    if nested.is_file():
        data = json.loads(nested.read_text(encoding="utf-8"))
        if "image_processor" in data:
            return dict(data["image_processor"])
    path = folder / "preprocessor_config.json"
    if not path.is_file():
        raise ValueError(f"The model folder {str(folder)!r} has no image processor config.")
    return dict(json.loads(path.read_text(encoding="utf-8")))


def check_kwargs(kwargs: dict[str, Any], param: str) -> None:
    fixed = sorted(k for k in kwargs if k in _GEOMETRY_KWARGS)
    if fixed:
        raise MultiModalInputError(
            f"{param}: {', '.join(map(repr, fixed))} is the model's tiling (config.json "
            "holds the same geometry); it cannot be set.",
            param,
        )


def item_values(processed: Any) -> np.ndarray:  # [tiles * 3 * S * S + 2] float32
    """One image's tiles, flattened, then its (height, width)."""
    tiles = np.asarray(processed["pixel_values"][0], dtype=np.float32)
    size = np.asarray(processed["image_sizes"][0], dtype=np.float32)
    return np.concatenate([tiles.reshape(-1), size])


def image_tokens(mm_config: dict[str, Any], values: np.ndarray) -> int:
    """Placeholder tokens of an item (``item_values``): the base tile's patches, then the
    unpadded (and shrunk) grid's rows, each ended by a newline."""
    from transformers.image_processing_utils import select_best_resolution

    height, width = int(values[-2]), int(values[-1])
    vc = mm_config["vision_config"]
    tile = int(vc.get("image_size", 384))
    side = tile // int(vc.get("patch_size", 14))
    best = select_best_resolution((height, width), grid_pinpoints(mm_config))
    rows, cols = side * (int(best[0]) // tile), side * (int(best[1]) // tile)
    if width / height > cols / rows:
        rows -= 2 * ((rows - int(round(height * (cols / width), 7))) // 2)
    else:
        cols -= 2 * ((cols - int(round(width * (rows / height), 7))) // 2)
    ratio = math.sqrt(rows * cols / (max_tiles(mm_config) * side**2))
    if ratio > 1.1:
        rows, cols = int(rows // ratio), int(cols // ratio)
    return side * side + rows * cols + rows
