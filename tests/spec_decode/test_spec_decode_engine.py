"""Speculative decoding (n-gram) end to end on real models: the same output with and without
it (greedy and seeded sampling, logprobs, max_tokens / stop tokens / stop strings, the
processors), through ``LLM`` on the embedded default model and tiny checkpoints of every
architecture, and over HTTP with vLLM's ``/metrics`` counters."""

from __future__ import annotations

import httpx
import pytest
from server_harness import ServerProcess, metric_value
from spec_compare import assert_same

from trillm import LLM, SamplingParams
from trillm.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
SMALL = {
    "max_model_len": 256,
    "kv_cache_memory": "16MiB",
    "distributed_executor_backend": "uni",
    "block_size": 8,
}
# Output that repeats its prompt: the default model continues the verse it has seen.
PROMPT = (
    "And God said, Let there be light: and there was light. And God saw the light, that "
    "it was good: and God divided the light from the darkness. And God said, Let there be"
)


@pytest.fixture(scope="module")
def pair():
    base = LLM(None, **SMALL)
    spec = LLM(None, speculative_config=NGRAM, **SMALL)
    yield base, spec
    base.shutdown()
    spec.shutdown()


def spec_stats(engine: LLM):
    return engine.engine.get_stats().spec_decoding


def both(pair, prompt: str = PROMPT, **fields):
    base, spec = pair
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 40, "ignore_eos": True, **fields})
    a = base.generate([prompt], params, use_tqdm=False)[0]
    b = spec.generate([prompt], params, use_tqdm=False)[0]
    return a, b


def accepted_during(engine: LLM, fn):
    before = spec_stats(engine).num_accepted_tokens
    result = fn()
    return result, spec_stats(engine).num_accepted_tokens - before


@pytest.mark.parametrize(
    "fields",
    [
        {"logprobs": 3},
        {"temperature": 0.8, "seed": 11, "logprobs": 2},
        {"temperature": 1.0, "seed": 5, "top_k": 20, "top_p": 0.9, "n": 2},
        {"logit_bias": {223: 2.0, 14: -3.0}},
        {"allowed_token_ids": list(range(0, 400))},
    ],
    ids=["greedy-logprobs", "seeded", "seeded-topk-topp-n2", "logit_bias", "allowed_token_ids"],
)
def test_same_output_with_speculation_and_drafts_accepted(pair, fields):
    (a, b), accepted = accepted_during(pair[1], lambda: both(pair, **fields))
    assert_same(a, b)
    assert accepted > 0  # speculation really ran


def test_steps_that_verify_drafts_replay_as_step_programs(pair):
    """A verifying step (queries of 1 + drafts tokens, all with cached context) runs as a step
    program like a decode step: replays checked against the eager forward, none given up."""
    eager = LLM(None, speculative_config=NGRAM, enforce_eager=True, **SMALL)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
        want = eager.generate([PROMPT], params, use_tqdm=False)[0]
    finally:
        eager.shutdown()
    (_, got), accepted = accepted_during(pair[1], lambda: both(pair, logprobs=2))
    assert accepted > 0
    assert_same(want, got)
    programs = pair[1].engine.executors[0].runner.step_programs
    assert programs is not None and programs.reason is None
    verify = [t for t, p in programs.programs.items() if False in p.checked]
    assert verify, "no verifying step replayed"


def test_cut_at_max_tokens_stop_token_and_stop_string_exactly(pair):
    ref, _ = both(pair, max_tokens=60)
    tokens, text = ref.outputs[0].token_ids, ref.outputs[0].text
    for fields in (
        {"max_tokens": 7},
        {"stop_token_ids": [tokens[23]], "ignore_eos": False},
        {"stop": [text[40:46]]},
        {"stop": [text[40:46]], "include_stop_str_in_output": True},
    ):
        a, b = both(pair, **{"max_tokens": 60, **fields})
        assert_same(a, b)
        assert len(a.outputs[0].token_ids) < 60


@pytest.mark.parametrize(
    "fields",
    [
        {"presence_penalty": 1.5},
        {"frequency_penalty": 1.0},
        {"repetition_penalty": 1.3},
        {"min_tokens": 30, "ignore_eos": False, "stop_token_ids": [14]},
        {"bad_words": ["light"]},
        {"structured_outputs": StructuredOutputsParams(regex="(light ){3,12}")},
    ],
    ids=["presence", "frequency", "repetition", "min_tokens", "bad_words", "structured"],
)
def test_history_dependent_sampling_is_exact_without_drafts(pair, fields):
    """Penalties, bad words, min_tokens and grammars depend on the tokens before each
    position: such requests get no drafts (exact, one token a step)."""
    before = spec_stats(pair[1]).num_drafts
    a, b = both(pair, **fields)
    assert_same(a, b)
    if "min_tokens" not in fields:
        assert spec_stats(pair[1]).num_drafts == before
    else:  # drafts start once min_tokens are out
        assert len(b.outputs[0].token_ids) >= 30


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_every_architecture_same_greedy_and_seeded_output(tiny_model_factory, arch):
    path = tiny_model_factory(arch)
    kw = {"max_model_len": 256, "kv_cache_memory": "8MiB", "distributed_executor_backend": "uni"}
    base = LLM(path, **kw)
    spec = LLM(path, speculative_config=NGRAM, **kw)
    try:
        prompts = ["a b c d a b c d a b c", "The license grants the license grants the"]
        for params in (
            SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=1),
            SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True),
        ):
            for x, y in zip(
                base.generate(prompts, params, use_tqdm=False),
                spec.generate(prompts, params, use_tqdm=False),
            ):
                assert_same(x, y)
        assert spec_stats(spec).num_drafts > 0
    finally:
        base.shutdown()
        spec.shutdown()


# ---------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import json

    log = tmp_path_factory.mktemp("spec-http") / "server.log"
    args = [
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "16MiB",
        "--block-size",
        "8",
        "--speculative-config",
        json.dumps(NGRAM),
        "--disable-log-stats",
    ]
    srv = ServerProcess(args, log).start()
    yield srv
    assert srv.stop() == 0, srv.log()


def test_http_same_greedy_text_and_metrics_count(server, pair):
    base = pair[0]
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    r = httpx.post(server.base_url + "/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ref = base.generate(
        [PROMPT],
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2),
        use_tqdm=False,
    )[0].outputs[0]
    assert choice["text"] == ref.text
    ref_lps = [d[t].logprob for d, t in zip(ref.logprobs, ref.token_ids)]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(ref_lps, abs=1e-4)
    page = httpx.get(server.url + "/metrics").text
    drafts = metric_value(page, "vllm:spec_decode_num_drafts_total")
    draft_tokens = metric_value(page, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric_value(page, "vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= draft_tokens <= 4 * drafts
    per_pos = accepted_per_position(page)
    assert sorted(per_pos) == [0, 1, 2, 3]
    counts = [per_pos[i] for i in range(4)]
    assert sum(counts) == accepted and counts == sorted(counts, reverse=True)
    assert metric_value(page, "trillm:spec_decode_num_accepted_tokens_total") == accepted


def accepted_per_position(page: str) -> dict[int, float]:
    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total{"
    found = {}
    for line in page.splitlines():
        if line.startswith(name):
            labels, value = line[len(name) :].rsplit("} ", 1)
            pos = next(
                p.split("=")[1].strip('"') for p in labels.split(",") if p.startswith("position=")
            )
            found[int(pos)] = float(value)
    return found
