"""vLLM's ``structured_outputs_config`` engine argument: every key honoured or refused, the
dotted flags (``--structured-outputs-config.backend xgrammar``) that set it, and its effects:
engine-wide whitespace / additionalProperties defaults, backends whose grammars trillm cannot
read refusing a grammar by name, ``enable_in_reasoning`` constraining from the first token,
and the reasoning parser (and its plugin) given through it."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from trillm import LLM, SamplingParams
from trillm.config import EngineArgs
from trillm.config.structured_outputs import parse_structured_outputs_config
from trillm.entrypoints.cli.dotted_flags import expand_dotted_flags
from trillm.entrypoints.cli.main import build_parser
from trillm.entrypoints.cli.serve_args import engine_kwargs
from trillm.sampling_params import StructuredOutputsParams as SO
from trillm.structured_output import GrammarCache, StructuredOutputManager, check_params
from trillm.structured_output.spec import StructuredOutputError

LIMITS = {"max_model_len": 128, "distributed_executor_backend": "uni"}


def _flags(*argv: str) -> dict:
    args = build_parser().parse_args(expand_dotted_flags(["serve", *argv]))
    return engine_kwargs(args)


def test_dotted_flags_fold_into_the_json_flag_and_win_over_it():
    assert _flags(
        "--structured-outputs-config.backend", "guidance",
        "--structured-outputs-config.disable-any-whitespace",
    )["structured_outputs_config"] == {"backend": "guidance", "disable_any_whitespace": True}  # fmt: skip
    merged = _flags(
        "--structured-outputs-config", '{"backend": "auto", "enable_in_reasoning": true}',
        "--structured-outputs-config.backend=xgrammar",
    )["structured_outputs_config"]  # fmt: skip
    assert merged == {"backend": "xgrammar", "enable_in_reasoning": True}
    nested = _flags("--hf-overrides.rope_parameters.rope_theta", "500000")["hf_overrides"]
    assert nested == {"rope_parameters": {"rope_theta": 500000}}


def test_a_dotted_flag_of_no_json_flag_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit):
        _flags("--no-such-config.key", "1")
    assert "--no-such-config" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({"backend": "lark"}, "backend 'lark'"),
        ({"no_such_key": 1}, "unknown key 'no_such_key'"),
        ({"disable_any_whitespace": "yes"}, "disable_any_whitespace must be a bool"),
        ({"reasoning_parser": 3}, "reasoning_parser must be a str"),
        ("xgrammar", "must be a JSON object"),
    ],
)
def test_bad_values_are_refused_by_name(value, named):
    with pytest.raises(ValueError, match=named):
        parse_structured_outputs_config(value)


def test_engine_wide_defaults_apply_as_if_the_request_set_them():
    config = parse_structured_outputs_config(
        {"disable_any_whitespace": True, "disable_additional_properties": True}
    )
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = check_params(SO(json=schema), config)
    assert spec.any_whitespace is False
    assert json.loads(spec.text)["additionalProperties"] is False
    plain = check_params(SO(json=schema))
    assert plain.any_whitespace is True and "additionalProperties" not in json.loads(plain.text)


@pytest.mark.parametrize("backend", ["guidance", "outlines", "lm-format-enforcer"])
def test_backends_with_other_grammar_syntaxes_refuse_a_grammar_but_serve_the_rest(backend):
    config = parse_structured_outputs_config({"backend": backend})
    with pytest.raises(StructuredOutputError, match=f"backend '{backend}'") as refused:
        check_params(SO(grammar='root ::= "a"'), config)
    assert refused.value.param == "structured_outputs.grammar"
    for so in (SO(regex="[ab]+"), SO(choice=["x"]), SO(json={"type": "string"})):
        check_params(so, config)
    check_params(SO(grammar='root ::= "a"'), parse_structured_outputs_config({"backend": "auto"}))


def test_through_the_engine_output_follows_the_backend_and_whitespace_settings(
    tiny_model_factory,
):
    """A grammar under backend 'guidance' is refused before it runs; a regex under it is
    honoured; disable_any_whitespace given engine-wide acts as the request field does."""
    model = tiny_model_factory("llama")
    params = SamplingParams(max_tokens=24, temperature=0)
    obj = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    with LLM(model, structured_outputs_config={"backend": "guidance"}, **LIMITS) as llm:
        with pytest.raises(ValueError, match="backend 'guidance'"):
            llm.generate(["x"], [_with(params, SO(grammar='root ::= "a"'))], use_tqdm=False)
        [out] = llm.generate(["x"], [_with(params, SO(regex="(ab)+"))], use_tqdm=False)
        assert out.outputs[0].text and set(out.outputs[0].text) <= {"a", "b"}
    compact = {"disable_any_whitespace": True}
    with LLM(model, structured_outputs_config=compact, **LIMITS) as llm:
        [engine_wide] = llm.generate(["x"], [_with(params, SO(json=obj))], use_tqdm=False)
    asked = SO(json=obj, disable_any_whitespace=True)
    with LLM(model, **LIMITS) as llm:
        [per_request] = llm.generate(["x"], [_with(params, asked)], use_tqdm=False)
    assert engine_wide.outputs[0].token_ids == per_request.outputs[0].token_ids
    json.loads(engine_wide.outputs[0].text)


def _with(params: SamplingParams, so: SO) -> SamplingParams:
    return SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, structured_outputs=so
    )


@pytest.fixture(scope="module")
def think_model(tiny_model_factory, tmp_path_factory):
    from transformers import AutoTokenizer

    from trillm.testing.reasoning_model import build_reasoning_model

    src = tiny_model_factory("qwen3", vocab_size=4112)
    out, start, end = build_reasoning_model(src, tmp_path_factory.mktemp("think") / "model")
    return str(out), AutoTokenizer.from_pretrained(str(out)), start, end


def test_enable_in_reasoning_constrains_from_the_first_token(think_model):
    """The default waits for </think>; with enable_in_reasoning the first row already holds
    only the grammar's tokens, and reasoning text is refused by the matcher."""
    _, tok, start, _ = think_model
    prompt = [*tok("q", add_special_tokens=False)["input_ids"], start]  # reasoning opened
    waiting = StructuredOutputManager(GrammarCache(tok, 4112, [2, 0]), "qwen3")
    config = parse_structured_outputs_config({"enable_in_reasoning": True})
    eager = StructuredOutputManager(GrammarCache(tok, 4112, [2, 0]), "qwen3", config)
    for mgr in (waiting, eager):
        if not mgr.add_request("r", SO(choice=["yes"]), prompt):
            while mgr.has_pending:  # compiling on the grammar thread
                time.sleep(0.005)
                assert not mgr.poll()[1]
    sched = SimpleNamespace(step_id=0, num_scheduled_tokens={"r": 1})
    assert list(waiting.fill_bitmask(sched, lambda r: True).bitmask) == []
    assert list(eager.fill_bitmask(sched, lambda r: True).bitmask) == ["r"]
    maybe = tok("maybe", add_special_tokens=False)["input_ids"]
    assert waiting.accept_tokens("r", maybe)[0] is True  # reasoning: free text
    assert eager.accept_tokens("r", maybe)[0] is False  # constrained from the start


def test_reasoning_parser_and_its_plugin_through_the_config(think_model, tmp_path):
    model = think_model[0]
    plugin = tmp_path / "my_reasoning.py"
    plugin.write_text(
        "from trillm.parsers.reasoning import Qwen3ReasoningParser, register_reasoning_parser\n"
        "register_reasoning_parser('my_think')(type('MyThink', (Qwen3ReasoningParser,), {}))\n"
    )
    given = {"reasoning_parser": "my_think", "reasoning_parser_plugin": str(plugin)}
    args = EngineArgs(model, structured_outputs_config=given)
    assert args.reasoning_parser == "my_think"
    with pytest.raises(ValueError, match="disagree"):
        EngineArgs(model, reasoning_parser="qwen3", structured_outputs_config=given)
    with pytest.raises(ValueError, match="reasoning_parser_plugin .* is not a file"):
        EngineArgs(model, structured_outputs_config={"reasoning_parser_plugin": "/no/such.py"})
