"""Frame sampling asked by ``mm_processor_kwargs`` for Qwen2-VL / Qwen2.5-VL videos (vLLM
passes these keys to transformers' video processor): ``do_sample_frames=True`` with
``num_frames`` or ``fps``, sampled by ``Qwen2VLVideoProcessor.sample_frames``'s rule from the
frames the video arrived with (a chat's ``video_url``: the frames its loader decoded, at their
sampled rate; ``multi_modal_data`` frames: no rate, so ``fps`` is refused as transformers
refuses it). ``num_frames`` / ``fps`` without ``do_sample_frames=True`` are refused: the
processor would ignore them (its default leaves the frames as given); so is
``do_sample_frames=True`` alone (transformers' sampling fails without a count or a rate)."""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np

from trillm.engine.media import MultiModalInputError

FRAME_KWARGS = ("do_sample_frames", "num_frames", "fps")
MIN_FRAMES = 4  # transformers' Qwen2VLVideoProcessor.min_frames (fps sampling's floor)
MAX_FRAMES = 768  # its max_frames


@attrs.frozen
class FrameSampling:
    """What to sample: ``num_frames`` frames, or ``fps`` frames a second (neither: all)."""

    num_frames: int | None = None
    fps: float | None = None


def check(kwargs: dict[str, Any], param: str) -> None:
    """The frame keys' types and combination, before anything is read."""
    sample = kwargs.get("do_sample_frames")
    if "do_sample_frames" in kwargs and not isinstance(sample, bool):
        raise MultiModalInputError(f"{param}: do_sample_frames is a boolean, got {sample!r}.")
    count, fps = kwargs.get("num_frames"), kwargs.get("fps")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise MultiModalInputError(f"{param}: num_frames is a whole number >= 1, got {count!r}.")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, int | float) or fps <= 0):
        raise MultiModalInputError(f"{param}: fps is a number > 0, got {fps!r}.")
    if count is not None and fps is not None:
        raise MultiModalInputError(f"{param}: num_frames and fps exclude each other; give one.")
    if sample is True and count is None and fps is None:  # transformers fails on it
        raise MultiModalInputError(
            f"{param}: do_sample_frames=True needs num_frames or fps (how many frames to keep)."
        )
    if (count is not None or fps is not None) and sample is not True:
        raise MultiModalInputError(
            f"{param}: num_frames and fps sample a video's frames only with "
            "do_sample_frames=True (without it the video processor keeps every frame)."
        )


def from_kwargs(kwargs: dict[str, Any]) -> FrameSampling | None:
    """The sampling ``kwargs`` ask for (checked by ``check``); None: the frames as given."""
    if kwargs.get("do_sample_frames") is not True:
        return None
    fps = kwargs.get("fps")
    return FrameSampling(kwargs.get("num_frames"), None if fps is None else float(fps))


def without_frame_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keywords the image processor takes (the frame keys are applied before it)."""
    return {k: v for k, v in kwargs.items() if k not in FRAME_KWARGS}


def sample_indices(
    sampling: FrameSampling, total: int, fps: float | None, tp: int, param: str
) -> np.ndarray:  # [n] int64
    """transformers' ``Qwen2VLVideoProcessor.sample_frames`` indices of ``total`` frames that
    ran at ``fps`` (None: unknown), ``tp`` the temporal patch size."""
    count = sampling.num_frames
    if count is not None:
        count = round(count / tp) * tp
    elif sampling.fps is not None:
        if fps is None:
            raise MultiModalInputError(
                f"{param}: sampling by fps needs the video's frame rate, which frames given as "
                "an array do not carry; give num_frames instead.",
                param,
            )
        top = math.floor(min(MAX_FRAMES, total) / tp) * tp
        wanted = min(max(total / fps * sampling.fps, MIN_FRAMES), top, total)
        count = math.floor(wanted / tp) * tp
    if count is None:
        return np.arange(total)
    if not 1 <= count <= total:
        raise MultiModalInputError(
            f"{param}: the video has {total} frames; sampling asks for {count} (a multiple of "
            f"{tp}, the temporal patch size). Change num_frames or fps.",
            param,
        )
    import torch  # the reference's own arithmetic (a float32 step), for the same indices

    return torch.arange(0, total, total / count).int().numpy().astype(np.int64)


def sampled(
    sampling: FrameSampling | None, frames: Any, fps: float | None, tp: int, param: str
) -> tuple[Any, float | None]:
    """The sampled frames and the rate they then run at (transformers' ``sampled_fps``)."""
    if sampling is None:
        return frames, fps
    total = len(frames)
    indices = sample_indices(sampling, total, fps, tp, param)
    chosen = frames[indices] if isinstance(frames, np.ndarray) else [frames[i] for i in indices]
    return chosen, None if fps is None else len(indices) / total * fps
