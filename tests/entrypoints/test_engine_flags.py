"""The engine flags, one per EngineArgs field, from its ``flag(...)`` metadata: ``trillm
serve`` and ``trillm bench latency|throughput`` have the same ones, a flag refuses what its
field cannot take (argparse's usage error naming it), and flags -> EngineArgs equals the
EngineArgs built directly, with EngineArgs' own defaults for every flag not given."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Literal, get_args, get_origin

import pytest

from trillm.bench.engine_args import engine_args_from_namespace
from trillm.config import EngineArgs, FlagValue
from trillm.entrypoints.cli import engine_flags
from trillm.entrypoints.cli.flag_types import ENGINE_VALUES
from trillm.entrypoints.cli.main import build_parser
from trillm.entrypoints.cli.serve_args import engine_kwargs

COMMANDS = (["serve"], ["bench", "latency"], ["bench", "throughput"])


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _subparser(command: list[str]) -> argparse.ArgumentParser:
    parser = build_parser()
    for word in command:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser


def _engine_args(command: list[str], argv: list[str]) -> EngineArgs:
    args = build_parser().parse_args([*command, *argv])
    if command == ["serve"]:
        return EngineArgs.from_kwargs(args.model_opt or args.model_tag, **engine_kwargs(args))
    return engine_args_from_namespace(args)


def test_every_field_is_a_flag_of_each_command_or_says_why_not():
    for command in COMMANDS:
        options = _subparser(command)._option_string_actions
        for f in fields(EngineArgs):
            why = f.metadata.get("not_a_flag")
            if why is not None:
                assert "flag" not in f.metadata and isinstance(why, str) and why, f.name
                continue
            assert "flag" in f.metadata, f"EngineArgs.{f.name}: flag(...) or not_a_flag(..., why)"
            action = options.get(_flag(f.name))
            assert action is not None and action.dest == f.name, (command, f.name)


def test_every_named_value_parser_exists():
    assert set(ENGINE_VALUES) == set(get_args(FlagValue))


LITERAL_FIELDS = [
    f.name
    for f, _ in engine_flags.flag_fields()
    if get_origin(engine_flags._flag_type(f.name)) is Literal
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@pytest.mark.parametrize("name", LITERAL_FIELDS)
def test_a_literal_flag_refuses_a_value_outside_it(command, name, capsys):
    assert {"device", "attention_backend", "load_format", "kv_cache_dtype", "convert"} <= set(
        LITERAL_FIELDS
    )
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*command, _flag(name), "no-such-value"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {_flag(name)}" in err and "no-such-value" in err, err


# A value each named parser refuses, and words of its message.
BAD_VALUES: dict[str, tuple[str, str]] = {
    "positive_int": ("0", "expected an integer >= 1"),
    "non_negative_int": ("-1", "expected an integer >= 0"),
    "positive_seconds": ("0", "must be a positive number of seconds"),
    "memory_size": ("lots", "Cannot parse memory size"),
    "grammar_cache_bytes": ("0", "must be a size > 0"),
    "json_object": ("[1]", "must be a JSON object"),
    "quantization": ("awq_marlin", "not implemented yet"),
    "kv_cache_dtype": ("fp8_e5m2", "not implemented yet"),
    "load_format": ("pt", "not implemented yet"),
    "speculative_config": ('{"method": "medusa"}', "not implemented yet"),
    "limit_mm_per_prompt": ('{"video": -1}', "integer >= 0"),
    "host": ("https://example.com/", "is not a host name"),
    "class_name": ("not a class", "is not a class name"),
}


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@pytest.mark.parametrize(
    "name", [f.name for f, spec in engine_flags.flag_fields() if spec.value is not None]
)
def test_a_parsed_flag_refuses_a_bad_value_naming_the_flag(command, name, capsys):
    spec = next(s for f, s in engine_flags.flag_fields() if f.name == name)
    assert spec.value is not None
    bad, words = BAD_VALUES[spec.value]
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*command, _flag(name), bad])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {_flag(name)}" in err and words in err, err


# One sample of every kind of flag, and the EngineArgs it stands for.
SAMPLES = [
    (["--max-num-seqs", "4", "-tp", "1"], {"max_num_seqs": 4, "tensor_parallel_size": 1}),
    (["--gpu-memory-utilization", "0.5"], {"gpu_memory_utilization": 0.5}),
    (
        ["--enforce-eager", "--no-enable-prefix-caching"],
        {"enforce_eager": True, "enable_prefix_caching": False},
    ),
    (["--no-trust-remote-code"], {"trust_remote_code": False}),
    (
        ["--device", "cpu", "--numerics", "transformers"],
        {"device": "cpu", "numerics": "transformers"},
    ),
    (["--kv-cache-memory", "2GiB"], {"kv_cache_memory": 2 << 30}),
    (["--structured-outputs-cache-bytes", "64MiB"], {"structured_outputs_cache_bytes": 64 << 20}),
    (
        ["--convert", "embed", "--pooler-config", '{"pooling_type": "MEAN"}'],
        {"convert": "embed", "pooler_config": {"pooling_type": "MEAN"}},
    ),
    (
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    ),
    (["--limit-mm-per-prompt", '{"image": 2}'], {"limit_mm_per_prompt": {"image": 2}}),
    (
        ["--allowed-local-media-path", "/tmp", "--allowed-media-domains", "a.org", "B.org"],
        {"allowed_local_media_path": "/tmp", "allowed_media_domains": ["a.org", "b.org"]},
    ),
    (
        ["--mm-processor-kwargs", '{"do_normalize": false}'],
        {"mm_processor_kwargs": {"do_normalize": False}},
    ),
    (
        ["--served-model-name", "a", "b", "--dtype", "float32"],
        {"served_model_name": "a", "dtype": "float32"},
    ),
    (
        ["--master-port", "29501", "--distributed-timeout-seconds", "9.5"],
        {"master_port": 29501, "distributed_timeout_seconds": 9.5},
    ),
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@pytest.mark.parametrize(("argv", "kwargs"), SAMPLES, ids=lambda v: str(v)[:40])
def test_flags_make_the_engine_args_built_directly(command, argv, kwargs):
    assert _engine_args(command, ["/m", *argv]) == EngineArgs(model="/m", **kwargs)


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_flags_not_given_stay_none_and_engine_args_keeps_its_defaults(command):
    args = build_parser().parse_args(command)
    for f, _ in engine_flags.flag_fields():
        assert getattr(args, f.name) is None, f.name
    assert engine_flags.engine_kwargs(args) == {}
    assert _engine_args(command, []) == EngineArgs()


def test_skip_tokenizer_init_flag_reaches_the_engine_args():
    args = build_parser().parse_args(["serve", "--skip-tokenizer-init"])
    assert engine_kwargs(args) == {"skip_tokenizer_init": True}
    assert EngineArgs.from_kwargs(None, **engine_kwargs(args)).skip_tokenizer_init
