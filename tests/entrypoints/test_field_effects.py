"""Request fields over HTTP, each shown to change what happens (or refused with a 400 naming
it), on both /v1/completions and /v1/chat/completions where the field exists on both.

A real ``trillm serve`` on the embedded default model (random weights: the tests never rely on
what the text says, only on what a field must change). Greedy decoding, compared with the same
request without the field. tests/entrypoints/test_field_coverage.py maps every field to tests like these.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from server_harness import ServerProcess

PROMPT = "And God said, Let there be light"
EOS = 2  # <|im_end|>: the embedded model's EOS token
IM_START = 1  # another special token
ENDPOINTS = ["completions", "chat"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("field-effects") / "server.log"
    srv = ServerProcess(
        ["--max-model-len", "512", "--kv-cache-memory", "64MiB", "--trust-request-chat-template"],
        log,
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def body(endpoint: str, **fields) -> dict:
    base = {"max_tokens": 8, "temperature": 0, "return_token_ids": True}
    if endpoint == "completions":
        base["prompt"] = PROMPT
    else:
        base["messages"] = [{"role": "user", "content": PROMPT}]
    return {**base, **fields}


def post(srv: ServerProcess, endpoint: str, payload: dict) -> httpx.Response:
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    return httpx.post(srv.url + path, json=payload, timeout=120)


def full(srv: ServerProcess, endpoint: str, **fields) -> dict:
    r = post(srv, endpoint, body(endpoint, **fields))
    assert r.status_code == 200, r.text
    return r.json()


def gen(srv: ServerProcess, endpoint: str, **fields) -> dict:
    """The first choice as {text, ids, finish, raw}, the same shape for both endpoints."""
    out = full(srv, endpoint, **fields)
    choice = out["choices"][0]
    text = choice["text"] if endpoint == "completions" else choice["message"]["content"]
    return {
        "text": text,
        "ids": choice.get("token_ids"),
        "finish": choice["finish_reason"],
        "choice": choice,
        "raw": out,
    }


def refused(srv: ServerProcess, endpoint: str, param: str, **fields) -> str:
    r = post(srv, endpoint, body(endpoint, **fields))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert param in (error["param"] or "") or param in error["message"], error
    return error["message"]


def stream_events(srv: ServerProcess, endpoint: str, **fields) -> list[dict]:
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    payload = body(endpoint, stream=True, **fields)
    events = []
    with httpx.stream("POST", srv.url + path, json=payload, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    return events


def chunk_text(endpoint: str, event: dict) -> str:
    if not event["choices"]:
        return ""
    choice = event["choices"][0]
    if endpoint == "completions":
        return choice.get("text") or ""
    return choice.get("delta", {}).get("content") or ""


# ---------------------------------------------------------------- sampling


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_temperature_and_seed(server, endpoint):
    greedy = gen(server, endpoint, max_tokens=12)["ids"]
    assert gen(server, endpoint, max_tokens=12)["ids"] == greedy
    hot = gen(server, endpoint, max_tokens=12, temperature=1.5, seed=1)["ids"]
    assert hot != greedy  # temperature samples
    assert gen(server, endpoint, max_tokens=12, temperature=1.5, seed=1)["ids"] == hot
    assert gen(server, endpoint, max_tokens=12, temperature=1.5, seed=2)["ids"] != hot  # seed


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("only_the_top", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_top_k_top_p_min_p_that_keep_one_token_give_the_greedy_output(
    server, endpoint, only_the_top
):
    greedy = gen(server, endpoint, max_tokens=12)["ids"]
    hot = {"max_tokens": 12, "temperature": 2.0, "seed": 5}
    assert gen(server, endpoint, **hot)["ids"] != greedy
    assert gen(server, endpoint, **hot, **only_the_top)["ids"] == greedy


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize(
    "penalty",
    [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 2.0}],
)
def test_penalties_make_a_repetitive_output_less_repetitive(server, endpoint, penalty):
    plain = gen(server, endpoint, max_tokens=40, ignore_eos=True)["ids"]
    assert len(set(plain)) < len(plain)  # the random model repeats itself greedily
    penalised = gen(server, endpoint, max_tokens=40, ignore_eos=True, **penalty)["ids"]
    assert penalised != plain
    assert len(set(penalised)) > len(set(plain))


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_logit_bias_forces_a_token(server, endpoint):
    out = gen(server, endpoint, logit_bias={"300": 100})
    assert out["ids"] == [300] * 8
    assert gen(server, endpoint)["ids"] != out["ids"]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_allowed_token_ids_and_bad_words(server, endpoint):
    free = gen(server, endpoint)["ids"]
    allowed = [t for t in range(200, 230) if t not in free]
    out = gen(server, endpoint, allowed_token_ids=allowed)["ids"]
    assert len(out) == 8 and set(out) <= set(allowed)
    word = httpx.post(server.url + "/detokenize", json={"tokens": [free[0]]}).json()["prompt"]
    banned = gen(server, endpoint, bad_words=[word.strip()])["ids"]
    assert banned[0] != free[0]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_max_tokens(server, endpoint):
    out = gen(server, endpoint, max_tokens=3, ignore_eos=True)
    assert len(out["ids"]) == 3 and out["finish"] == "length"
    assert out["raw"]["usage"]["completion_tokens"] == 3


def test_max_completion_tokens_is_chats_max_tokens(server):
    out = gen(server, "chat", max_tokens=None, max_completion_tokens=3, ignore_eos=True)
    assert len(out["ids"]) == 3 and out["finish"] == "length"
    # it wins over the deprecated max_tokens, as in vLLM
    both = gen(server, "chat", max_tokens=7, max_completion_tokens=2, ignore_eos=True)
    assert len(both["ids"]) == 2


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_stop_strings_and_include_stop_str_in_output(server, endpoint):
    text = gen(server, endpoint, max_tokens=16, ignore_eos=True)["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip()
    cut = gen(server, endpoint, max_tokens=16, ignore_eos=True, stop=[stop])
    assert cut["text"] == text[: text.find(stop)] and cut["finish"] == "stop"
    kept = gen(
        server, endpoint, max_tokens=16, ignore_eos=True, stop=stop, include_stop_str_in_output=True
    )
    assert kept["text"] == text[: text.find(stop) + len(stop)]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_stop_token_ids(server, endpoint):
    ids = gen(server, endpoint, max_tokens=8, ignore_eos=True)["ids"]
    out = gen(server, endpoint, max_tokens=8, ignore_eos=True, stop_token_ids=[ids[2]])
    assert out["ids"] == ids[: ids.index(ids[2]) + 1] and out["finish"] == "stop"


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_eos_fields_ignore_eos_min_tokens_skip_special_tokens(server, endpoint):
    eos = {"logit_bias": {str(EOS): 100}}  # the model wants to end at once
    ended = gen(server, endpoint, **eos)
    assert ended["ids"] == [EOS] and ended["finish"] == "stop" and ended["text"] == ""
    ignored = gen(server, endpoint, ignore_eos=True, max_tokens=4, **eos)
    assert ignored["ids"] == [EOS] * 4 and ignored["finish"] == "length"
    assert ignored["text"] == ""  # skip_special_tokens (default true)
    shown = gen(server, endpoint, ignore_eos=True, max_tokens=2, skip_special_tokens=False, **eos)
    assert shown["text"] == "<|im_end|><|im_end|>"
    held = gen(server, endpoint, min_tokens=5, **eos)
    assert len(held["ids"]) == 6 and EOS not in held["ids"][:5] and held["ids"][5] == EOS


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_n_gives_independent_choices(server, endpoint):
    out = full(server, endpoint, n=3, temperature=1.0, seed=4, ignore_eos=True)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({tuple(c["token_ids"]) for c in choices}) > 1


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_return_token_ids_and_prompt_logprobs(server, endpoint):
    out = full(server, endpoint, prompt_logprobs=1)
    prompt_ids = out.get("prompt_token_ids") or out["choices"][0].get("prompt_token_ids")
    assert prompt_ids and out["choices"][0]["token_ids"]
    plp = out.get("prompt_logprobs") or out["choices"][0].get("prompt_logprobs")
    assert len(plp) == len(prompt_ids) and plp[0] is None  # the first token has no context
    assert all(len(entry) >= 1 for entry in plp[1:])
    bare = full(server, endpoint, return_token_ids=False)
    assert "token_ids" not in bare["choices"][0] or bare["choices"][0]["token_ids"] is None
    assert not bare.get("prompt_logprobs") and not bare["choices"][0].get("prompt_logprobs")


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_logprobs_and_return_tokens_as_token_ids(server, endpoint):
    if endpoint == "completions":
        fields = {"logprobs": 2}
    else:
        fields = {"logprobs": True, "top_logprobs": 2}
    out = gen(server, endpoint, **fields)
    as_ids = gen(server, endpoint, return_tokens_as_token_ids=True, **fields)
    if endpoint == "completions":
        assert all(len(top) == 2 for top in out["choice"]["logprobs"]["top_logprobs"])
        tokens = as_ids["choice"]["logprobs"]["tokens"]
    else:
        content = out["choice"]["logprobs"]["content"]
        assert len(content) == 8 and all(len(c["top_logprobs"]) == 2 for c in content)
        tokens = [c["token"] for c in as_ids["choice"]["logprobs"]["content"]]
        tops = [
            t["token"] for c in as_ids["choice"]["logprobs"]["content"] for t in c["top_logprobs"]
        ]
        assert tops and all(t.startswith("token_id:") for t in tops)
    assert tokens == [f"token_id:{t}" for t in as_ids["ids"]]
    assert not gen(server, endpoint)["choice"].get("logprobs")


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_truncate_prompt_tokens(server, endpoint):
    out = full(server, endpoint, truncate_prompt_tokens=3)
    prompt_ids = out.get("prompt_token_ids") or out["choices"][0].get("prompt_token_ids")
    whole = full(server, endpoint)
    whole_ids = whole.get("prompt_token_ids") or whole["choices"][0].get("prompt_token_ids")
    assert out["usage"]["prompt_tokens"] == 3 and prompt_ids == whole_ids[-3:]
    # a prompt longer than the context is served once truncated (refused without)
    long = PROMPT * 60
    fields = (
        {"prompt": long}
        if endpoint == "completions"
        else {"messages": [{"role": "user", "content": long}]}
    )
    refused(server, endpoint, "", max_tokens=2, **fields)
    kept = full(server, endpoint, max_tokens=2, truncate_prompt_tokens=16, **fields)
    assert kept["usage"]["prompt_tokens"] == 16


# ---------------------------------------------------------------- request handling


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_priority_needs_the_priority_policy(server, bos_server, endpoint):
    assert gen(server, endpoint, priority=0)["ids"]
    message = refused(server, endpoint, "priority", priority=1)
    assert "scheduling-policy priority" in message
    # --scheduling-policy priority: taken (the order it gives: tests/core/test_scheduler.py)
    assert gen(bos_server, endpoint, priority=-5)["ids"]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_timeout_ends_the_request(server, endpoint):
    out = gen(server, endpoint, timeout=0.2, max_tokens=480, ignore_eos=True)
    assert out["finish"] == "timeout" and len(out["ids"]) < 480
    refused(server, endpoint, "timeout", timeout=0)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_cache_salt_separates_prefix_cache_hits(server, endpoint):
    long = " ".join(f"w{i}" for i in range(80)) + f" {endpoint}"
    fields = {"max_tokens": 2}
    if endpoint == "completions":
        fields["prompt"] = long
    else:
        fields["messages"] = [{"role": "user", "content": long}]

    def cached(**more):
        usage = full(server, endpoint, **fields, **more)["usage"]
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    cached()
    assert cached() > 0  # the same prompt hits the prefix cache
    assert cached(cache_salt="salt-a") == 0  # a salt is a separate cache namespace
    assert cached(cache_salt="salt-a") > 0
    assert cached(cache_salt="salt-b") == 0


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_request_id_names_the_response(server, endpoint):
    rid = f"field-effects-{endpoint}-42"
    assert full(server, endpoint, request_id=rid)["id"] == rid
    assert full(server, endpoint)["id"] != rid


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_model_must_be_served(server, endpoint):
    name = httpx.get(server.base_url + "/models").json()["data"][0]["id"]
    assert gen(server, endpoint, model=name)["ids"]
    r = post(server, endpoint, body(endpoint, model="no-such-model"))
    assert r.status_code == 404 and "no-such-model" in r.json()["error"]["message"]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_stream_and_stream_options(server, endpoint):
    whole = gen(server, endpoint, max_tokens=6, ignore_eos=True)["text"]
    events = stream_events(server, endpoint, max_tokens=6, ignore_eos=True)
    assert len(events) > 1 and "".join(chunk_text(endpoint, e) for e in events) == whole
    assert not any(e.get("usage") for e in events)
    usage = stream_events(
        server, endpoint, max_tokens=6, ignore_eos=True, stream_options={"include_usage": True}
    )
    assert usage[-1]["usage"]["completion_tokens"] == 6 and usage[-1]["choices"] == []
    assert not any(e.get("usage") for e in usage[:-1])
    every = stream_events(
        server,
        endpoint,
        max_tokens=6,
        ignore_eos=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    with_text = [e for e in every if chunk_text(endpoint, e)]
    assert with_text and all(e.get("usage") for e in with_text)
    counts = [e["usage"]["completion_tokens"] for e in with_text]
    assert counts == sorted(counts) and counts[-1] == 6
    refused(server, endpoint, "stream_options", stream_options={"include_usage": True})


# ---------------------------------------------------------------- structured outputs

DIGIT = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}
TIGHT = {"structured_outputs": {"disable_any_whitespace": True}}  # no room for endless spaces
CLOSE = {"logit_bias": {"95": 30}}  # 95: "}"


def _is_digit_object(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"n"} and value["n"] in range(10)


# (fields, check on the text): each kind, in every spelling a request can use.
STRUCTURED = {
    "structured_outputs.choice": (
        {"structured_outputs": {"choice": ["alpha", "beta"]}},
        lambda t: t in ("alpha", "beta"),
    ),
    "guided_choice": ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    "structured_outputs.regex": (
        {"structured_outputs": {"regex": "[ab]{4}x"}},
        lambda t: re.fullmatch("[ab]{4}x", t),
    ),
    "guided_regex": ({"guided_regex": "[ab]{4}x"}, lambda t: re.fullmatch("[ab]{4}x", t)),
    "structured_outputs.grammar": (
        {"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},
        lambda t: t in ("yes", "no"),
    ),
    "guided_grammar": ({"guided_grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    "structured_outputs.json": (
        {"structured_outputs": {"json": DIGIT, "disable_any_whitespace": True}},
        _is_digit_object,
    ),
    "guided_json": ({"guided_json": DIGIT, **TIGHT}, _is_digit_object),
    "response_format.json_schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "digit", "schema": DIGIT, "strict": True},
            },
            **TIGHT,
        },
        _is_digit_object,
    ),
    # Any object: the random model would write keys forever, so '}' is favoured (outside the
    # grammar that bias alone gives "}}}}", not an object).
    "response_format.json_object": (
        {"response_format": {"type": "json_object"}, **CLOSE},
        lambda t: json.loads(t) == {},
    ),
    "structured_outputs.json_object": (
        {"structured_outputs": {"json_object": True}, **CLOSE},
        lambda t: json.loads(t) == {},
    ),
    "response_format.structural_tag": (
        {
            "response_format": {
                "type": "structural_tag",
                "format": {
                    "type": "tag",
                    "begin": "<n>",
                    "content": {"type": "json_schema", "json_schema": {"enum": [1, 2, 3]}},
                    "end": "</n>",
                },
            }
        },
        lambda t: re.fullmatch("<n>[123]</n>", t),
    ),
    "structured_outputs.structural_tag": (
        {
            "structured_outputs": {
                "structural_tag": {
                    "type": "structural_tag",
                    "format": {"type": "const_string", "value": "fixed"},
                }
            }
        },
        lambda t: t == "fixed",
    ),
}


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("kind", sorted(STRUCTURED))
def test_structured_outputs_constrain_the_text(server, endpoint, kind):
    fields, valid = STRUCTURED[kind]
    free = gen(server, endpoint, max_tokens=64)
    assert not valid_text(valid, free["text"])
    for sampling in ({}, {"temperature": 1.0, "seed": 11}):
        out = gen(server, endpoint, max_tokens=64, **sampling, **fields)
        assert out["finish"] == "stop" and valid_text(valid, out["text"]), (kind, out["text"])


def valid_text(check, text: str) -> bool:
    try:
        return bool(check(text))
    except ValueError:
        return False


def test_structural_tag_structures_and_triggers(server):
    """The older structural_tag form: free text until a trigger; after one, its structure.
    The random model writes "<" only when made to (token 30 favoured)."""
    tag = {
        "type": "structural_tag",
        "triggers": ["<"],
        "structures": [{"begin": "<n>", "schema": {"enum": [1, 2]}, "end": "</n>"}],
    }
    lt = {"logit_bias": {"30": 30}, "max_tokens": 24}
    assert gen(server, "chat", **lt)["text"].startswith("<<<")  # the bias alone
    out = gen(server, "chat", response_format=tag, **lt)["text"]
    # every "<" now opens a whole <n>1</n> or <n>2</n>; free text (newlines) between them
    assert out.startswith("<n>") and len(re.findall("<n>[12]</n>", out)) >= 2, out
    rest = re.sub("<n>[12]</n>", "", out)  # whitespace, and a tag max_tokens cut at the end
    assert re.fullmatch(r"\s*(<[n>12/]*)?", rest), out
    untriggered = {**tag, "triggers": ["<q"]}  # a trigger that starts no structure
    assert "trigger" in refused(server, "chat", "structural_tag", response_format=untriggered)
    bad = {**tag, "structures": [{"begin": "<n>", "schema": {"type": "nope"}, "end": "</n>"}]}
    # NOTE: compile errors name structured_outputs.structural_tag, the kind it maps to.
    assert "nope" in refused(server, "chat", "structural_tag", response_format=bad)
    assert "structures" in refused(
        server, "chat", "response_format", response_format={"type": "structural_tag"}
    )


# ---------------------------------------------------------------- chat rendering

# Renders every message and tool field a template can read, so each shows in the prompt.
SHOW_ALL = (
    "{%- for m in messages %}[{{ m.role }}|{{ m.name }}|{{ m.content }}|{{ m.tool_call_id }}|"
    "{{ m.reasoning_content }}|{%- for tc in m.tool_calls or [] %}{{ tc.id }}:{{ tc.type }}:"
    "{{ tc.function.name }}:{{ tc.function.arguments | tojson }}{%- endfor %}]{%- endfor %}"
    "{%- for t in tools or [] %}<{{ t.type }}:{{ t.function.name }}:{{ t.function.description }}:"
    "{{ t.function.parameters | tojson }}:{{ t.function.strict }}>{%- endfor %}"
    "{%- for d in documents or [] %}{{ d | tojson }}{%- endfor %}{{ flavour }}"
    "{%- if add_generation_prompt %}GO{%- endif %}"
)
TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Now.",
        "parameters": {"type": "object", "properties": {}},
        "strict": True,
    },
}
HISTORY = [
    {
        "role": "system",
        "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}],
    },
    {"role": "user", "name": "alice", "content": "what time"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "thinking it over",
        "tool_calls": [
            {
                "id": "call-7",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call-7", "content": "noon"},
]


def rendered(srv: ServerProcess, **fields) -> str:
    """The prompt a chat request renders (its prompt_token_ids, decoded)."""
    payload = {
        "messages": HISTORY,
        "chat_template": SHOW_ALL,
        "max_tokens": 1,
        "return_token_ids": True,
        **fields,
    }
    r = post(srv, "chat", payload)
    assert r.status_code == 200, r.text
    ids = r.json()["prompt_token_ids"]
    return httpx.post(srv.url + "/detokenize", json={"tokens": ids}).json()["prompt"]


def test_message_and_tool_fields_reach_the_template(server):
    text = rendered(server)
    assert text.startswith("[system||part one\npart two|||]")  # content parts
    assert "[user|alice|what time|" in text  # role, name, content
    assert '|thinking it over|call-7:function:get_time:{"tz": "UTC"}]' in text  # arguments
    assert "[tool||noon|call-7|" in text  # tool_call_id
    assert text.endswith("GO") and "<" not in text  # add_generation_prompt; no tools yet
    # "reasoning" is vLLM's newer name for reasoning_content
    newer = [*HISTORY[:2], {**HISTORY[2], "reasoning_content": None, "reasoning": "newer name"}]
    assert "|newer name|call-7" in rendered(server, messages=newer)
    with_tools = rendered(server, tools=[TOOL], tool_choice="none")
    assert '<function:get_time:Now.:{"type": "object", "properties": {}}:True>' in with_tools
    docs = rendered(server, documents=[{"title": "T", "text": "D"}])
    assert '{"title": "T", "text": "D"}' in docs
    assert rendered(server, chat_template_kwargs={"flavour": "VANILLA"}).endswith("VANILLAGO")
    assert not rendered(server, add_generation_prompt=False).endswith("GO")


def test_chat_template_in_a_request_replaces_the_servers(server):
    template = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"
    text = rendered(server, messages=[{"role": "user", "content": "x"}], chat_template=template)
    assert text == "<<x>>"


def test_continue_final_message_leaves_the_last_message_open(server):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    payload = {"messages": messages, "max_tokens": 1, "return_token_ids": True}
    closed = full(server, "chat", **payload)["prompt_token_ids"]
    opened = full(
        server, "chat", continue_final_message=True, add_generation_prompt=False, **payload
    )["prompt_token_ids"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": opened}).json()["prompt"]
    assert text.endswith("assistant\nOnce") and len(opened) < len(closed)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{**TOOL, "type": "retrieval"}]}, "tools[0].type"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "other", "function": {"name": "get_time"}}},
            "tool_choice",
        ),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        (
            {
                "messages": [
                    {**HISTORY[2], "tool_calls": [{**HISTORY[2]["tool_calls"][0], "type": "other"}]}
                ]
            },
            "messages[0].tool_calls[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
    ],
)
def test_tool_and_part_types_other_than_function_and_text_are_refused(server, fields, param):
    refused(server, "chat", param, **fields)


# ---------------------------------------------------------------- completions only


def test_echo_suffix_best_of(server):
    assert gen(server, "completions", echo=True)["text"].startswith(PROMPT)
    assert not gen(server, "completions")["text"].startswith(PROMPT)
    refused(server, "completions", "suffix", suffix="The end.")
    refused(server, "completions", "best_of", best_of=2)
    assert len(full(server, "completions", best_of=2, n=2, seed=1, temperature=1)["choices"]) == 2


def test_prompt_as_text_ids_and_lists(server):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = gen(server, "completions")["ids"]
    assert gen(server, "completions", prompt=ids)["ids"] == by_text
    two = full(server, "completions", prompt=[PROMPT, "Other words"])["choices"]
    assert len(two) == 2 and two[0]["token_ids"] == by_text != two[1]["token_ids"]


# ---------------------------------------------------------------- /tokenize and /detokenize


def test_tokenize_and_detokenize_fields(server):
    def tokenize(**fields):
        r = httpx.post(server.url + "/tokenize", json=fields, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    ids = tokenize(prompt=PROMPT)["tokens"]
    strs = tokenize(prompt=PROMPT, return_token_strs=True)["token_strs"]
    assert len(strs) == len(ids) and strs[0] == "An"
    assert "token_strs" not in tokenize(prompt=PROMPT)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    with_prompt = tokenize(messages=msgs)["tokens"]
    without = tokenize(messages=msgs, add_generation_prompt=False)["tokens"]
    assert len(without) < len(with_prompt)
    opened = tokenize(messages=msgs, continue_final_message=True, add_generation_prompt=False)
    assert len(opened["tokens"]) < len(without)
    assert tokenize(messages=msgs, chat_template_kwargs={"x": 1})["tokens"] == with_prompt
    name = httpx.get(server.base_url + "/models").json()["data"][0]["id"]
    assert tokenize(prompt=PROMPT, model=name)["tokens"] == ids
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT, "model": "nope"})
    assert r.status_code == 404
    back = httpx.post(server.url + "/detokenize", json={"tokens": ids, "model": name}).json()
    assert back["prompt"] == PROMPT
    r = httpx.post(server.url + "/detokenize", json={"tokens": ids, "model": "nope"})
    assert r.status_code == 404
    r = httpx.post(server.url + "/detokenize", json={"tokens": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


# ---------------------------------------------------------------- a tokenizer with a BOS token


@pytest.fixture(scope="module")
def bos_server(tmp_path_factory):
    """The default model with --tokenizer: a copy of its tokenizer that adds a BOS token."""
    from trillm.testing.tiny_models import DEFAULT_MODEL_DIR

    folder = tmp_path_factory.mktemp("bos-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).write_bytes((DEFAULT_MODEL_DIR / name).read_bytes())
    spec = json.loads((folder / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}
    seq = {"Sequence": {"id": "A", "type_id": 0}}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, seq],
        "pair": [bos, seq, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}
        },
    }
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(bos_token="<|endoftext|>", add_bos_token=True)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    template = folder / "flavoured.jinja"  # the default template, plus a "flavour" kwarg
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{{ flavour }}{% endif %}"
    )
    log = tmp_path_factory.mktemp("field-effects-bos") / "server.log"
    srv = ServerProcess(
        [
            "--tokenizer",
            str(folder),
            "--max-model-len",
            "256",
            "--kv-cache-memory",
            "16MiB",
            "--log-level",
            "debug",
            "--chat-template",
            str(template),
            "--scheduling-policy",
            "priority",
        ],
        log,
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def test_add_special_tokens_and_the_tokenizer_flag(bos_server, server):
    def tokens(srv, **fields):
        payload = {"prompt": PROMPT, **fields}
        return httpx.post(srv.url + "/tokenize", json=payload).json()["tokens"]

    plain = tokens(server)
    assert tokens(bos_server) == [0, *plain]  # --tokenizer: the BOS-adding copy is used
    assert tokens(bos_server, add_special_tokens=False) == plain
    out = full(bos_server, "completions")
    assert out["choices"][0]["prompt_token_ids"] == [0, *plain]
    bare = full(bos_server, "completions", add_special_tokens=False)
    assert bare["choices"][0]["prompt_token_ids"] == plain
    # /tokenize with messages: the template writes the special tokens; true adds BOS on top
    msgs = {"messages": [{"role": "user", "content": "hi"}]}
    chat = httpx.post(bos_server.url + "/tokenize", json=msgs).json()["tokens"]
    assert chat[0] != 0
    assert tokens(bos_server, prompt=None, add_special_tokens=True, **msgs) == [0, *chat]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_disable_any_whitespace(server, endpoint):
    def canonical(text: str) -> bool:  # xgrammar's fixed separators (", ", ": ") and no more
        try:
            return text == json.dumps(json.loads(text))
        except ValueError:
            return False

    def text(**options) -> str:
        so = {"json": DIGIT, **options}
        return gen(server, endpoint, max_tokens=24, logit_bias={"223": 8}, structured_outputs=so)[
            "text"
        ]  # 223: " ", favoured

    assert not canonical(text())
    assert canonical(text(disable_any_whitespace=True))


def test_server_chat_template_and_its_kwargs(bos_server):
    """--chat-template replaces the model's template; chat_template_kwargs reach it (chat
    completions and /tokenize)."""
    msgs = [{"role": "user", "content": "hi"}]

    def prompt(path: str, **fields) -> str:
        payload = {"messages": msgs, **fields}
        if path == "/tokenize":
            ids = httpx.post(bos_server.url + path, json=payload).json()["tokens"]
        else:
            payload.update(max_tokens=1, return_token_ids=True)
            ids = httpx.post(bos_server.url + path, json=payload).json()["prompt_token_ids"]
        return httpx.post(bos_server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]

    for path in ("/tokenize", "/v1/chat/completions"):
        plain = prompt(path)
        assert plain.endswith("<|im_start|>assistant\n")
        flavoured = prompt(path, chat_template_kwargs={"flavour": "VANILLA"})
        assert flavoured == plain + "VANILLA"


def test_log_level_and_request_chat_templates(bos_server, server):
    """--log-level debug logs every request (the access log); without
    --trust-request-chat-template a request's chat_template is refused."""
    message = refused(bos_server, "chat", "chat_template", chat_template="{{ 1 }}")
    assert "--trust-request-chat-template" in message
    assert '"POST /v1/chat/completions' in bos_server.log()
    assert '"POST /v1/chat/completions' not in server.log()


@pytest.fixture(scope="module")
def wordpiece_server(tmp_path_factory):
    """The default model with a WordPiece tokenizer: a decoder that spaces its tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[UNK]")
    tok.add_special_tokens({"additional_special_tokens": ["[A]", "[B]"]})
    folder = tmp_path_factory.mktemp("wordpiece")
    tok.save_pretrained(str(folder))
    (folder / "chat.jinja").write_text("{% for m in messages %}{{ m.content }} {% endfor %}")
    log = tmp_path_factory.mktemp("field-effects-wordpiece") / "server.log"
    srv = ServerProcess(
        [
            "--tokenizer",
            str(folder),
            "--max-model-len",
            "128",
            "--kv-cache-memory",
            "16MiB",
            "--chat-template",
            str(folder / "chat.jinja"),
        ],
        log,
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_spaces_between_special_tokens(wordpiece_server, endpoint):
    fields = {
        "allowed_token_ids": [3, 4],
        "temperature": 1.0,
        "seed": 2,
        "ignore_eos": True,
        "max_tokens": 6,
        "skip_special_tokens": False,
    }
    if endpoint == "completions":
        fields["prompt"] = "hello"
    else:
        fields["messages"] = [{"role": "user", "content": "hello"}]
    spaced = gen(wordpiece_server, endpoint, **fields)
    assert re.fullmatch(r" \[[AB]\]( \[[AB]\]){5}", spaced["text"]), spaced
    tight = gen(wordpiece_server, endpoint, spaces_between_special_tokens=False, **fields)
    assert tight["ids"] == spaced["ids"] and tight["text"] == spaced["text"].replace("] [", "][")
