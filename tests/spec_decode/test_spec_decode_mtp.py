"""MTP speculation (``{"method": "mtp" | "deepseek_mtp"}``): DeepSeek-V3's multi-token-prediction
layer, shipped in the target's own checkpoint, drafts as an EAGLE head does (``mtp_checkpoint.py``
builds the tiny checkpoints; transformers ignores the layer).

A target damped to nearly a bigram model with a layer that predicts the bigram has drafts
accepted and rejected in one run; the undamped one has all accepted. The output must be the
target's alone, token for token with its logprobs (batched prompts of different lengths,
chunked prefill, preemption, seeded sampling). A random layer's drafts equal a dense reference
computed from the same weights (``mtp_reference.py``). What cannot be served is refused by name
before anything loads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from mtp_checkpoint import CASE, agreeing_pair, with_mtp_layer
from mtp_reference import reference_drafts
from server_harness import ServerProcess, metric_value
from spec_compare import PROMPTS, SMALL, assert_same, recorded_drafts, run, stats

from trillm import LLM, SamplingParams
from trillm.config import EngineArgs
from trillm.model_executor.model_config import load_model_config
from trillm.spec_decode.config import DraftModelError, parse_speculative_config
from trillm.spec_decode.mtp_config import build_mtp_config
from trillm.testing.tiny_deepseek import build_tiny_deepseek

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2)
K = 3
MTP = {"method": "mtp", "num_speculative_tokens": K}


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """A transformers-made DeepSeek-V3 (num_nextn_predict_layers 1, no MTP weights)."""
    return build_tiny_deepseek(CASE, tmp_path_factory.mktemp("mtp") / "plain")


@pytest.fixture(scope="module")
def pairs(plain) -> dict[str, Path]:
    """damped: drafts right part of the time; bigram: always right."""
    root = plain.parent
    return {
        "damped": agreeing_pair(plain, root / "damped", 0.01),
        "bigram": agreeing_pair(plain, root / "bigram", 0.0),
    }


@pytest.fixture(scope="module")
def base(pairs):
    """The targets without speculation (their MTP weights skipped at load)."""
    engines = {name: LLM(str(path), **SMALL) for name, path in pairs.items()}
    yield engines
    for engine in engines.values():
        engine.shutdown()


def test_greedy_and_seeded_output_is_the_targets_with_drafts_accepted_and_rejected(base, pairs):
    engine = LLM(str(pairs["damped"]), speculative_config=MTP, **SMALL)
    try:
        for x, y in zip(run(base["damped"], GREEDY), run(engine, GREEDY)):
            assert_same(x, y)
        s = stats(engine)
        assert 0 < s.num_accepted_tokens < s.num_draft_tokens  # both paths of the verifier ran
        seeded = SamplingParams(
            temperature=1.0, seed=7, top_k=50, max_tokens=20, ignore_eos=True, n=2, logprobs=1
        )
        for x, y in zip(run(base["damped"], seeded), run(engine, seeded)):
            assert_same(x, y)
    finally:
        engine.shutdown()


def test_an_agreeing_layer_is_accepted_k_drafts_at_a_time(base, pairs):
    """vLLM's deepseek_mtp name; k = 3 drafts from the one layer, each fed its own state."""
    spec = {**MTP, "method": "deepseek_mtp"}
    engine = LLM(str(pairs["bigram"]), speculative_config=spec, **SMALL)
    try:
        for x, y in zip(run(base["bigram"], GREEDY), run(engine, GREEDY)):
            assert_same(x, y)
        s = stats(engine)
        assert s.num_accepted_tokens == s.num_draft_tokens
        assert 1 + s.num_accepted_tokens / s.num_drafts > K + 0.5
    finally:
        engine.shutdown()


def test_chunked_prefill_and_preemption_keep_the_output(base, pairs):
    """A step budget below the prompts (the layer catches up chunk by chunk) and a cache too
    small for every request (preempted requests come back; their MTP cache is rewritten)."""
    tight = {**SMALL, "max_num_batched_tokens": 16, "num_gpu_blocks_override": 24}
    tight["max_model_len"] = 128
    engine = LLM(str(pairs["damped"]), speculative_config=MTP, **tight)
    try:
        prompts = [p * 3 for p in PROMPTS]  # 20-40 tokens each: several budget-sized chunks
        params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        for x, y in zip(run(base["damped"], params, prompts), run(engine, params, prompts)):
            assert_same(x, y)
        assert engine.engine.get_stats().num_preemptions > 0
        assert stats(engine).num_accepted_tokens > 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("own", [True, False], ids=["own-embed-and-head", "the-targets"])
def test_drafts_are_the_dense_references(plain, tmp_path, own):
    """A random MTP layer (MLA + experts), four prompts at once: every proposal equals the
    dense reference's for the request's tokens at that step, through prefill and verified
    steps with drafts rejected; with its own embeddings and head, or the target's."""
    folder = with_mtp_layer(plain, tmp_path / "mtp", own_embed_and_head=own)
    engine = LLM(str(folder), speculative_config=MTP, **SMALL)
    seen = recorded_drafts(engine, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    # Each request proposes after its prefill, and again right after that proposal's
    # verification (a layer fed the rejected drafts' rows would not be caught up then).
    firsts = [tokens for tokens, _ in seen[: len(PROMPTS)]]
    assert all(any(t[:-1] == first for t, _ in seen) for first in firsts)
    for tokens, drafts in seen:
        expected = reference_drafts(str(folder), tokens[:-1], tokens[-1], K)
        assert drafts == expected[: len(drafts)]


def test_http_same_text_and_acceptance_counted_per_position(base, pairs, tmp_path):
    flag = json.dumps({"method": "deepseek_mtp", "num_speculative_tokens": K})
    args = ["--model", str(pairs["bigram"]), "--max-model-len", "256", "--kv-cache-memory", "8MiB"]
    srv = ServerProcess(
        [*args, "--block-size", "8", "--speculative-config", flag], tmp_path / "log"
    )
    srv.start()
    try:
        body = {"prompt": PROMPTS[1], "max_tokens": 30, "temperature": 0, "ignore_eos": True}
        r = httpx.post(srv.base_url + "/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        expected = run(base["bigram"], params, PROMPTS[1:2])[0].outputs[0].text
        assert r.json()["choices"][0]["text"] == expected
        page = httpx.get(srv.url + "/metrics").text
        accepted = metric_value(page, "vllm:spec_decode_num_accepted_tokens_total")
        assert accepted == metric_value(page, "vllm:spec_decode_num_draft_tokens_total") > 0
        per_pos = metric_value(page, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
        assert per_pos == accepted
    finally:
        assert srv.stop() == 0, srv.log()


# ---------------------------------------------------------------- refusals


def test_vllms_spellings_and_defaults():
    """deepseek_mtp is mtp; "model" defaults to the target's folder and num_speculative_tokens
    to its one MTP layer, as vLLM."""
    config = parse_speculative_config({"method": "deepseek_mtp"})
    assert (config.method, config.model, config.num_speculative_tokens) == ("mtp", None, 1)


def _with_config(source: Path, out: Path, **fields) -> Path:
    shutil.copytree(source, out)
    cfg = {**json.loads((out / "config.json").read_text()), **fields}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize(
    ("which", "spec", "args", "named"),
    [
        ("plain", {}, {}, "no weights for its MTP layer .*model.layers.3"),
        ("no-layers", {}, {}, r"no MTP layers \(num_nextn_predict_layers 0\)"),
        ("two-layers", {}, {}, "num_nextn_predict_layers 2"),
        ("damped", {"model": "/elsewhere"}, {}, "not the target's folder"),
        ("damped", {}, {"tensor_parallel_size": 2}, "tensor_parallel_size"),
        ("damped", {}, {"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
    ],
)
def test_what_it_cannot_serve_is_refused_by_name(plain, pairs, tmp_path, which, spec, args, named):
    folder = {
        "plain": plain,
        "damped": pairs["damped"],
        "no-layers": _with_config(pairs["damped"], tmp_path / "n0", num_nextn_predict_layers=0),
        "two-layers": _with_config(pairs["damped"], tmp_path / "n2", num_nextn_predict_layers=2),
    }[which]
    target = load_model_config(EngineArgs(model=str(folder)))
    config = parse_speculative_config({**MTP, **spec})
    with pytest.raises(DraftModelError, match=named):
        build_mtp_config(EngineArgs(**args), config, target)


def test_a_target_without_mtp_layers_is_refused_at_start(tiny_model_factory, plain):
    """At engine start, as a ValueError naming the architecture (a Llama has none) or the
    missing weights (a transformers-made V3)."""
    llama = tiny_model_factory("llama")
    with pytest.raises(ValueError, match="LlamaForCausalLM has no MTP layers"):
        LLM(llama, speculative_config=MTP, **SMALL)
    with pytest.raises(ValueError, match="no weights for its MTP layer"):
        LLM(str(plain), speculative_config={**MTP, "model": str(plain)}, **SMALL)
