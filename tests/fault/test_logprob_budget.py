"""The per-request logprob budget (``--max-logprob-entries``, issue 33 item 6) on a real
``trillm serve``: a request whose prompts x prompt tokens x (prompt_logprobs + 1) (in each of
its n choices) plus n x max_tokens x (logprobs + 1) pass the budget is a 400 naming it before
anything reaches the engine; a large answer within it is serialized a slice at a time between
event-loop checkpoints (each prompt's once, shared by its n choices), so /health is answered
meanwhile.

Fake runner (it reports prompt logprobs as the real runner does, at no model cost), tiny
llama tokenizer, --max-model-len 2048: the default budget is 2**20 entries. Before the budget,
256 prompts x 2,000 tokens x 21 took +3.76 GiB RSS and 346 s.
"""

from __future__ import annotations

import time

import httpx
import pytest
from server_harness import ServerProcess, fake_llama_args, gauges, post_polling_health, rss_mib

BUDGET = 1 << 20


@pytest.fixture(scope="module")
def server(tiny_model_factory, tmp_path_factory):
    log = tmp_path_factory.mktemp("logprob-budget") / "server.log"
    srv = ServerProcess(
        fake_llama_args(tiny_model_factory("llama")),
        log,
    ).start()
    yield srv
    srv.stop()


def token_prompts(count: int, length: int) -> list[list[int]]:
    return [[(i * 7 + j) % 1000 + 5 for j in range(length)] for i in range(count)]


@pytest.mark.parametrize(
    ("path", "body", "param", "entries"),
    [
        # The attack: 256 prompts x 2,000 tokens x 21, each field within its limit.
        (
            "/v1/completions",
            {"prompt": token_prompts(256, 2000), "max_tokens": 1, "prompt_logprobs": 20},
            "prompt_logprobs",
            1_050_000,
        ),
        # Sample logprobs: 2 prompts x n 16 x 2,000 tokens x 21.
        (
            "/v1/completions",
            {"prompt": token_prompts(2, 10), "n": 16, "max_tokens": 2000, "logprobs": 20},
            "logprobs",
            1_344_000,
        ),
        # Each completion choice repeats its prompt's logprobs: 1 prompt x n 64 x 1,000 x 21.
        (
            "/v1/completions",
            {"prompt": token_prompts(1, 1000), "n": 64, "max_tokens": 1, "prompt_logprobs": 20},
            "prompt_logprobs",
            1_344_000,
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "n": 32,
                "max_tokens": 1900,
                "logprobs": True,
                "top_logprobs": 20,
            },
            "top_logprobs",
            1_276_800,
        ),
    ],
)
def test_over_the_budget_is_refused_at_once_naming_it(server, path, body, param, entries):
    rss = rss_mib(server.proc.pid)
    start = time.monotonic()
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text[:300]
    assert time.monotonic() - start < 10
    err = r.json()["error"]
    assert err["param"] == param
    assert "--max-logprob-entries" in err["message"] and str(BUDGET) in err["message"]
    assert f"at least {entries} logprob entries" in err["message"]
    assert gauges(server) == (0, 0)  # nothing reached the engine
    assert rss_mib(server.proc.pid) - rss < 100


def test_a_large_allowed_answer_leaves_health_responsive(server):
    # 2,000 prompt tokens x 21, in each of 24 choices: 1,008,000 entries (~43 MB of JSON).
    body = {"prompt": token_prompts(1, 2000), "n": 24, "max_tokens": 1, "prompt_logprobs": 20}
    r, seconds, worst = post_polling_health(server, "/v1/completions", body)
    assert r.status_code == 200, r.text[:300]
    choices = r.json()["choices"]
    assert len(choices) == 24
    for c in choices:
        plp = c["prompt_logprobs"]
        assert len(plp) == 2000 and plp[0] is None
        assert plp == choices[0]["prompt_logprobs"]  # one prompt, one value
        assert all(len(entry) >= 20 for entry in plp[1:])
    # Before: the whole answer was built as dicts (24 copies) and serialized in one block.
    assert worst < 0.3 * seconds, (worst, seconds)


def test_the_flags_are_parsed_and_validated(capsys):
    from trillm.entrypoints.cli.main import build_parser
    from trillm.entrypoints.cli.serve_args import server_options
    from trillm.entrypoints.openai.endpoints.budgets import default_max_logprob_entries

    def options(*flags: str):
        return server_options(build_parser().parse_args(["serve", *flags]))

    default = options()
    assert default.max_logprob_entries is None  # from the model: see below
    assert default.max_sequences_per_request == 1024
    set_ = options("--max-logprob-entries", "5000", "--max-sequences-per-request", "4")
    assert (set_.max_logprob_entries, set_.max_sequences_per_request) == (5000, 4)
    for flag in ("--max-logprob-entries", "--max-sequences-per-request"):
        for bad in ("0", "-1", "1.5", "many"):
            with pytest.raises(SystemExit):
                build_parser().parse_args(["serve", flag, bad])
            assert flag[2:] in capsys.readouterr().err
    # One full-context sequence at the largest logprobs always fits the default.
    assert default_max_logprob_entries(2048, 20) == BUDGET
    assert default_max_logprob_entries(131072, 20) == 131072 * 21
