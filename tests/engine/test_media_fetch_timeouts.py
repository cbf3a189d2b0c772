"""Each kind of media URL is fetched within its own vLLM variable's seconds:
``VLLM_IMAGE_FETCH_TIMEOUT`` (5), ``VLLM_VIDEO_FETCH_TIMEOUT`` (30),
``VLLM_AUDIO_FETCH_TIMEOUT`` (10); past it the refusal names the variable."""

from __future__ import annotations

import time

import pytest
import trio
from image_server import ImageServer

from trillm.engine.media import MediaConnector, MultiModalInputError

VARIABLES = {
    "image": "VLLM_IMAGE_FETCH_TIMEOUT",
    "video": "VLLM_VIDEO_FETCH_TIMEOUT",
    "audio": "VLLM_AUDIO_FETCH_TIMEOUT",
}


def test_defaults_are_vllms(monkeypatch):
    for variable in VARIABLES.values():
        monkeypatch.delenv(variable, raising=False)
    timeouts = MediaConnector().fetch_timeouts
    assert {kind: timeouts[kind] for kind in VARIABLES} == {
        "image": (5.0, "VLLM_IMAGE_FETCH_TIMEOUT"),
        "video": (30.0, "VLLM_VIDEO_FETCH_TIMEOUT"),
        "audio": (10.0, "VLLM_AUDIO_FETCH_TIMEOUT"),
    }


def fetch_hanging_url(kind: str) -> tuple[str, float]:
    """The refusal of a URL that never answers, read as ``kind``, and the seconds it took."""
    with ImageServer(b"") as server:
        start = time.monotonic()
        with pytest.raises(MultiModalInputError) as refusal:
            trio.run(MediaConnector().read, server.url("/hang"), "p", trio.CapacityLimiter(1), kind)
        return str(refusal.value), time.monotonic() - start


@pytest.mark.parametrize("kind", ["video", "audio"])
def test_video_fetch_timeout_and_audio_fetch_timeout_are_read(monkeypatch, kind):
    # this kind's variable is short, the others long: the fetch ends by this kind's own
    for other, variable in VARIABLES.items():
        monkeypatch.setenv(variable, "1" if other == kind else "60")
    message, seconds = fetch_hanging_url(kind)
    assert f"took longer than 1 s ({VARIABLES[kind]})" in message
    assert seconds < 10
