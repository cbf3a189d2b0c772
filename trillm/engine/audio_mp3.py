"""MP3 audio through the optional dependency ``soundfile`` (``pip install 'trillm[audio]'``:
its wheels bundle libsndfile with an MP3 decoder, no system library needed). Without it MP3
is refused by name. The frame count from the stream's header is checked before decoding, and
decoding stops one frame past the longest clip the model takes, so a stream whose header lies
costs no more than the limit."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from trillm.engine.audio_decode import MAX_RATE, MIN_RATE, AudioDecodeError

MISSING = (
    "MP3 audio needs the optional dependency soundfile (pip install 'trillm[audio]'); "
    "send WAV, or install it"
)


def is_mp3(raw: bytes) -> bool:
    """An ID3 tag or an MPEG audio frame's sync word first."""
    return raw.startswith(b"ID3") or (len(raw) > 1 and raw[0] == 0xFF and raw[1] & 0xE0 == 0xE0)


def _soundfile() -> Any:
    try:
        import soundfile
    except ImportError:  # (an optional dependency)
        return None
    return soundfile


def available() -> bool:
    return _soundfile() is not None


def read_mp3(raw: bytes, max_seconds: float) -> tuple[np.ndarray, int]:
    """(mono float32 samples, their rate) of an MP3 stream at most ``max_seconds`` long;
    AudioDecodeError naming what is wrong (the length: ``too_long``)."""
    soundfile = _soundfile()
    if soundfile is None:
        raise AudioDecodeError(MISSING)
    try:
        with soundfile.SoundFile(io.BytesIO(raw)) as f:
            rate = int(f.samplerate)
            if f.format != "MP3" or not MIN_RATE <= rate <= MAX_RATE:
                raise AudioDecodeError(f"the data is not an MP3 stream of {MIN_RATE}-{MAX_RATE} Hz")
            limit = int(max_seconds * rate) + 1
            if f.frames > limit:
                raise TooLong(f.frames / rate)
            frames = f.read(frames=limit + 1, dtype="float32", always_2d=True)  # [n, channels]
    except (RuntimeError, TypeError, ValueError) as exc:  # libsndfile's errors
        if isinstance(exc, AudioDecodeError):
            raise
        raise AudioDecodeError(f"the MP3 data cannot be decoded: {exc}") from None
    if len(frames) > limit:  # the header understated it
        raise TooLong(len(frames) / rate)
    return frames.mean(axis=1, dtype=np.float32), rate


class TooLong(AudioDecodeError):
    def __init__(self, seconds: float) -> None:
        super().__init__(f"the audio is over {seconds:.2f} s long")
        self.seconds = seconds
