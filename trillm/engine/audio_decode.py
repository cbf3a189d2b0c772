"""Audio bytes -> mono float32 samples at the model's rate, with the standard library and numpy.

WAV (RIFF) files: PCM of 8 (unsigned), 16, 24 or 32 bits, IEEE float of 32 or 64 bits, any
sample rate in [MIN_RATE, MAX_RATE] and any channel count; ``WAVE_FORMAT_EXTENSIBLE`` headers
name one of these. Integers are scaled to [-1, 1) as libsndfile (and so librosa, vLLM's
loader) scales them; channels are averaged to mono, as librosa does. The header is read first
and the clip's duration checked before any sample is converted, so a long clip costs nothing.

Resampling is scipy's ``resample_poly`` (vLLM's "scipy" resampling method; its default,
librosa's soxr, is not a dependency here), computed here with numpy: the rates' ratio reduced
to up / down, a Kaiser-windowed (beta 5) sinc low-pass of 20 * max(up, down) + 1 taps cut at
1 / max(up, down) of Nyquist, gain ``up``, and output sample j = sum_i x[i] h[j * down +
half - i * up] (the filter's delay removed), evaluated polyphase: only the taps that meet a
sample.
"""

from __future__ import annotations

import math
import struct

import numpy as np

MIN_RATE = 1000  # Hz: below, no speech survives; a bound on the upsampling work
MAX_RATE = 192000  # Hz: above, the low-pass grows past what one request should cost
_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE
_OUTPUTS_PER_BLOCK = 1 << 14  # resampled samples computed at once (bounds the temporaries)


class AudioDecodeError(ValueError):
    """Bytes that are not a WAV file this module reads; the message names what."""


class WavHeader:
    """What a WAV file's header says, read without converting samples."""

    def __init__(self, fmt: int, channels: int, rate: int, bits: int, data: memoryview) -> None:
        self.fmt, self.channels, self.rate, self.bits = fmt, channels, rate, bits
        self.data = data  # the sample bytes (whole frames)

    @property
    def frames(self) -> int:
        return len(self.data) // (self.channels * self.bits // 8)

    @property
    def seconds(self) -> float:
        return self.frames / self.rate


def read_wav_header(raw: bytes) -> WavHeader:
    """The header of a RIFF/WAVE file; AudioDecodeError naming what is missing or unsupported."""
    if len(raw) < 12 or raw[:4] != b"RIFF" or raw[8:12] != b"WAVE":
        raise AudioDecodeError("the data is not a WAV file (no RIFF/WAVE header)")
    view, pos = memoryview(raw), 12
    fmt: tuple[int, int, int, int] | None = None
    while pos + 8 <= len(raw):
        chunk, size = raw[pos : pos + 4], struct.unpack_from("<I", raw, pos + 4)[0]
        body = view[pos + 8 : min(pos + 8 + size, len(raw))]  # a streamed file may say more
        if chunk == b"fmt ":
            fmt = _format(bytes(body))
        elif chunk == b"data":
            if fmt is None:
                raise AudioDecodeError("the WAV file's data comes before its fmt chunk")
            kind, channels, rate, bits = fmt
            whole = len(body) - len(body) % (channels * bits // 8)
            return WavHeader(kind, channels, rate, bits, body[:whole])
        pos += 8 + size + (size & 1)  # chunks are padded to even sizes
    raise AudioDecodeError("the WAV file has no fmt or data chunk")


def _format(body: bytes) -> tuple[int, int, int, int]:
    if len(body) < 16:
        raise AudioDecodeError("the WAV file's fmt chunk is truncated")
    kind, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", body)
    if kind == _EXTENSIBLE and len(body) >= 26:
        kind = struct.unpack_from("<H", body, 24)[0]  # the sub-format GUID's first field
    supported = {_PCM: (8, 16, 24, 32), _FLOAT: (32, 64)}
    if bits not in supported.get(kind, ()):
        raise AudioDecodeError(
            f"WAV sample format {kind} with {bits} bits is not supported (PCM of 8, 16, 24 or "
            "32 bits, or IEEE float of 32 or 64 bits)"
        )
    if channels < 1:
        raise AudioDecodeError("the WAV file has no channels")
    if not MIN_RATE <= rate <= MAX_RATE:
        raise AudioDecodeError(
            f"the WAV file's sample rate {rate} Hz is outside [{MIN_RATE}, {MAX_RATE}] Hz"
        )
    return kind, channels, rate, bits


def wav_samples(header: WavHeader) -> np.ndarray:  # [frames] float32, mono
    """The header's samples as float32 in [-1, 1), channels averaged."""
    data, bits = header.data, header.bits
    if header.fmt == _FLOAT:
        values = np.frombuffer(data, "<f4" if bits == 32 else "<f8").astype(np.float32)
    elif bits == 8:  # 8-bit PCM is unsigned
        values = (np.frombuffer(data, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif bits == 24:
        b = np.frombuffer(data, np.uint8).reshape(-1, 3).astype(np.int32)
        ints = (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8  # sign-extended
        values = ints.astype(np.float32) / float(1 << 23)
    else:
        ints = np.frombuffer(data, "<i2" if bits == 16 else "<i4")
        values = (ints / float(1 << (bits - 1))).astype(np.float32)
    frames = values.reshape(-1, header.channels)
    return frames.mean(axis=1, dtype=np.float32) if header.channels > 1 else frames[:, 0]


def _lowpass(up: int, down: int) -> tuple[np.ndarray, int]:
    """scipy's ``resample_poly`` filter (``firwin`` with a ('kaiser', 5.0) window) times up,
    and its half length."""
    rate = max(up, down)
    half = 10 * rate
    taps = np.arange(-half, half + 1, dtype=np.float64)
    h = np.sinc(taps / rate) / rate * np.kaiser(2 * half + 1, 5.0)
    return h / h.sum() * up, half


def resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:  # float32 [n'] <- [n]
    """``samples`` at ``rate`` Hz as ``target`` Hz, as ``scipy.signal.resample_poly`` computes
    it (to float64 rounding)."""
    g = math.gcd(rate, target)
    up, down = target // g, rate // g
    if up == down:
        return samples.astype(np.float32)
    h, half = _lowpass(up, down)
    n = len(samples)
    n_out = -(-n * up // down)  # ceil
    per_phase = -(-len(h) // up) + 1  # taps of one output, at most
    h = np.concatenate([h, np.zeros(per_phase * up - len(h) + up)])
    x = np.concatenate([np.zeros(per_phase), samples.astype(np.float64), np.zeros(per_phase)])
    taps = np.arange(per_phase)
    out = np.empty(n_out, dtype=np.float64)
    for lo in range(0, n_out, _OUTPUTS_PER_BLOCK):
        j = np.arange(lo, min(lo + _OUTPUTS_PER_BLOCK, n_out))
        k = j * down + half  # the output's index in the upsampled, filtered signal
        last = k // up  # the last input sample the filter meets
        phase = k - last * up
        rows = x[per_phase + last[:, None] - taps]  # x[last - m] (zeros past either end)
        out[j] = np.einsum("ij,ij->i", rows, h[phase[:, None] + up * taps])
    return out.astype(np.float32)
