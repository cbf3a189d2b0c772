"""A real ``trillm serve`` driven by the official ``openai`` client (sync and async): greedy
output equals transformers' on the same tiny model, streaming equals non-streaming, n, seeds,
stop strings, logprobs, token-id prompts, usage, /tokenize and /detokenize."""

from __future__ import annotations

import httpx
import openai
import pytest
from hf_reference import hf_greedy, load_hf_model
from server_harness import ServerProcess, metric_value

MAX_NEW = 12
NAME = "tiny-llama"


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("server-openai") / "server.log"
    srv = ServerProcess(
        [
            model_path,
            "--served-model-name",
            NAME,
            "--max-model-len",
            "512",
            "--kv-cache-memory",
            "32MiB",
            "--max-num-seqs",
            "16",
            "--block-size",
            "16",
            "--enable-prompt-tokens-details",
        ],
        log,
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def extra(obj, key):
    return (obj.model_extra or {})[key]


def greedy_kwargs(**more):
    body = {"ignore_eos": True, "return_token_ids": True, **more.pop("extra_body", {})}
    return {"model": NAME, "temperature": 0, "max_tokens": MAX_NEW, "extra_body": body, **more}


# ---------------------------------------------------------------- numerics vs transformers


def test_greedy_completion_matches_transformers(client, tokenizer, model_path):
    prompt = "The quick brown fox jumps over"
    ids = tokenizer(prompt).input_ids
    expected = hf_greedy(model_path, ids, MAX_NEW)
    resp = client.completions.create(prompt=prompt, **greedy_kwargs())
    choice = resp.choices[0]
    assert extra(choice, "token_ids") == expected
    assert choice.text == tokenizer.decode(expected, skip_special_tokens=True)
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == MAX_NEW
    assert resp.usage.total_tokens == len(ids) + MAX_NEW


def test_greedy_chat_matches_transformers_async(server, tokenizer, model_path):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Name three colours."}]},
    ]
    flat = [messages[0], {"role": "user", "content": "Name three colours."}]
    text = tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    expected = hf_greedy(model_path, ids, MAX_NEW)

    async def main():
        async with openai.AsyncOpenAI(
            base_url=server.base_url, api_key="unused", max_retries=0
        ) as aclient:
            return await aclient.chat.completions.create(messages=messages, **greedy_kwargs())

    resp = _run_asyncio(main)
    assert extra(resp, "prompt_token_ids") == ids
    assert extra(resp.choices[0], "token_ids") == expected
    assert resp.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.prompt_tokens == len(ids)


def _run_asyncio(main):
    import asyncio

    return asyncio.run(main())


def test_token_id_prompts_equal_text_prompts(client, tokenizer):
    prompts = ["Once upon a time", "In the beginning"]
    by_text = client.completions.create(prompt=prompts, **greedy_kwargs())
    by_ids = client.completions.create(
        prompt=[tokenizer(p).input_ids for p in prompts], **greedy_kwargs()
    )
    assert [c.index for c in by_ids.choices] == [0, 1]
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert by_ids.choices[0].text != by_ids.choices[1].text
    single = client.completions.create(prompt=tokenizer(prompts[1]).input_ids, **greedy_kwargs())
    assert single.choices[0].text == by_text.choices[1].text


def test_logprobs_match_transformers(client, tokenizer, model_path):
    import torch

    prompt = "Logprobs are"
    ids = tokenizer(prompt).input_ids
    resp = client.completions.create(prompt=prompt, logprobs=3, **greedy_kwargs())
    choice = resp.choices[0]
    out_ids = extra(choice, "token_ids")
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == MAX_NEW
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(MAX_NEW)]
    model = load_hf_model(model_path)
    with torch.no_grad():
        logits = model(torch.tensor([ids + out_ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)[len(ids) - 1 : -1]  # predicts each output token
    for i, tid in enumerate(out_ids):
        assert lp.token_logprobs[i] == pytest.approx(ref[i, tid].item(), abs=2e-3)
        assert len(lp.top_logprobs[i]) == 3
        # Greedy: the sampled token is the most likely one.
        best_text, best_value = max(lp.top_logprobs[i].items(), key=lambda kv: kv[1])
        assert best_value == pytest.approx(ref[i].max().item(), abs=2e-3)


def test_chat_logprobs(client):
    resp = client.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        top_logprobs=2,
        **greedy_kwargs(),
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == MAX_NEW
    assert "".join(c.token for c in content) == resp.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob)  # greedy picks the top
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert bytes(c.bytes) == c.token.encode()


# ---------------------------------------------------------------- streaming


def test_completion_stream_equals_full(client):
    kwargs = greedy_kwargs(prompt="Streaming text should")
    full = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_NEW
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_stream_equals_full(client):
    kwargs = greedy_kwargs(messages=[{"role": "user", "content": "Tell me a story."}])
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        full.usage.prompt_tokens,
        full.usage.completion_tokens,
    )


def test_stream_raw_sse_framing(server):
    body = {"model": NAME, "prompt": "abc", "max_tokens": 3, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes())
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    assert all(e.startswith(b"data: {") for e in events[:-2])


# ---------------------------------------------------------------- sampling parameters


def test_n_and_seed(client):
    def sample(seed):
        resp = client.completions.create(
            model=NAME,
            prompt="Random words:",
            n=3,
            temperature=1.0,
            seed=seed,
            max_tokens=8,
            extra_body={"ignore_eos": True},
        )
        assert sorted(c.index for c in resp.choices) == [0, 1, 2]
        assert resp.usage.completion_tokens == 24
        return [c.text for c in sorted(resp.choices, key=lambda c: c.index)]

    first = sample(7)
    assert sample(7) == first
    assert len(set(first)) > 1  # the n samples differ from each other
    assert sample(8) != first


def test_chat_n(client):
    resp = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4, seed=1
    )
    assert [c.index for c in resp.choices] == [0, 1]


def test_stop_string(client):
    kwargs = greedy_kwargs(prompt="Stop strings cut the text")
    text = client.completions.create(**kwargs).choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop
    kwargs["extra_body"] = {"ignore_eos": True}
    resp = client.completions.create(stop=[stop], **kwargs)
    choice = resp.choices[0]
    assert choice.text == text[: text.find(stop)]
    assert choice.finish_reason == "stop"
    assert extra(choice, "stop_reason") == stop
    streamed = client.completions.create(stop=[stop], stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_response_format_is_accepted(client):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for fmt in (
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    ):
        resp = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "json"}],
            max_tokens=3,
            response_format=fmt,
        )
        assert resp.choices[0].finish_reason in ("stop", "length")


def test_echo(client):
    resp = client.completions.create(prompt="Echo me", echo=True, **greedy_kwargs())
    assert resp.choices[0].text.startswith("Echo me")
    assert len(resp.choices[0].text) > len("Echo me")


def test_prefix_cache_hits_reported(client):
    prompt = " ".join(f"word{i}" for i in range(60))  # several full blocks
    client.completions.create(prompt=prompt, **greedy_kwargs(max_tokens=2))
    again = client.completions.create(prompt=prompt, **greedy_kwargs(max_tokens=2))
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0 and cached < again.usage.prompt_tokens


# ---------------------------------------------------------------- other endpoints


def test_models(client):
    assert [m.id for m in client.models.list().data] == [NAME]


def test_tokenize_detokenize_roundtrip(server, tokenizer):
    text = "Round trips: café, 東京, 🙂!"
    r = httpx.post(server.url + "/tokenize", json={"prompt": text, "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == tokenizer(text).input_ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    assert len(body["token_strs"]) == body["count"]
    back = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]}).json()
    assert back["prompt"] == text
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer(rendered, add_special_tokens=False).input_ids


def test_version_and_openapi(server):
    from openapi_spec_validator import validate

    import trillm

    assert httpx.get(server.url + "/version").json() == {"version": trillm.__version__}
    spec = httpx.get(server.url + "/openapi.json").json()
    validate(spec)
    for path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/version",
        "/metrics",
    ):
        assert path in spec["paths"]
    post = spec["paths"]["/v1/chat/completions"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "ChatCompletionRequest"
    )


def test_metrics_count_requests(server):
    text = httpx.get(server.url + "/metrics").text
    assert metric_value(text, "trillm:request_success_total") >= 5
    assert metric_value(text, "trillm:prompt_tokens_total") > 0
    assert metric_value(text, "trillm:generation_tokens_total") >= MAX_NEW
    assert metric_value(text, "trillm:time_to_first_token_seconds_count") >= 5
    assert metric_value(text, "trillm:e2e_request_latency_seconds_count") >= 5
    assert metric_value(text, "trillm:inter_token_latency_seconds_count") > 0
    assert metric_value(text, "trillm:prefix_cache_queries_total") > 0
    assert metric_value(text, "trillm:prefix_cache_hits_total") > 0
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        metric_value(text, f"trillm:{gauge}")
    assert 'finished_reason="length"' in text
