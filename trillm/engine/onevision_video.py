"""Stage 3 for LLaVA-OneVision videos: ``multi_modal_data["video"]`` (and a chat's
``video_url``) as transformers' ``LlavaOnevisionProcessor`` prepares them.

The video processor (``LlavaOnevisionVideoProcessor``) is read from the folder the way
transformers finds it (``processor_config.json``'s ``video_processor``, else
``video_preprocessor_config.json``, else the image processor's ``preprocessor_config.json``),
over the class's defaults. Each frame is resized to the processor's ``size`` (which must be the
tower's tile), rescaled and normalized: an item's data is the frames' pixel values
[T, 3, S, S]. Its placeholder (``<video>``) becomes ``T * ceil(s / 2) ** 2 + 1`` tokens, ``s``
the patches a tile side: each frame's features pooled 2x2 and one ``image_newline`` after the
last (``models/llava_onevision.py``'s ``encode_video``).

Computed without torchvision (whose build does not load beside the CPU torch): frames that
need resizing are resized by PIL's bicubic filter where transformers uses torchvision's; frames
already at the tile's size are not resized by either, and their values are equal.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from trillm.engine.media import MultiModalInputError
from trillm.model_executor.onevision_config import ONEVISION_ARCHITECTURE, onevision_field

if TYPE_CHECKING:
    from trillm.tokenizer_protocol import Tokenizer

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # transformers' OPENAI_CLIP_MEAN
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)  # OPENAI_CLIP_STD
_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, the class's resample
# The request's mm_processor_kwargs a video's pixel values follow (the image processor's
# geometry keys are refused before: onevision_inputs.check_kwargs)
_VALUE_KWARGS = ("do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std")
_INERT_KWARGS = ("do_convert_rgb",)  # frames are RGB already


@attrs.frozen
class VideoProcessing:
    """What the folder's video processor does to a frame."""

    size: tuple[int, int]  # (height, width): the tower's tile
    resample: int = _BICUBIC
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = _CLIP_MEAN
    image_std: tuple[float, ...] = _CLIP_STD


def video_processor_data(folder: Path) -> dict[str, Any]:
    """The video processor's saved fields, found as transformers finds them ({}: none)."""
    nested = folder / "processor_config.json"
    if nested.is_file():
        data = json.loads(nested.read_text(encoding="utf-8"))
        if "video_processor" in data:
            return dict(data["video_processor"])
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        path = folder / name
        if path.is_file():
            return dict(json.loads(path.read_text(encoding="utf-8")))
    return {}


def load_processing(folder: str, mm_config: dict[str, Any]) -> VideoProcessing:
    """The folder's video processing; what the model could not take is refused by name."""
    data = video_processor_data(Path(folder))
    tile = int(mm_config["vision_config"].get("image_size", 384))
    size = data.get("size") or {"height": 384, "width": 384}
    if not isinstance(size, dict) or (size.get("height"), size.get("width")) != (tile, tile):
        raise ValueError(
            f"{ONEVISION_ARCHITECTURE}: the video processor's size {size} is not the vision "
            f"tower's {tile}x{tile}; its features would not fill the video's placeholders."
        )
    for key in ("do_center_crop", "do_sample_frames"):
        if data.get(key):
            raise ValueError(
                f"{ONEVISION_ARCHITECTURE}: the video processor's {key}=true is not implemented."
            )
    if data.get("do_resize") is False:
        raise ValueError(
            f"{ONEVISION_ARCHITECTURE}: the video processor's do_resize=false is not "
            "implemented (frames of any size would not fit the tower)."
        )
    fields = {k: data[k] for k in ("resample", *_VALUE_KWARGS) if data.get(k) is not None}
    return with_values(VideoProcessing((tile, tile)), fields)


def with_values(processing: VideoProcessing, fields: dict[str, Any]) -> VideoProcessing:
    """``processing`` with the given value fields (means and deviations as 3-tuples)."""
    for key in ("image_mean", "image_std"):
        if key in fields:
            value = fields[key]
            fields = {**fields, key: tuple(value) if isinstance(value, list) else (value,) * 3}
    return attrs.evolve(processing, **fields)


def request_processing(
    processing: VideoProcessing, kwargs: dict[str, Any], param: str = "mm_processor_kwargs"
) -> VideoProcessing:
    """The request's ``mm_processor_kwargs`` applied to a video (the keys the video processor
    shares with the image processor); any other key is refused for a video."""
    other = sorted(k for k in kwargs if k not in _VALUE_KWARGS + _INERT_KWARGS)
    if other:
        raise MultiModalInputError(
            f"{param}: {', '.join(map(repr, other))} not applied to videos by this model; a "
            f"video takes {', '.join(_VALUE_KWARGS + _INERT_KWARGS)}.",
            param,
        )
    return with_values(processing, {k: v for k, v in kwargs.items() if k in _VALUE_KWARGS})


def frame_values(processing: VideoProcessing, frames: np.ndarray) -> np.ndarray:
    """[T, H, W, 3] uint8 frames -> their pixel values [T, 3, h, w] float32."""
    from PIL import Image

    height, width = processing.size
    if frames.shape[1:3] != (height, width):
        resample = Image.Resampling(processing.resample)
        frames = np.stack(
            [np.asarray(Image.fromarray(f).resize((width, height), resample)) for f in frames]
        )
    values = frames.astype(np.float32).transpose(0, 3, 1, 2)
    if processing.do_rescale:
        values = values * np.float32(processing.rescale_factor)
    if processing.do_normalize:
        mean = np.asarray(processing.image_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(processing.image_std, dtype=np.float32)[:, None, None]
        values = (values - mean) / std
    return np.ascontiguousarray(values, dtype=np.float32)


def clip_values(
    processing: VideoProcessing, clips: list[tuple[Any, float]], kwargs: dict[str, Any]
) -> list[tuple[np.ndarray, float]]:
    """Each (frames, fps) clip's pixel values (a tokenization thread's); the time step is
    unused (no M-RoPE)."""
    from trillm.engine.video_inputs import rgb_frames

    chosen = request_processing(processing, kwargs)
    return [(frame_values(chosen, rgb_frames(frames)), 1.0) for frames, _ in clips]


def video_tokens(mm_config: dict[str, Any], values: np.ndarray) -> int:
    """Placeholder tokens of a video's pixel values [T, 3, S, S]: each frame's pooled
    features, then one newline (transformers' ``replace_video_token``)."""
    vc = mm_config["vision_config"]
    side = int(vc.get("image_size", 384)) // int(vc.get("patch_size", 14))
    return int(values.shape[0]) * math.ceil(side / 2) ** 2 + 1


def video_token(mm_config: dict[str, Any], tokenizer: Tokenizer) -> tuple[int, str]:
    """The video placeholder's id and text (``<video>``)."""
    token_id = int(onevision_field(mm_config, "video_token_index"))
    return token_id, str(tokenizer.convert_ids_to_tokens(token_id))
