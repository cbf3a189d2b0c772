"""Request fields over HTTP that reach the chat template and the tokenizer, each shown to change
what happens (or refused with a 400 naming it): message and tool fields, request and server
chat templates, completions-only fields, /tokenize and /detokenize, a tokenizer with a BOS
token (and the priority policy its server runs), a WordPiece tokenizer. The sampling,
request-handling and structured-output fields are in test_field_effects.py; both take the
same ``server`` (tests/entrypoints/conftest.py)."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from field_requests import (
    ENDPOINTS,
    PROMPT,
    full,
    gen,
    post,
    refused,
)
from server_harness import ServerProcess


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_priority_needs_the_priority_policy(server, bos_server, endpoint):
    assert gen(server, endpoint, priority=0)["ids"]
    message = refused(server, endpoint, "priority", priority=1)
    assert "scheduling-policy priority" in message
    # --scheduling-policy priority: taken (the order it gives: tests/core/test_scheduler.py)
    assert gen(bos_server, endpoint, priority=-5)["ids"]


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
    assert tokenize(prompt=PROMPT)["token_strs"] is None  # vLLM: null unless asked
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
    # chat completions: the same, off by default (vLLM's)
    rendered = full(bos_server, "chat")["prompt_token_ids"]
    assert rendered[0] != 0
    with_bos = full(bos_server, "chat", add_special_tokens=True)["prompt_token_ids"]
    assert with_bos == [0, *rendered]


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
