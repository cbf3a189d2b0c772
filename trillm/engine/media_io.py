"""A request's ``media_io_kwargs`` (vLLM's field: options for the media connectors, keyed by
modality): which frames a ``video_url`` part's file is sampled to.

vLLM's video connector takes ``num_frames`` (default 32; -1: every frame) and ``fps`` (-1: the
file's own rate) and keeps ``min(num_frames, frames, floor(seconds * fps))`` frames (at least
one), spread evenly from the first to the last (its default "opencv" loader's
``compute_frames_index_to_sample``). Those two are honoured here; every other option (a
decoding backend, images' background colour, ...) is refused by name, as is a count over the
frames a video may have.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np

from trillm.engine.media import MultiModalInputError
from trillm.engine.video_inputs import MAX_VIDEO_FRAMES

PARAM = "media_io_kwargs"
NUM_FRAMES = 32  # vLLM's VideoMediaIO default
ALL = -1  # vLLM's "every frame" (num_frames) and "the file's rate" (fps)
_VIDEO_KEYS = ("num_frames", "fps")


@attrs.frozen
class VideoLoading:
    """Which frames of a video file are kept."""

    num_frames: int = NUM_FRAMES  # at most this many; ALL: every frame
    fps: float = ALL  # at most this many a second of video; ALL: no such bound

    def indices(self, total: int, file_fps: float) -> np.ndarray:  # [n] int64, n <= total
        """The frames kept of ``total`` running at ``file_fps`` (0: unknown)."""
        count = total if self.num_frames == ALL else min(self.num_frames, total)
        if self.fps != ALL:
            seconds = total / file_fps if file_fps > 0 else 0.0
            count = min(count, math.floor(seconds * self.fps))
        count = max(1, count)
        if count == total:
            return np.arange(total)
        return np.linspace(0, total - 1, count).astype(np.int64)


def video_loading(kwargs: Any) -> VideoLoading:
    """A request's ``media_io_kwargs`` -> its video loading (None: vLLM's defaults)."""
    if kwargs is None:
        return VideoLoading()
    if not isinstance(kwargs, dict):
        raise MultiModalInputError(
            f'{PARAM} must be an object like {{"video": {{"num_frames": 8}}}}, got {kwargs!r}.',
            PARAM,
        )
    for modality, options in kwargs.items():
        if not isinstance(options, dict):
            raise MultiModalInputError(
                f"{PARAM}[{modality!r}] must be an object of options, got {options!r}.", PARAM
            )
        if modality != "video" and options:
            raise MultiModalInputError(
                f"{PARAM}[{modality!r}]: {', '.join(map(repr, options))} not implemented; "
                f"only videos take per-request options here ({', '.join(_VIDEO_KEYS)}).",
                PARAM,
            )
    video = kwargs.get("video") or {}
    other = [k for k in video if k not in _VIDEO_KEYS]
    if other:
        raise MultiModalInputError(
            f"{PARAM}['video']: {', '.join(map(repr, other))} not implemented; a video takes "
            f"{' and '.join(_VIDEO_KEYS)} (frames are decoded by PyAV).",
            PARAM,
        )
    return VideoLoading(
        _num_frames(video.get("num_frames", NUM_FRAMES)), _fps(video.get("fps", ALL))
    )


def _num_frames(value: Any) -> int:
    whole = isinstance(value, int) and not isinstance(value, bool)
    if not whole or not (value == ALL or 1 <= value <= MAX_VIDEO_FRAMES):
        raise MultiModalInputError(
            f"{PARAM}['video']['num_frames'] must be a whole number in [1, {MAX_VIDEO_FRAMES}] "
            f"(the frames a video may have) or -1 (every frame), got {value!r}.",
            PARAM,
        )
    return int(value)


def _fps(value: Any) -> float:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not (value == ALL or 0 < value < math.inf):
        raise MultiModalInputError(
            f"{PARAM}['video']['fps'] must be a number > 0 or -1 (the file's own rate), got "
            f"{value!r}.",
            PARAM,
        )
    return float(value)
