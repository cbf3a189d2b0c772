"""EAGLE / EAGLE-3 speculative decoding end to end on tiny checkpoints (``eagle_heads.py``).

A 4-layer random Llama target is damped (its layers add 0.003 of their output to the residual
stream) so that heads built to predict a bigram model are right about half the time: drafts
accepted and rejected in one run, and the output must still be the target's alone, token for
token with its logprobs (batched prompts of different lengths, chunked prefill, preemption,
seeded sampling). On the undamped bigram target the same heads are always right: runs of
accepted drafts as long as ``k`` allows. EAGLE-3 reads the residual stream before three target
layers: compared with transformers' ``hidden_states``. Head config fields the worker cannot
honour are refused by name before anything loads.
"""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch
from eagle_heads import damped_target, eagle3_head, eagle_head
from eagle_reference import reference_drafts
from server_harness import ServerProcess, metric_value
from spec_compare import PROMPTS, SMALL, assert_same, recorded_drafts, run, stats

from trillm import LLM, SamplingParams
from trillm.config import EngineArgs
from trillm.model_executor.model_config import load_model_config
from trillm.spec_decode.config import DraftModelError, parse_speculative_config
from trillm.spec_decode.eagle_config import build_eagle_head_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(
    temperature=1.0, seed=7, top_k=50, max_tokens=30, ignore_eos=True, n=2, logprobs=1
)
HEADS = {"eagle": eagle_head, "eagle3": eagle3_head}
K = 3


def spec(method: str, head: str, k: int = K) -> dict:
    return {"method": method, "model": head, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def targets(tiny_model_factory, tmp_path_factory):
    """(damped target, bigram target): 4 layers, so EAGLE-3's default layers are (2, 2, 1)."""
    random = tiny_model_factory("llama", num_hidden_layers=4)
    root = tmp_path_factory.mktemp("eagle-targets")
    return damped_target(random, root / "damped", 0.003), damped_target(random, root / "bigram", 0)


@pytest.fixture(scope="module")
def heads(targets, tmp_path_factory):
    """method -> (head for the damped target, head for the bigram target)."""
    root = tmp_path_factory.mktemp("eagle-heads")
    return {
        m: tuple(build(t, root / f"{m}-{i}") for i, t in enumerate(targets))
        for m, build in HEADS.items()
    }


@pytest.fixture(scope="module")
def base(targets):
    engines = [LLM(t, **SMALL) for t in targets]
    yield engines
    for engine in engines:
        engine.shutdown()


@pytest.fixture(scope="module")
def eagles(targets, heads):
    """method -> engine over the damped target."""
    engines = {
        m: LLM(targets[0], speculative_config=spec(m, h[0]), **SMALL) for m, h in heads.items()
    }
    yield engines
    for engine in engines.values():
        engine.shutdown()


@pytest.mark.parametrize("method", HEADS)
def test_greedy_output_is_the_targets_with_drafts_accepted_and_rejected(base, eagles, method):
    engine = eagles[method]
    before = stats(engine)
    for x, y in zip(run(base[0], GREEDY), run(engine, GREEDY)):
        assert_same(x, y)
    after = stats(engine)
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    assert 0 < accepted < drafted  # both paths of the verifier ran


@pytest.mark.parametrize("method", HEADS)
def test_seeded_sampling_is_the_targets(base, eagles, method):
    engine = eagles[method]
    before = stats(engine).num_accepted_tokens
    for x, y in zip(run(base[0], SEEDED), run(engine, SEEDED)):
        assert_same(x, y)
    assert stats(engine).num_accepted_tokens > before


@pytest.mark.parametrize("method", HEADS)
def test_a_head_that_agrees_is_accepted_k_drafts_at_a_time(base, targets, heads, method):
    """On the bigram target the heads predict every token: mean acceptance length near
    k + 1 (vLLM's 1 + accepted / drafts), and still the target's output."""
    engine = LLM(targets[1], speculative_config=spec(method, heads[method][1]), **SMALL)
    try:
        for x, y in zip(run(base[1], GREEDY), run(engine, GREEDY)):
            assert_same(x, y)
        s = stats(engine)
        assert s.num_accepted_tokens == s.num_draft_tokens
        assert 1 + s.num_accepted_tokens / s.num_drafts > K + 0.5
    finally:
        engine.shutdown()


@pytest.mark.parametrize("method", HEADS)
def test_chunked_prefill_and_preemption_keep_the_output(base, targets, heads, method):
    """A step budget below the prompts (a head catches up chunk by chunk) and a cache too
    small for every request (preempted requests come back; their head cache is rewritten)."""
    tight = {**SMALL, "max_num_batched_tokens": 16, "num_gpu_blocks_override": 24}
    tight["max_model_len"] = 128
    engine = LLM(targets[0], speculative_config=spec(method, heads[method][0]), **tight)
    try:
        prompts = [p * 3 for p in PROMPTS]  # 20-40 tokens each: several budget-sized chunks
        params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        for x, y in zip(run(base[0], params, prompts), run(engine, params, prompts)):
            assert_same(x, y)
        assert engine.engine.get_stats().num_preemptions > 0
        assert stats(engine).num_accepted_tokens > 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("method", "shape"),
    [
        ("eagle", {}),
        ("eagle", {"para_norms": True, "layers": 2}),
        ("eagle3", {}),
        ("eagle3", {"layers": 2}),
    ],
    ids=["eagle", "eagle-hass-2-layers", "eagle3", "eagle3-2-layers"],
)
def test_drafts_are_the_dense_references(tiny_model_factory, tmp_path, method, shape):
    """Random heads on a random target, four prompts at once: every proposal equals a dense
    reference's (transformers' hidden states, the head's whole sequence recomputed with
    causal attention) for the request's tokens at that step, through prefill and verified
    steps with drafts rejected."""
    target = tiny_model_factory("llama", num_hidden_layers=4)
    head = HEADS[method](target, tmp_path / "head", agree=False, **shape)
    engine = LLM(target, speculative_config=spec(method, head), **SMALL)
    seen = recorded_drafts(engine, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    # Each request proposes after its prefill, and again right after that proposal's
    # verification (a head fed the rejected drafts' rows would not be caught up then).
    firsts = [tokens for tokens, _ in seen[: len(PROMPTS)]]
    assert all(any(t[:-1] == first for t, _ in seen) for first in firsts)
    for tokens, drafts in seen:
        assert (
            drafts
            == reference_drafts(target, head, method, tokens[:-1], tokens[-1], K)[: len(drafts)]
        )


def test_eagle3_reads_the_residual_stream_before_its_layers(targets, heads, tmp_path):
    """The states the head is given are transformers' hidden_states[i] (the stream entering
    layer i; i = 0: the embeddings) for eagle_config's layer ids."""
    import transformers

    head = tmp_path / "head"
    shutil.copytree(heads["eagle3"][0], head)
    cfg = json.loads((head / "config.json").read_text())
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}
    (head / "config.json").write_text(json.dumps(cfg))
    engine = LLM(targets[0], speculative_config=spec("eagle3", str(head)), **SMALL)
    try:
        out = engine.generate(PROMPTS[1], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        aux = engine.engine.executors[0].runner.drafter._aux  # the prompt's step's
    finally:
        engine.shutdown()
    hf = transformers.LlamaForCausalLM.from_pretrained(targets[0])
    with torch.no_grad():
        ids = torch.tensor([out.prompt_token_ids])
        states = hf(ids, output_hidden_states=True).hidden_states
    for got, layer in zip(aux, [0, 1, 3]):
        torch.testing.assert_close(got, states[layer][0], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def target_config(targets):
    return load_model_config(EngineArgs(model=targets[0]))


def head_with(tmp_path, source: str, **fields) -> str:
    head = tmp_path / "head"
    shutil.copytree(source, head)
    cfg = {**json.loads((head / "config.json").read_text()), **fields}
    (head / "config.json").write_text(json.dumps(cfg))
    return str(head)


# The fields of the published heads' config.json (yuhuili/EAGLE-LLaMA3-Instruct-8B,
# yuhuili/EAGLE3-LLaMA3.1-Instruct-8B) besides the ones the tiny heads already carry.
PUBLISHED = {
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "initializer_range": 0.02,
    "pad_token_id": 0,
    "pretraining_tp": 1,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "transformers_version": "4.28.1",
    "use_cache": True,
    "torch_dtype": "float16",
}


@pytest.mark.parametrize("method", HEADS)
def test_published_head_configs_are_read(heads, target_config, tmp_path, method):
    head = head_with(tmp_path, heads[method][0], **PUBLISHED)
    cfg = build_eagle_head_config(
        EngineArgs(), parse_speculative_config(spec(method, head)), target_config
    )
    assert (cfg.rope_theta, cfg.rope_scaling["rope_type"]) == (500000.0, "llama3")
    assert cfg.dtype == target_config.dtype  # the target's, as vLLM runs a head


def test_eagle3_default_layers_are_vllms(heads, target_config):
    config = parse_speculative_config(spec("eagle3", heads["eagle3"][0]))
    head = build_eagle_head_config(EngineArgs(), config, target_config)
    assert head.hf_config["aux_layers"] == [2, 2, 1]  # (2, L // 2, L - 3) for L = 4


@pytest.mark.parametrize(
    ("method", "fields", "args", "named"),
    [
        ("eagle3", {"speculators_config": {}}, {}, "speculators_config are not supported"),
        ("eagle", {"architectures": ["LlamaForCausalLMEagle3"]}, {}, "not an eagle head"),
        ("eagle", {"architectures": ["LlamaForCausalLM"]}, {}, "use method eagle3"),
        ("eagle3", {"vocab_size": 100}, {}, "vocab_size 100 is not the target's"),
        ("eagle3", {"target_hidden_size": 32}, {}, "target of width 32"),
        ("eagle3", {"hidden_act": "gelu"}, {}, "hidden_act must be silu"),
        ("eagle3", {"tie_word_embeddings": True}, {}, "tie_word_embeddings"),
        (
            "eagle3",
            {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}},
            {},
            r"auxiliary layers \[1, 2, 9\]",
        ),
        ("eagle3", {"eagle_config": {"use_aux_hidden_state": False}}, {}, "use_aux_hidden_state"),
        ("eagle3", {}, {"tensor_parallel_size": 2}, "tensor_parallel_size"),
        ("eagle", {}, {"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
    ],
)
def test_head_fields_it_cannot_honour_are_refused_by_name(
    heads, target_config, tmp_path, method, fields, args, named
):
    config = parse_speculative_config(
        spec(method, head_with(tmp_path, heads["eagle3"][0], **fields))
    )
    with pytest.raises(DraftModelError, match=named):
        build_eagle_head_config(EngineArgs(**args), config, target_config)


def test_http_eagle3_same_text_and_acceptance_counted(base, targets, heads, tmp_path):
    flag = json.dumps(spec("eagle3", heads["eagle3"][1]))
    args = ["--model", targets[1], "--max-model-len", "256", "--kv-cache-memory", "8MiB"]
    srv = ServerProcess(
        [*args, "--block-size", "8", "--speculative-config", flag], tmp_path / "log"
    )
    srv.start()
    try:
        body = {"prompt": PROMPTS[1], "max_tokens": 30, "temperature": 0, "ignore_eos": True}
        r = httpx.post(srv.base_url + "/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        assert (
            r.json()["choices"][0]["text"] == run(base[1], params, PROMPTS[1:2])[0].outputs[0].text
        )
        page = httpx.get(srv.url + "/metrics").text
        accepted = metric_value(page, "vllm:spec_decode_num_accepted_tokens_total")
        assert accepted >= 0.9 * metric_value(page, "vllm:spec_decode_num_draft_tokens_total") > 0
    finally:
        assert srv.stop() == 0, srv.log()
