"""Chat audio parts over HTTP with the official openai client on the tiny Qwen2-Audio: an
``input_audio`` WAV is greedy-exact vs transformers (tokens, log-probabilities, the expanded
prompt and its usage count), vLLM's ``audio_url`` (data:, http(s), file://) answers the same,
and bad audio (not base64, mp3, not a WAV, too long, too many clips, a URL outside the allowed
hosts) is a 400 in OpenAI's error shape naming the problem while a stream in flight runs to
the same end as alone."""

from __future__ import annotations

import threading
from functools import partial

import httpx
import openai
import pytest
from image_server import ImageServer
from mm_http import MAX_NEW, greedy_chat, openai_server
from qwen2_audio_reference import AUDIO, b64, hf_greedy, tone, wav_bytes

NAME = "tiny-qwen2-audio"
CLIP = tone(21, 0.7)
WAV = wav_bytes(CLIP)
TEXT = f"<|im_start|>user\nAudio 1: {AUDIO}\nWhat is it?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from trillm.testing.tiny_qwen2_audio import build_tiny_qwen2_audio

    return str(build_tiny_qwen2_audio(tmp_path_factory.mktemp("tiny-qwen2-audio-http")))


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("audio-media")
    (root / "clip.wav").write_bytes(WAV)
    with ImageServer(b"", audio=WAV) as server:
        yield server, root


@pytest.fixture(scope="module")
def client(path, media, tmp_path_factory):
    log = tmp_path_factory.mktemp("server-qwen2-audio") / "server.log"
    args = [path, "--served-model-name", NAME, "--max-model-len", "256"]
    args += ["--kv-cache-memory", "8MiB", "--max-num-seqs", "4"]
    args += ["--distributed-executor-backend", "uni", "--max-num-batched-tokens", "16"]
    args += ["--allowed-local-media-path", str(media[1])]
    args += ["--allowed-media-domains", "127.0.0.1"]
    yield from openai_server(args, log, timeout=120)


chat = partial(greedy_chat, model=NAME)


def input_audio(data: str, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


def audio_url(url: str) -> dict:
    return {"type": "audio_url", "audio_url": {"url": url}}


def quantized(clip):
    import numpy as np

    return np.clip(np.round(clip * 32768), -32768, 32767) / 32768


def test_input_audio_is_greedy_exact_and_audio_urls_answer_the_same(client, path, media):
    question = {"type": "text", "text": "What is it?"}
    out = chat(client, [input_audio(b64(WAV)), question], logprobs=True)
    ids, tokens, logprobs = hf_greedy(path, TEXT, [quantized(CLIP)], MAX_NEW)
    assert out.model_extra["prompt_token_ids"] == ids
    assert out.choices[0].model_extra["token_ids"] == tokens
    assert out.usage.prompt_tokens == len(ids)  # the placeholders counted
    ours = [entry.logprob for entry in out.choices[0].logprobs.content]
    ref = [float(logprobs[len(ids) - 1 + i, t]) for i, t in enumerate(tokens)]
    assert max(abs(a - b) for a, b in zip(ours, ref, strict=True)) < 1e-4
    srv, root = media
    for url in [
        f"data:audio/wav;base64,{b64(WAV)}",
        srv.url("/audio.wav"),
        (root / "clip.wav").as_uri(),
    ]:
        again = chat(client, [audio_url(url), question])
        assert again.choices[0].model_extra["token_ids"] == tokens, url


def test_bad_audio_is_400_naming_it_while_a_stream_runs(client, media):
    srv, root = media
    prompt = [{"type": "text", "text": "Count on"}]
    alone = chat(client, prompt, max_tokens=48).choices[0].model_extra["token_ids"]
    stream = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=48,
        temperature=0.0,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)  # the stream is in flight while the bad requests are answered
    cases = [
        ([input_audio("%%% not base64")], "not valid base64"),
        ([input_audio(b64(WAV), "flac")], "input_audio.format 'flac' is not supported"),
        ([input_audio(b64(b"ID3\x04" + bytes(64)), "mp3")], "cannot be read"),
        ([input_audio(b64(b"garbage bytes"))], "not a WAV file"),
        ([input_audio(b64(wav_bytes(tone(22, 2.5))))], "2.50 s long; this model takes at most 1 s"),
        ([input_audio(b64(WAV))] * 2, "at most 1 per prompt (limit_mm_per_prompt)"),
        ([audio_url(f"data:image/png;base64,{b64(WAV)}")], "is not an audio"),
        ([audio_url("https://example.com/a.wav")], "not one of --allowed-media-domains"),
        ([audio_url(srv.url("/text"))], "has content type 'text/html', not an audio"),
        ([audio_url((root.parent / "x.wav").as_uri())], "does not exist"),
    ]
    for parts, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, parts)
        error = info.value.body
        assert words in error["message"], (words, error)
        assert error["type"] == "BadRequestError" and error["code"] == 400
        assert error["param"].startswith(("messages[0].content[0]", "multi_modal_data"))
    tokens = [t for c in first.choices for t in c.model_extra.get("token_ids") or []]
    tokens += [
        t for chunk in chunks for c in chunk.choices for t in c.model_extra.get("token_ids") or []
    ]
    assert tokens == alone


def test_tokenize_counts_the_audio_tokens(client, path):
    base = str(client.base_url).removesuffix("/v1/")
    body = {
        "model": NAME,
        "messages": [
            {
                "role": "user",
                "content": [input_audio(b64(WAV)), {"type": "text", "text": "What is it?"}],
            }
        ],
    }
    got = httpx.post(f"{base}/tokenize", json=body, timeout=60).json()
    assert got["tokens"] == hf_greedy(path, TEXT, [quantized(CLIP)], 1)[0]


def test_many_requests_with_audio_at_once(client):
    # Four clients at once, each with its own clip: each answer equals its own alone.
    parts = [
        [input_audio(b64(wav_bytes(tone(30 + i, 0.4)))), {"type": "text", "text": "Hm"}]
        for i in range(4)
    ]
    alone = [chat(client, p).choices[0].model_extra["token_ids"] for p in parts]
    results: dict[int, list[int]] = {}

    def one(i: int) -> None:
        results[i] = chat(client, parts[i]).choices[0].model_extra["token_ids"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(4)] == alone
