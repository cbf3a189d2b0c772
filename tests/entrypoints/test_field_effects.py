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
from field_requests import (
    ENDPOINTS,
    EOS,
    PROMPT,
    body,
    chunk_text,
    full,
    gen,
    post,
    refused,
    stream_events,
)

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


def test_messages_report_prefix_cache_reads_as_anthropic_does(server):
    """With --enable-prompt-tokens-details (this server's), /v1/messages gives the prompt tokens
    read from the prefix cache as cache_read_input_tokens, out of input_tokens (vLLM's usage),
    in the answer and in the stream's message_delta; the official anthropic client reads it."""
    import anthropic  # (the official client, imported by the test that uses it)

    model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)
    long = " ".join(f"m{i}" for i in range(80))
    kw = dict(model=model, max_tokens=2, messages=[{"role": "user", "content": long}])
    cold = client.messages.create(**kw).usage
    # the prompt tokens it computed and wrote to the cache are cache_creation_input_tokens
    assert cold.cache_read_input_tokens == 0 and cold.cache_creation_input_tokens > 48
    prompt = cold.input_tokens + cold.cache_creation_input_tokens
    assert prompt > 60
    warm = client.messages.create(**kw).usage
    assert warm.cache_read_input_tokens > 0
    read, written = warm.cache_read_input_tokens, warm.cache_creation_input_tokens
    assert warm.input_tokens + read + written == prompt
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message().usage
    assert streamed.cache_read_input_tokens == warm.cache_read_input_tokens
    assert streamed.input_tokens == warm.input_tokens and streamed.output_tokens == 2


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
