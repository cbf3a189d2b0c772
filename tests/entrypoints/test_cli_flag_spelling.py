"""vLLM's spelling of command-line flags, as its parser reads them: a flag's name with
underscores (``--max_model_len 5000``, vLLM's own tests start servers so) is the dashed flag,
also with ``=VALUE`` and before a dotted config key, whose keys stay as written."""

from __future__ import annotations

import pytest

from trillm.entrypoints.cli.main import build_parser, parse_command_line
from trillm.entrypoints.cli.serve_args import engine_kwargs


def _serve(*argv: str) -> dict:
    return engine_kwargs(parse_command_line(build_parser(), ["serve", "m", *argv]))


def test_underscored_flag_names_are_the_dashed_flags():
    dashed = _serve("--max-model-len", "5000", "--enable-prefix-caching")
    underscored = _serve("--max_model_len", "5000", "--enable_prefix_caching")
    assert underscored["max_model_len"] == dashed["max_model_len"] == 5000
    assert underscored == dashed
    assert _serve("--max_model_len=321")["max_model_len"] == 321


def test_dotted_keys_keep_their_spelling():
    got = _serve("--hf_overrides.text_config.rope_theta", "1e6")
    assert got["hf_overrides"] == {"text_config": {"rope_theta": 1e6}}
    got = _serve("--structured_outputs_config.disable_any_whitespace")
    assert got["structured_outputs_config"] == {"disable_any_whitespace": True}


def test_values_keep_their_underscores_and_unknown_flags_are_refused(capsys):
    args = parse_command_line(
        build_parser(),
        ["serve", "m", "--served_model_name", "my_model", "--hf_overrides", '{"a_b": 1}'],
    )
    assert args.served_model_name == ["my_model"]
    assert args.hf_overrides == {"a_b": 1}
    with pytest.raises(SystemExit):
        _serve("--no_such_flag", "1")
    assert "--no-such-flag" in capsys.readouterr().err


def test_nothing_after_a_double_dash_is_rewritten():
    """After ``--`` every token is positional, as written: not a flag name to dash, nor a
    dotted flag to fold (its value not taken either)."""
    argv = ["serve", "--max_model_len", "5", "--hf_overrides.a_b", "--", "--my_model.v_2"]
    args = parse_command_line(build_parser(), argv)
    assert args.model_tag == "--my_model.v_2"
    assert args.max_model_len == 5 and args.hf_overrides == {"a_b": True}
