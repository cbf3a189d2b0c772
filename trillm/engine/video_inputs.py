"""Stage 3 for videos (Qwen2-VL / Qwen2.5-VL): ``multi_modal_data["video"]``.

A video is a numpy array [T, H, W, 3] of uint8 RGB frames or a list of PIL frames (vLLM's
shapes), or from a chat a ``VideoSource`` decoded by ``video_decode.py``. Its size is checked
before any frame is processed (frames, pixels per frame, pixels in all). Its pixel values are
transformers' ``Qwen2VLVideoProcessor``'s, computed without torchvision (whose build does not
load beside the CPU torch): each frame goes through the folder's Qwen2-VL image processor
(PIL path: resized to whole merged patches within the pixel budget, rescaled, normalized,
patched), then ``temporal_patch_size`` consecutive frames become one temporal patch (the last
frame repeated to fill the last group), kept as [t, h, w, patch_dim] like an image's (t > 1).
The one difference: frames that need resizing are resized by PIL's bicubic filter, where
transformers uses torchvision's; frames already on the patch grid are equal.

M-RoPE: a video's temporal patch k sits at time ``floor(k * interval)``: 1 for Qwen2-VL;
``tokens_per_second * temporal_patch_size / fps`` for Qwen2.5-VL, the fps the frames were
sampled at (transformers' ``VideoMetadata.sampled_fps``: 24 when the frames come bare).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trillm.engine.media import MultiModalInputError

MAX_VIDEO_FRAMES = 768  # transformers' Qwen2VLVideoProcessor.max_frames
MAX_VIDEO_PIXELS = 1 << 27  # all frames' pixels together (~400 MB as RGB bytes)
BARE_FRAMES_FPS = 24.0  # transformers' sampled_fps for frames given without their rate


def as_list(value: Any) -> list[Any]:
    """``multi_modal_data["video"]``: one video or a list of videos (a list of PIL frames is
    one video, as in vLLM)."""
    if value is None:
        return []
    if isinstance(value, np.ndarray) or _is_frame_list(value):
        return [value]
    return list(value) if isinstance(value, list | tuple) else [value]


def _is_frame_list(value: Any) -> bool:
    from PIL import Image

    return isinstance(value, list | tuple) and bool(value) and isinstance(value[0], Image.Image)


def check_video(video: Any, param: str, max_frame_pixels: int) -> tuple[int, int, int]:
    """(frames, height, width) of a video, its sizes within the limits; nothing decoded (PIL
    frames: their headers)."""
    from PIL import Image

    if isinstance(video, np.ndarray):
        if video.ndim != 4 or video.shape[-1] != 3 or video.dtype != np.uint8:
            raise MultiModalInputError(
                f"{param} must be a uint8 numpy array [frames, height, width, 3] (RGB), got "
                f"{video.dtype} {list(video.shape)}."
            )
        frames, height, width = video.shape[:3]
    elif _is_frame_list(video) and all(isinstance(f, Image.Image) for f in video):
        sizes = {f.size for f in video}
        if len(sizes) != 1:
            raise MultiModalInputError(f"{param}: its frames have different sizes {sorted(sizes)}.")
        (width, height), frames = sizes.pop(), len(video)
    else:
        raise MultiModalInputError(
            f"{param} is not a video (a numpy array [frames, height, width, 3] or a list of "
            f"PIL images), got {type(video).__name__}."
        )
    check_sizes(frames, height, width, param, max_frame_pixels)
    return frames, height, width


def check_sizes(frames: int, height: int, width: int, param: str, max_frame_pixels: int) -> None:
    """The frame count, each frame's pixels and all frames' pixels within the limits."""
    if not 1 <= frames <= MAX_VIDEO_FRAMES:
        raise MultiModalInputError(
            f"{param} has {frames} frames; a video has 1 to {MAX_VIDEO_FRAMES} frames."
        )
    if height * width > max_frame_pixels or min(height, width) < 1:
        raise MultiModalInputError(
            f"{param} has {width}x{height} pixel frames, more than the limit of "
            f"{max_frame_pixels} pixels a frame."
        )
    if frames * height * width > MAX_VIDEO_PIXELS:
        raise MultiModalInputError(
            f"{param} has {frames} frames of {width}x{height} pixels, more than the limit of "
            f"{MAX_VIDEO_PIXELS} pixels in all."
        )


def rgb_frames(video: Any) -> np.ndarray:  # [T, H, W, 3] uint8
    """The frames as one array (PIL frames decoded here, in the tokenization thread)."""
    if isinstance(video, np.ndarray):
        return video
    return np.stack([np.asarray(frame.convert("RGB")) for frame in video])


def video_patches(processor: Any, frames: np.ndarray, kwargs: dict[str, Any]) -> np.ndarray:
    """[T, H, W, 3] frames -> their patches [t, h, w, C * tp * p * p] float32: each frame
    through the image processor, ``tp`` frames a temporal patch (transformers'
    ``Qwen2VLVideoProcessor.patchify`` layout: channel, then time, then the patch's pixels)."""
    from PIL import Image

    tp, p = int(processor.temporal_patch_size), int(processor.patch_size)
    per_frame = []
    grid: tuple[int, int] = (0, 0)
    for frame in frames:
        processed = processor(images=Image.fromarray(frame), return_tensors="np", **kwargs)
        _, h, w = (int(x) for x in processed["image_grid_thw"][0])
        grid = (h, w)
        # the image processor repeats a frame tp times in each patch: keep one copy
        per_frame.append(processed["pixel_values"].reshape(h * w, 3, tp, p, p)[:, :, 0])
    pad = -len(per_frame) % tp  # the last frame repeated to fill its temporal patch
    stacked = np.stack(per_frame + per_frame[-1:] * pad)  # [T', N, C, p, p]
    t = stacked.shape[0] // tp
    grouped = stacked.reshape(t, tp, *stacked.shape[1:]).transpose(0, 2, 3, 1, 4, 5)
    return np.ascontiguousarray(grouped.reshape(t, *grid, -1), dtype=np.float32)


def clip_values(
    processor: Any, mm_config: dict[str, Any], clips: list[Any], kwargs: dict[str, Any]
) -> list[tuple[np.ndarray, float]]:
    """Each (frames, fps) clip's patches and M-RoPE time interval (a tokenization thread's)."""
    tp = int(processor.temporal_patch_size)
    return [
        (video_patches(processor, rgb_frames(frames), kwargs), time_interval(mm_config, tp, fps))
        for frames, fps in clips
    ]


def time_interval(mm_config: dict[str, Any], temporal_patch_size: int, fps: float) -> float:
    """A temporal patch's M-RoPE time step: Qwen2.5-VL's ``tokens_per_second`` times the
    seconds a temporal patch spans; Qwen2-VL's 1."""
    vision = mm_config.get("vision_config") or {}
    if "tokens_per_second" not in vision and mm_config.get("model_type") != "qwen2_5_vl":
        return 1.0
    # NOTE: transformers keeps the seconds per temporal patch as float32 (second_per_grid_ts)
    return float(vision.get("tokens_per_second", 4)) * float(np.float32(temporal_patch_size / fps))
