"""Server pieces without a server: request structuring, chat templates, CLI flags, OpenAPI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trillm.engine.chat_template import (
    ChatTemplateError,
    load_chat_template,
    render_template,
    tokenizer_chat_template,
    tokenizer_special_tokens,
)
from trillm.entrypoints.cli.main import build_parser
from trillm.entrypoints.cli.serve_args import engine_kwargs, server_options
from trillm.entrypoints.openai.http.errors import BadRequestError
from trillm.entrypoints.openai.schemas.protocol import ChatCompletionRequest, CompletionRequest
from trillm.entrypoints.openai.schemas.structuring import structure

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


# ---------------------------------------------------------------- protocol


def test_structure_accepts_unknown_fields_and_unions():
    req = structure(
        ChatCompletionRequest,
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
            "stop": "x",
            "temperature": 1,
            "tools": [],
            "metadata": {"k": "v"},
        },
    )
    assert req.stop == "x" and req.temperature == 1.0 and isinstance(req.temperature, float)
    assert req.messages[0].content[0].text == "a"
    prompts = structure(CompletionRequest, {"prompt": [[1, 2], [3]]}).prompt
    assert prompts == [[1, 2], [3]]
    assert structure(CompletionRequest, {"prompt": [5, 6]}).prompt == [5, 6]
    assert structure(CompletionRequest, {"prompt": "p"}).max_tokens == 16


@pytest.mark.parametrize(
    "body,param,fragment",
    [
        ({"messages": [], "n": True}, "n", "must be an integer"),
        ({"messages": [], "temperature": "1"}, "temperature", "must be a number"),
        ({"messages": [], "top_p": 0}, "top_p", "must be > 0"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "got 3"),
        ({"messages": [], "stream_options": []}, "stream_options", "must be an object"),
        ({"messages": None}, "messages", "must be an array, got None"),
        ({}, "messages", "Field required"),
    ],
)
def test_structure_names_the_bad_field(body, param, fragment):
    with pytest.raises(BadRequestError) as info:
        structure(ChatCompletionRequest, body)
    assert info.value.param == param
    assert fragment in info.value.message


# ---------------------------------------------------------------- chat templates


def test_render_template_and_text_parts():
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    assert render_template(TEMPLATE, messages) == "<system>s</system><user>a\nb</user><assistant>"
    assert render_template(TEMPLATE, messages, add_generation_prompt=False).endswith("</user>")


def test_continue_final_message_drops_the_closing_tokens():
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The ans"}]
    text = render_template(
        TEMPLATE, messages, add_generation_prompt=False, continue_final_message=True
    )
    assert text == "<user>q</user><assistant>The ans"
    with pytest.raises(ChatTemplateError):
        render_template(
            TEMPLATE, messages[:1], add_generation_prompt=False, continue_final_message=True
        )


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.append(1) }}",  # immutable sandbox: no mutation of the inputs
        "{{ raise_exception('nope') }}",
        "{% for %}",
    ],
)
def test_hostile_or_broken_templates_are_refused(template):
    with pytest.raises(ChatTemplateError):
        render_template(template, [{"role": "user", "content": "x"}])


def test_non_text_parts_are_refused():
    with pytest.raises(ChatTemplateError) as info:
        render_template(TEMPLATE, [{"role": "user", "content": [{"type": "image_url"}]}])
    assert info.value.param == "messages[0].content[0].type"


def test_render_chat_with_the_tokenizer_template(tmp_path):
    """The pieces ``Preprocessor.render_chat`` renders with: the tokenizer's template and
    special tokens, or a ``--chat-template`` file's text."""
    from transformers import AutoTokenizer

    from trillm.testing.tiny_models import DEFAULT_MODEL_DIR

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    messages = [{"role": "user", "content": "hi"}]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    special = tokenizer_special_tokens(tok)
    rendered = render_template(tokenizer_chat_template(tok), messages, special_tokens=special)
    assert rendered == expected
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    own = load_chat_template(str(path))
    assert own == TEMPLATE
    assert render_template(own, messages, special_tokens=special) == "<user>hi</user><assistant>"
    with pytest.raises(ChatTemplateError):
        load_chat_template("no-such-file-and-no-jinja")


# ---------------------------------------------------------------- CLI


def test_serve_flags_map_to_engine_args():
    from trillm.config import EngineArgs

    args = build_parser().parse_args(
        [
            "serve",
            "/m",
            "--port",
            "9001",
            "--served-model-name",
            "a",
            "b",
            "--dtype",
            "float32",
            "--max-model-len",
            "128",
            "--kv-cache-memory",
            "2GiB",
            "--no-enable-prefix-caching",
            "--scheduling-policy",
            "priority",
            "-tp",
            "1",
            "--max-logprobs",
            "5",
            "--log-level",
            "warning",
            "--shutdown-timeout",
            "4",
            "--trust-request-chat-template",
            "--attention-backend",
            "torch",
            "--generation-config",
            "vllm",
            "--seed",
            "3",
        ],
    )
    kwargs = engine_kwargs(args)
    assert kwargs == {
        "dtype": "float32",
        "seed": 3,
        "max_model_len": 128,
        "kv_cache_memory": 2 << 30,
        "enable_prefix_caching": False,
        "scheduling_policy": "priority",
        "tensor_parallel_size": 1,
        "max_logprobs": 5,
        "attention_backend": "torch",
        "generation_config": "vllm",
        "served_model_name": "a",
    }
    EngineArgs.from_kwargs(args.model_tag, **kwargs)  # every name is an EngineArgs field
    opts = server_options(args)
    assert (opts.port, opts.served_model_names, opts.log_level) == (9001, ["a", "b"], "warning")
    assert opts.trust_request_chat_template and opts.shutdown_timeout == 4.0
    defaults = build_parser().parse_args(["serve"])
    # Only flags given reach EngineArgs: its defaults are the only ones (the server's too).
    assert defaults.model_tag is None and engine_kwargs(defaults) == {}
    assert server_options(defaults).max_logprobs == 20


def test_flags_for_what_is_not_implemented_are_refused(capsys):
    from trillm.config import EngineArgs

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "-tp", "0"])
    assert exit_info.value.code == 2
    assert "--tensor-parallel-size/-tp: expected an integer >= 1" in capsys.readouterr().err
    for kwargs, words in (
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1"),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, "needs distributed"),
    ):
        with pytest.raises(ValueError, match=words):
            EngineArgs.from_kwargs(None, **kwargs)


def test_stream_wake_budget_flag():
    from trillm.engine.output_processor import DEFAULT_WAKE_BUDGET

    def budget(*flags: str) -> int | None:
        return server_options(build_parser().parse_args(["serve", *flags])).stream_wake_budget

    assert budget() == DEFAULT_WAKE_BUDGET
    assert budget("--stream-wake-budget", "8") == 8
    assert budget("--stream-wake-budget", "0") is None  # no budget


def test_bad_memory_size_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-memory", "lots"])
    assert "kv-cache-memory" in capsys.readouterr().err


def test_serve_help_documents_the_flags():
    out = subprocess.run(
        [sys.executable, "-m", "trillm", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for flag in (
        "--host",
        "--port",
        "--served-model-name",
        "--dtype",
        "--seed",
        "--max-model-len",
        "--block-size",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--scheduling-policy",
        "--tensor-parallel-size",
        "--api-key",
        "--chat-template",
        "--generation-config",
        "--max-logprobs",
        "--kv-cache-memory",
        "--gpu-memory-utilization",
        "--uvicorn-log-level",
        "--log-level",
        "--shutdown-timeout",
        "--trust-request-chat-template",
        "--attention-backend",
    ):
        assert flag in out, flag


def test_openapi_spec_is_valid():
    from openapi_spec_validator import validate

    from trillm.entrypoints.openai.schemas.openapi import build_spec

    spec = build_spec()
    validate(spec)
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["required"] == ["messages"]
    assert chat["properties"]["n"]["minimum"] == 1 and chat["properties"]["n"]["maximum"] == 128


# ---------------------------------------------------------------- sampling parameters


def _params_state(generation_config):
    """What build_sampling_params reads: the model config and the logprob cap."""
    from types import SimpleNamespace

    from trillm.worker.fake_runner import make_fake_config

    model_config = make_fake_config(max_model_len=100).model
    model_config.generation_config = generation_config
    return SimpleNamespace(model_config=model_config, max_logprobs=20)


def test_generation_config_gives_defaults_the_request_overrides():
    from types import SimpleNamespace

    from trillm.engine.preprocess import Preprocessor
    from trillm.entrypoints.openai.endpoints.sampling import build_sampling_params
    from trillm.worker.fake_runner import make_fake_config

    def resolve_max_tokens(state, requested, prompt_len):
        config = make_fake_config(max_model_len=100)
        config.model.generation_config = state.model_config.generation_config
        tokenizer = SimpleNamespace(eos_token_id=None)  # all a text model's Preprocessor reads
        return Preprocessor(config, tokenizer, 100).resolve_max_tokens(prompt_len, requested)

    state = _params_state({"temperature": 0.3, "top_k": 5, "top_p": 0.9, "max_new_tokens": 7})
    req = structure(ChatCompletionRequest, {"messages": []})
    params = build_sampling_params(state, req, max_tokens=4, logprobs=None)
    assert (params.temperature, params.top_k, params.top_p) == (0.3, 5, 0.9)
    assert resolve_max_tokens(state, None, 10) == 7  # max_new_tokens, within the context
    assert resolve_max_tokens(state, 50, 10) == 50
    req = structure(ChatCompletionRequest, {"messages": [], "temperature": 1.0, "top_k": -1})
    params = build_sampling_params(state, req, max_tokens=4, logprobs=None)
    assert (params.temperature, params.top_k) == (1.0, 0)
    plain = _params_state({})
    params = build_sampling_params(
        plain, structure(ChatCompletionRequest, {"messages": []}), max_tokens=4, logprobs=None
    )
    assert params.temperature == 1.0
    assert resolve_max_tokens(plain, None, 30) == 70  # max_model_len - prompt


def test_response_format_maps_to_structured_outputs():
    from trillm.entrypoints.openai.endpoints.sampling import build_sampling_params

    state = _params_state({})

    def so(extra):
        req = structure(CompletionRequest, {"prompt": "p", **extra})
        return build_sampling_params(state, req, max_tokens=4, logprobs=None).structured_outputs

    assert so({}) is None
    assert so({"response_format": {"type": "text"}}) is None
    assert so({"response_format": {"type": "json_object"}}).json_object is True
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert so({"response_format": fmt}).json == schema
    assert so({"structured_outputs": {"regex": "[0-9]+"}}).regex == "[0-9]+"
    assert so({"structured_outputs": {"choice": ["yes", "no"]}}).choice == ["yes", "no"]


def test_internal_errors_name_no_internals(caplog):
    from trillm.entrypoints.openai.http.errors import from_engine_exception

    err = from_engine_exception(RuntimeError("/secret/path/model.safetensors is corrupt"))
    assert err.status == 500
    assert "secret" not in err.message and "RuntimeError" not in err.message
    reference = err.message.split("reference ")[1].rstrip(").")
    assert any(reference in r.getMessage() and "secret" in r.getMessage() for r in caplog.records)
