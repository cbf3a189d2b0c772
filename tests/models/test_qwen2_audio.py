"""Qwen2-Audio (audio encoder + Qwen2 decoder) through the Python API: the expanded prompt equals
transformers' processor's, greedy tokens and prompt / sample log-probabilities equal
transformers' on a batch mixing audio and text-only requests (two clips in one prompt,
prefill chunked across the audio spans), ``LLM.chat`` ``input_audio`` parts (WAV of any width,
rate and channel count, decoded and resampled as pinned here), a preempted audio request
resumes with the same output, and what is not supported is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from mm_engine import (
    GREEDY,
    SCORED,
    batch_logprob_diff,
    check_preempted_resume,
    encoder_calls,
    module_llm,
)
from mm_engine import as_prompt as media_prompt
from qwen2_audio_reference import AUDIO, RATE, b64, hf_greedy, hf_inputs, tone
from qwen2_audio_reference import wav_bytes as wav

from trillm import LLM
from trillm.engine import audio_decode
from trillm.engine.preprocess import InvalidRequestError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

AUDIO_ID = 4097  # <|AUDIO|> in the tiny checkpoint's tokenizer
BUDGET = 16  # max_num_batched_tokens: a clip's 12-25 placeholders span two or more chunks
CASES = [  # (prompt, clips at 16 kHz): 0.5 s -> 12 audio tokens, 1 s (the window) -> 25
    (f"Listen {AUDIO} now", [tone(0, 0.5)]),
    ("The license grants", []),
    (f"{AUDIO} first, then {AUDIO} second", [tone(1, 1.0), tone(2, 0.3)]),
]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from trillm.testing.tiny_qwen2_audio import build_tiny_qwen2_audio

    return str(build_tiny_qwen2_audio(tmp_path_factory.mktemp("tiny-qwen2-audio")))


@pytest.fixture(scope="module")
def llm(path):
    yield from module_llm(
        path, max_model_len=256, max_num_batched_tokens=BUDGET, limit_mm_per_prompt={"audio": 2}
    )


def as_prompt(text: str, clips: list) -> object:
    return media_prompt(text, [(c, RATE) for c in clips], "audio")


def test_mixed_batch_equals_transformers_tokens_and_logprobs(llm, path):
    before = encoder_calls(llm)
    outs = llm.generate([as_prompt(t, c) for t, c in CASES], SCORED, use_tqdm=False)
    assert encoder_calls(llm) == before + 3  # once per clip, however many chunks
    assert batch_logprob_diff(path, CASES, outs, hf_greedy) < 1e-4
    assert outs[0].prompt_token_ids.count(AUDIO_ID) == 12
    assert outs[2].prompt_token_ids.count(AUDIO_ID) == 25 + 7


def test_prefix_cache_keys_include_the_clip(llm):
    text = f"A text long enough to fill one whole block of tokens, then {AUDIO} and more"
    first, other, same = (
        llm.generate(as_prompt(text, [tone(seed, 0.4)]), GREEDY, use_tqdm=False)[0]
        for seed in (10, 11, 10)
    )
    assert first.num_cached_tokens == 0
    assert other.num_cached_tokens == 0  # same text, another clip: nothing shared
    assert same.num_cached_tokens >= 16  # same text and clip: its full blocks
    assert same.outputs[0].token_ids == first.outputs[0].token_ids


@pytest.mark.parametrize("seconds", [0.0201, 0.0399, 0.06, 0.2, 0.99, 1.0])
def test_placeholder_expansion_equals_the_processors(llm, path, seconds):
    clip = tone(3, seconds)
    out = llm.generate(as_prompt(f"a {AUDIO} b", [clip]), GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == hf_inputs(path, f"a {AUDIO} b", [clip])["input_ids"][0].tolist()


def test_chat_input_audio_parts_decode_any_wav(llm, path):
    # 16-bit mono at the model's rate is the reference's own samples; the others decode
    # (8 / 24 / 32-bit, float, stereo, 8 kHz and 44.1 kHz) to what the pinned decoder and
    # resampler give, which the reference then takes.
    clip = np.round(tone(4, 0.6) * 32768) / 32768
    cases = [(wav(clip), clip)]
    for width, channels, rate in [(1, 2, 8000), (3, 1, 44100), (4, 2, RATE)]:
        source = tone(5 + width, 0.5, rate)
        data = wav(source, rate, width, channels)
        cases.append((data, audio_decode.resample(_decoded(data), rate, RATE)))
    for data, samples in cases:
        parts = [
            {"type": "input_audio", "input_audio": {"data": b64(data), "format": "wav"}},
            {"type": "text", "text": "What is it?"},
        ]
        out = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
        text = f"<|im_start|>user\nAudio 1: {AUDIO}\nWhat is it?<|im_end|>\n<|im_start|>assistant\n"
        ids, tokens, _ = hf_greedy(path, text, [samples])
        assert (out.prompt_token_ids, out.outputs[0].token_ids) == (ids, tokens)


def mp3(samples: np.ndarray, rate: int = RATE) -> bytes:
    import io

    soundfile = pytest.importorskip("soundfile")
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format="MP3")
    return out.getvalue()


def test_chat_mp3_with_soundfile_and_refused_without(llm, path, monkeypatch):
    # MP3 (the optional audio extra): decoded by soundfile, then as a WAV's samples are;
    # too long a stream is refused from its header; without soundfile, a 400 naming it.
    import io

    import soundfile

    data = mp3(tone(12, 0.6, 22050), 22050)
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    parts = [{"type": "input_audio", "input_audio": {"data": b64(data), "format": "mp3"}}]
    out = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)[0]
    text = f"<|im_start|>user\nAudio 1: {AUDIO}\n<|im_end|>\n<|im_start|>assistant\n"
    ids, tokens, _ = hf_greedy(path, text, [audio_decode.resample(samples, rate, RATE)])
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == (ids, tokens)
    long_part = {"data": b64(mp3(tone(13, 1.5))), "format": "mp3"}
    with pytest.raises(InvalidRequestError, match="s long; this model takes at most 1 s"):
        llm.chat(
            [{"role": "user", "content": [{"type": "input_audio", "input_audio": long_part}]}],
            GREEDY,
        )
    monkeypatch.setattr("trillm.engine.audio_mp3._soundfile", lambda: None)
    for fmt in ("mp3", "wav"):  # named by the format, or found by the bytes
        parts[0]["input_audio"]["format"] = fmt
        with pytest.raises(
            (InvalidRequestError, ValueError), match="optional dependency soundfile"
        ):
            llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)


def _decoded(data: bytes) -> np.ndarray:
    return audio_decode.wav_samples(audio_decode.read_wav_header(data))


def test_wav_samples_scale_as_libsndfile_and_average_channels():
    ramp = np.array([-1.0, -0.5, 0.0, 0.25, 0.999], np.float32)
    for width in (1, 2, 3, 4):
        step = 2.0 ** (1 - 8 * width)  # one quantization step
        got = _decoded(wav(ramp, 8000, width, channels=2))
        np.testing.assert_allclose(got, ramp, atol=step)
    header = audio_decode.read_wav_header(wav(ramp, 22050, 2, channels=3))
    assert (header.rate, header.channels, header.frames) == (22050, 3, 5)
    stereo = wav(np.zeros(4, np.float32), 8000, 2, 2)  # left 0.5, right -0.25 -> 0.125
    pcm = np.tile(np.array([16384, -8192], "<i2"), 4).tobytes()
    assert np.all(_decoded(stereo[:44] + pcm) == 0.125)


def test_resampling_is_pinned():
    # scipy's resample_poly, computed here with numpy: length ceil(n * up / down), a tone
    # below both Nyquists kept, and these exact values (a change of filter fails here).
    t = np.arange(4410) / 44100
    out = audio_decode.resample(np.sin(2 * np.pi * 440 * t).astype(np.float32), 44100, RATE)
    assert len(out) == 1600
    ref = np.sin(2 * np.pi * 440 * np.arange(1600) / RATE)
    assert np.abs(out - ref)[100:-100].max() < 1e-3
    ramp = np.linspace(-1, 1, 40, dtype=np.float32)
    pinned = audio_decode.resample(ramp, 8000, RATE)[30:34]
    np.testing.assert_allclose(pinned, PINNED_8K_TO_16K, atol=1e-6)
    scipy_signal = pytest.importorskip("scipy.signal")
    for rate in (8000, 22050, 44100, 48000):
        x = tone(6, 0.1, rate)
        want = scipy_signal.resample_poly(x.astype(np.float64), RATE, rate)
        np.testing.assert_allclose(audio_decode.resample(x, rate, RATE), want, atol=1e-6)


PINNED_8K_TO_16K = [-0.23088865, -0.20502205, -0.17958006, -0.15376656]


def test_preempted_audio_requests_resume(path):
    cases = [CASES[0], CASES[2], (f"Then {AUDIO}", [tone(7, 0.8)]), CASES[1]]
    check_preempted_resume(
        path,
        cases,
        [as_prompt(*case) for case in cases],
        hf_greedy,
        max_model_len=128,
        num_gpu_blocks_override=8,  # 4 requests need 14 blocks: forces preemption
        max_num_batched_tokens=32,
        limit_mm_per_prompt={"audio": 2},
    )


def test_bad_audio_is_refused_by_name(llm):
    long_wav = wav(np.zeros(RATE + 160, np.float32))
    clip = (tone(8, 0.3), RATE)
    for prompt, words in [
        (as_prompt(f"{AUDIO}{AUDIO}{AUDIO}", [tone(8, 0.1)] * 3), "at most 2 per prompt"),
        (
            {"prompt": AUDIO, "multi_modal_data": {"audio": (np.zeros(RATE * 2), RATE)}},
            "at most 1 s",
        ),
        ({"prompt": AUDIO, "multi_modal_data": {"audio": (np.zeros((2, 80)), RATE)}}, "1-D numpy"),
        ({"prompt": AUDIO, "multi_modal_data": {"audio": (tone(8, 1), 500)}}, "outside [1000"),
        ({"prompt": AUDIO, "multi_modal_data": {"audio": (np.zeros(100), RATE)}}, "too short"),
        ({"prompt": "no slot", "multi_modal_data": {"audio": clip}}, "0 audio placeholder(s)"),
        ({"prompt": AUDIO, "multi_modal_data": {"image": []}}, "takes audio only"),
        ({**as_prompt(AUDIO, [clip[0]]), "mm_processor_kwargs": {"a": 1}}, "mm_processor_kwargs"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            llm.generate(prompt, GREEDY, use_tqdm=False)
        assert words in str(info.value)
    nan = np.full(8000, np.nan, np.float32)
    with pytest.raises(InvalidRequestError, match="not finite"):
        llm.generate({"prompt": AUDIO, "multi_modal_data": {"audio": (nan, RATE)}}, GREEDY)
    for spec, words in [
        ({"data": b64(long_wav), "format": "wav"}, "1.01 s long; this model takes at most 1 s"),
        ({"data": "not base64!", "format": "wav"}, "not valid base64"),
        ({"data": b64(b"RIFF....WAVEjunk"), "format": "wav"}, "no fmt or data chunk"),
        ({"data": b64(b"ID3\x03" + bytes(64)), "format": "mp3"}, "cannot be read"),
        ({"data": b64(wav(clip[0])), "format": "flac"}, "format 'flac' is not supported"),
    ]:
        parts = [{"type": "input_audio", "input_audio": spec}]
        with pytest.raises((InvalidRequestError, ValueError)) as info:
            llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)
        assert words in str(info.value)
    assert llm.generate("still serving", GREEDY)[0].outputs[0].token_ids  # nothing harmed


def test_config_and_limits(path, tmp_path):
    import json
    import shutil

    from trillm.config import EngineArgs
    from trillm.engine.config_builder import build_config

    assert build_config(EngineArgs(path)).limit_mm_per_prompt == {"audio": 1}
    off = LLM(path, limit_mm_per_prompt={"audio": 0}, kv_cache_memory="8MiB",
              distributed_executor_backend="uni")  # fmt: skip
    try:
        with pytest.raises(InvalidRequestError, match="audio inputs are off"):
            off.generate(as_prompt(AUDIO, [tone(9, 0.2)]), GREEDY)
    finally:
        off.shutdown()
    for args, words in [
        (dict(limit_mm_per_prompt={"image": 1}), "takes no image inputs"),
        (dict(mm_processor_kwargs={"x": 1}), "mm_processor_kwargs: not supported"),
    ]:
        with pytest.raises(ValueError, match=words):
            build_config(EngineArgs(path, **args))
    folder = tmp_path / "llama-text"
    shutil.copytree(path, folder)
    data = json.loads((folder / "config.json").read_text())
    data["text_config"]["model_type"] = "llama"
    (folder / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="a 'llama' language model is not supported"):
        build_config(EngineArgs(str(folder)))


def test_audio_parts_reach_the_template_as_vllm_passes_them():
    # "openai" content format: {"type": "audio"} where the part was (vLLM's shape); "string":
    # the model's placeholder in the text; a model without audio refuses the part by name.
    from trillm.engine.chat_template import ChatTemplateError, render_template

    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "hi"}]}]
    parts = "{% for p in messages[0]['content'] %}[{{ p['type'] }}]{% endfor %}"
    assert render_template(parts, messages, content_format="openai", audio_placeholder=AUDIO) == (
        "[audio][text]"
    )
    whole = "{{ messages[0]['content'] }}"
    got = render_template(whole, messages, content_format="string", audio_placeholder=AUDIO)
    assert got == f"{AUDIO}\nhi"
    with pytest.raises(ChatTemplateError, match="has type 'audio'"):
        render_template(whole, messages, content_format="string", image_placeholder="<image>")
