"""Small MP4 files for the video tests, made and decoded with PyAV (the ``trillm[video]``
extra; a test that needs it is skipped without it)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest


def mp4(frames: np.ndarray, rate: int = 8) -> bytes:
    """An MPEG-4 file of ``frames`` [T, H, W, 3] uint8 at ``rate`` frames a second."""
    av = pytest.importorskip("av", reason="video files need PyAV (the trillm[video] extra)")
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def decoded(data: bytes) -> np.ndarray:  # [T, H, W, 3]: every frame, as the server decodes it
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def video_data_url(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"
