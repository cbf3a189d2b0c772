"""Bad requests to a real ``trillm serve``: each answered with the right status and the OpenAI
error shape naming the field, and the server still serves afterwards."""

from __future__ import annotations

import httpx
import pytest
from server_harness import ServerProcess

MAX_MODEL_LEN = 256
VOCAB = 4096  # tiny_models.BASE["vocab_size"]

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
COMPLETION = {"prompt": "Hello", "max_tokens": 4}


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory("llama")
    log = tmp_path_factory.mktemp("server-validation") / "server.log"
    srv = ServerProcess(
        [
            model,
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--kv-cache-memory",
            "16MiB",
            "--max-num-seqs",
            "8",
            "--served-model-name",
            "tiny",
            "alias",
        ],
        log,
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def chat(**changes):
    return {**CHAT, **changes}


def completion(**changes):
    return {**COMPLETION, **changes}


def without(body, key):
    return {k: v for k, v in body.items() if k != key}


C, P = "/v1/chat/completions", "/v1/completions"

# (name, method, path, json body or raw bytes/content-type, status, param)
CASES = [
    ("chat_missing_messages", "POST", C, without(CHAT, "messages"), 400, "messages"),
    ("chat_messages_not_list", "POST", C, chat(messages="hi"), 400, "messages"),
    ("chat_messages_empty", "POST", C, chat(messages=[]), 400, "messages"),
    (
        "chat_content_int",
        "POST",
        C,
        chat(messages=[{"role": "user", "content": 3}]),
        400,
        "messages[0].content",
    ),
    ("chat_missing_role", "POST", C, chat(messages=[{"content": "hi"}]), 400, "messages[0].role"),
    (
        "chat_image_part",
        "POST",
        C,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "messages[0].content[0].type",
    ),
    ("temperature_string", "POST", C, chat(temperature="hot"), 400, "temperature"),
    ("temperature_negative", "POST", C, chat(temperature=-1), 400, "temperature"),
    ("top_p_zero", "POST", C, chat(top_p=0), 400, "top_p"),
    ("top_p_above_one", "POST", C, chat(top_p=1.5), 400, "top_p"),
    ("n_zero", "POST", C, chat(n=0), 400, "n"),
    ("n_too_many", "POST", C, chat(n=1000), 400, "n"),
    ("presence_penalty_range", "POST", C, chat(presence_penalty=3), 400, "presence_penalty"),
    ("frequency_penalty_range", "POST", C, chat(frequency_penalty=-2.5), 400, "frequency_penalty"),
    ("max_tokens_zero", "POST", C, chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens_beyond_context", "POST", C, chat(max_tokens=100_000), 400, "max_tokens"),
    (
        "max_completion_tokens_string",
        "POST",
        C,
        chat(max_completion_tokens="8"),
        400,
        "max_completion_tokens",
    ),
    ("too_many_stop_strings", "POST", C, chat(stop=[f"s{i}" for i in range(100)]), 400, "stop"),
    ("stop_string_too_long", "POST", C, chat(stop=["x" * 5000]), 400, "stop"),
    ("stop_not_strings", "POST", C, chat(stop=[1, 2]), 400, "stop"),
    ("stop_empty_string", "POST", C, chat(stop=[""]), 400, "stop"),
    ("logit_bias_bad_key", "POST", C, chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit_bias_value_range", "POST", C, chat(logit_bias={"5": 200}), 400, "logit_bias"),
    ("logit_bias_out_of_vocab", "POST", C, chat(logit_bias={str(VOCAB + 5): 1}), 400, "logit_bias"),
    ("top_logprobs_over_cap", "POST", C, chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("top_logprobs_without_logprobs", "POST", C, chat(top_logprobs=2), 400, "top_logprobs"),
    ("logprobs_not_bool", "POST", C, chat(logprobs="maybe"), 400, "logprobs"),
    ("stream_not_bool", "POST", C, chat(stream="maybe"), 400, "stream"),
    (
        "include_usage_not_bool",
        "POST",
        C,
        chat(stream=True, stream_options={"include_usage": 2}),  # (0 / 1: lax booleans)
        400,
        "stream_options.include_usage",
    ),
    (
        "response_format_type",
        "POST",
        C,
        chat(response_format={"type": "xml"}),
        400,
        "response_format.type",
    ),
    (
        "json_schema_without_schema",
        "POST",
        C,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        400,
        "response_format.json_schema",
    ),
    (
        "structured_outputs_two_kinds",
        "POST",
        C,
        chat(structured_outputs={"regex": "a+", "choice": ["a"]}),
        400,
        "structured_outputs",
    ),
    ("unknown_model", "POST", C, chat(model="gpt-4"), 404, "model"),
    (
        "request_chat_template_refused",
        "POST",
        C,
        chat(chat_template="{{ messages }}"),
        400,
        "chat_template",
    ),
    (
        "continue_final_without_assistant",
        "POST",
        C,
        chat(continue_final_message=True, add_generation_prompt=False),
        400,
        "continue_final_message",
    ),
    ("seed_string", "POST", C, chat(seed="abc"), 400, "seed"),
    ("repetition_penalty_zero", "POST", C, chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("top_k_negative", "POST", C, chat(top_k=-5), 400, "top_k"),
    ("min_p_range", "POST", C, chat(min_p=2), 400, "min_p"),
    ("min_tokens_over_max", "POST", C, chat(min_tokens=10, max_tokens=4), 400, "min_tokens"),
    ("stop_token_ids_negative", "POST", C, chat(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("prompt_logprobs_over_cap", "POST", C, chat(prompt_logprobs=50), 400, "prompt_logprobs"),
    ("priority_without_policy", "POST", C, chat(priority=5), 400, "priority"),
    ("completion_missing_prompt", "POST", P, without(COMPLETION, "prompt"), 400, "prompt"),
    ("completion_prompt_empty_list", "POST", P, completion(prompt=[]), 400, "prompt"),
    ("completion_prompt_out_of_vocab", "POST", P, completion(prompt=[1, VOCAB + 7]), 400, "prompt"),
    ("completion_prompt_mixed", "POST", P, completion(prompt=[1, "a"]), 400, "prompt[1]"),
    (
        "completion_prompt_too_long",
        "POST",
        P,
        completion(prompt=list(range(10, 10 + MAX_MODEL_LEN + 4))),
        400,
        "prompt",
    ),
    ("completion_logprobs_over_cap", "POST", P, completion(logprobs=50), 400, "logprobs"),
    ("completion_echo_not_bool", "POST", P, completion(echo="x"), 400, "echo"),
    ("completion_suffix", "POST", P, completion(suffix="end"), 400, "suffix"),
    ("completion_best_of", "POST", P, completion(best_of=3), 400, "best_of"),
    ("completion_unknown_model", "POST", P, completion(model="davinci"), 404, "model"),
    ("detokenize_out_of_vocab", "POST", "/detokenize", {"tokens": [1, VOCAB]}, 400, "tokens"),
    ("detokenize_not_ints", "POST", "/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("tokenize_nothing", "POST", "/tokenize", {}, 400, "prompt"),
    ("malformed_json", "POST", C, b'{"messages": [', 400, None),
    ("json_array_body", "POST", C, b"[1, 2]", 400, None),
    ("json_string_body", "POST", P, b'"hello"', 400, None),
    ("wrong_content_type", "POST", C, ("text/plain", b'{"messages": []}'), 400, None),
    ("body_too_large", "POST", P, b'{"prompt": "' + b"a" * (17 * 1024 * 1024) + b'"}', 413, None),
    ("wrong_method", "GET", C, None, 405, None),
    ("unknown_route", "POST", "/v1/nonexistent", {}, 404, None),
]


def send(srv: ServerProcess, method: str, path: str, body) -> httpx.Response:
    kwargs: dict = {"timeout": 60}
    if isinstance(body, dict):
        kwargs["json"] = body
    elif isinstance(body, bytes):
        kwargs["content"] = body
        kwargs["headers"] = {"Content-Type": "application/json"}
    elif isinstance(body, tuple):
        kwargs["content"] = body[1]
        kwargs["headers"] = {"Content-Type": body[0]}
    return httpx.request(method, srv.url + path, **kwargs)


def test_at_least_30_cases():
    assert len(CASES) >= 30
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,method,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request(server, name, method, path, body, status, param):
    r = send(server, method, path, body)
    assert r.status_code == status, (name, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert isinstance(error["message"], str) and error["message"]
    expected_type = {
        400: "BadRequestError",
        404: "NotFoundError",
        405: "MethodNotAllowedError",
        413: "PayloadTooLargeError",
    }[status]
    assert error["type"] == expected_type
    assert error["param"] == param, error


def test_context_errors_carry_token_counts(server):
    r = send(server, "POST", C, chat(max_tokens=100_000))
    message = r.json()["error"]["message"]
    assert str(MAX_MODEL_LEN) in message and "100000" in message
    too_long = list(range(10, 10 + MAX_MODEL_LEN + 4))
    message = send(server, "POST", P, completion(prompt=too_long)).json()["error"]["message"]
    assert str(MAX_MODEL_LEN) in message and str(len(too_long)) in message


def test_unknown_fields_are_accepted(server):
    r = send(server, "POST", P, completion(frobnicate=1, metadata={"a": "b"}))
    assert r.status_code == 200, r.text


def test_alias_model_name_is_accepted(server):
    r = send(server, "POST", P, completion(model="alias"))
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "tiny"


def test_still_serving_after_bad_requests(server):
    for _, method, path, body, _, _ in CASES[:10]:
        send(server, method, path, body)
    r = send(server, "POST", C, chat(temperature=0))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] >= 1
    assert httpx.get(server.url + "/health").status_code == 200
