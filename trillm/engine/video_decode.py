"""A chat's ``video_url`` part (vLLM's): its URL read as an image's is (``media.py``: data:,
file:// under --allowed-local-media-path, http(s) within the fetch limits, ``video/*``), its
file decoded by PyAV (the optional ``trillm[video]`` extra; refused naming it when absent).

Frames are sampled as vLLM's video loader samples them: all of them up to ``num_frames``
(vLLM's default 32), else ``num_frames`` spread evenly from the first to the last, or fewer
where the request's ``media_io_kwargs`` ask (``media_io.py``). Sizes are
checked from the container's header before any frame is decoded (the stream's frame size,
its frame count times that size, the sampled frames' pixels), and decoding stops after the
last sampled frame, so a header cannot make the decoder run past what was checked.
"""

from __future__ import annotations

import io
from functools import partial
from typing import Any

import attrs
import numpy as np
import trio

from trillm.engine import video_inputs, video_sampling
from trillm.engine.media import MediaConnector, MultiModalInputError
from trillm.engine.media_io import VideoLoading

MAX_DECODE_PIXELS = 1 << 33  # a stream's frames times their pixels (~4,000 1080p frames)
MISSING = "decoding a video file needs PyAV: install trillm[video] (pip install av)"


@attrs.frozen
class VideoSource:
    """A ``video_url`` part's URL, opened and decoded by stage 3."""

    url: str
    param: str  # e.g. messages[0].content[1].video_url
    loading: VideoLoading = VideoLoading()  # the frames kept (the request's media_io_kwargs)
    modality = "video"  # its multi_modal_data key


async def open_videos(
    value: Any,
    limit: int,
    connector: MediaConnector,
    limiter: trio.CapacityLimiter,
    max_frame_pixels: int,
    processor_kwargs: dict[str, Any],
    temporal_patch_size: int,
) -> list[tuple[Any, float]]:
    """``multi_modal_data["video"]`` -> each video's frames and the fps they were sampled at:
    the count checked, ``VideoSource``s read and decoded (in a thread), the sizes checked,
    then the frames ``processor_kwargs`` sample (``video_sampling.py``)."""
    videos = video_inputs.as_list(value)
    if len(videos) > limit:
        raise MultiModalInputError(
            f"multi_modal_data['video']: {len(videos)} videos, at most {limit} per prompt "
            "(limit_mm_per_prompt)."
        )
    sampling = video_sampling.from_kwargs(processor_kwargs)
    out: list[tuple[Any, float]] = []
    for i, clip in enumerate(videos):
        frames, fps, param = clip, None, f"multi_modal_data['video'][{i}]"
        if isinstance(clip, VideoSource):
            raw = await connector.read(clip.url, clip.param, limiter, "video")
            decode = partial(decode_video, raw, clip.param, max_frame_pixels, clip.loading)
            (frames, fps), param = (
                await trio.to_thread.run_sync(decode, limiter=limiter),
                clip.param,
            )
        else:  # frames without their rate: transformers' metadata has no fps
            video_inputs.check_video(clip, param, max_frame_pixels)
        frames, fps = video_sampling.sampled(sampling, frames, fps, temporal_patch_size, param)
        out.append((frames, video_inputs.BARE_FRAMES_FPS if fps is None else fps))
    return out


def decode_video(
    raw: bytes, param: str, max_frame_pixels: int, loading: VideoLoading = VideoLoading()
) -> tuple[np.ndarray, float]:
    """A video file -> (its sampled frames [T, H, W, 3] uint8, the fps they were sampled at:
    transformers' ``VideoMetadata.sampled_fps``)."""
    try:
        import av
    except ImportError:
        raise MultiModalInputError(f"video_url: {MISSING}.", param) from None
    try:
        with av.open(io.BytesIO(raw)) as container:
            return _sampled(container, param, max_frame_pixels, loading)
    except (av.FFmpegError, ValueError, IndexError) as exc:
        raise MultiModalInputError(f"The video cannot be read: {exc}", param) from None


def _sampled(
    container: Any, param: str, max_frame_pixels: int, loading: VideoLoading
) -> tuple[np.ndarray, float]:
    if not container.streams.video:
        raise MultiModalInputError("The video file has no video stream.", param)
    stream = container.streams.video[0]
    fps = float(stream.average_rate or 0)
    total = _frame_count(stream, container, fps, param)
    width, height = int(stream.width), int(stream.height)
    if total * width * height > MAX_DECODE_PIXELS:
        raise MultiModalInputError(
            f"The video has {total} frames of {width}x{height} pixels, more than the limit of "
            f"{MAX_DECODE_PIXELS} pixels to decode.",
            param,
        )
    wanted = loading.indices(total, fps)
    video_inputs.check_sizes(len(wanted), height, width, param, max_frame_pixels)
    keep = set(wanted.tolist())
    frames = []
    for i, frame in enumerate(container.decode(stream)):
        if i in keep:
            if (frame.width, frame.height) != (width, height):
                raise MultiModalInputError("The video's frames change size.", param)
            frames.append(frame.to_ndarray(format="rgb24"))
        if i >= wanted[-1]:
            break
    if not frames:
        raise MultiModalInputError("The video has no frame to decode.", param)
    return np.stack(frames), len(frames) / total * (fps or video_inputs.BARE_FRAMES_FPS)


def _frame_count(stream: Any, container: Any, fps: float, param: str) -> int:
    """The stream's frames from the header (or its duration times its rate)."""
    total = int(stream.frames or 0)
    if total <= 0 and fps > 0 and container.duration:
        total = round(container.duration / 1_000_000 * fps)
    if total <= 0:
        raise MultiModalInputError("The video's header does not give its frame count.", param)
    return total
