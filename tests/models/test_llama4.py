"""Llama 4 text (chunked local attention, NoPE layers with temperature tuning, the qk L2 norm,
interleaved RoPE with llama3 scaling, experts scaled on their input beside a shared expert)
against transformers on a tiny random checkpoint (``trillm/testing/tiny_llama4.py``: 12-token
attention chunks, 8-token KV blocks), in fp32 through the real ModelRunner: greedy tokens equal
token for token with prompts of different lengths crossing the attention chunks batched whole
and in 7- and 5-token prefill chunks, logprobs close; a prefix-cache hit ending inside an
attention chunk; through the engine, preempted and resumed and with prefix-cache hits. Each
mechanism, left out, moves the logprobs far past the tolerance; the config's fields are each
honoured or refused by name.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_waves import two_waves
from hf_reference import hf_greedy
from runner_harness import (
    BLOCK_SIZE,
    MiniScheduler,
    Req,
    greedy_params,
    load_hf,
    load_runner,
    make_runner,
    random_prompts,
    run_requests,
    transformers_greedy,
)

from trillm import SamplingParams
from trillm.attention.backend import UnsupportedAttentionFeatureError
from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config
from trillm.model_executor import llama4_config
from trillm.model_executor.models.llama4 import Llama4Attention, Llama4ForCausalLM, Llama4MoE
from trillm.testing.tiny_llama4 import CHUNK, build_tiny_llama4
from trillm.worker.model_runner import ModelRunner

MAX_NEW = 8
PROMPT_LENS = [3, 29, 12, 41]  # across 0, 2 and 3 attention-chunk boundaries
TOLERANCE = 1e-4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = build_tiny_llama4(tmp_path_factory.mktemp("llama4"))
    hf = load_hf(path)
    reference = [transformers_greedy(hf, p, MAX_NEW)[0] for p in random_prompts(PROMPT_LENS)]
    return path, hf, reference


# ---------------------------------------------------------------- config


def test_fields_name_every_llama4_text_config_field():
    from transformers import Llama4TextConfig

    fields = {f.name for f in dataclasses.fields(Llama4TextConfig)}
    assert fields - set(llama4_config.FIELDS) == set()


def test_absent_keys_take_transformers_defaults():
    from transformers import Llama4TextConfig

    given = {"num_hidden_layers": 6, "hidden_size": 64, "interleave_moe_layer_step": 2}
    ours = llama4_config.prepare({**given}, llama4_config.ARCHITECTURE)
    theirs = Llama4TextConfig(**given)
    for key in ("head_dim", "no_rope_layers", "moe_layers", "layer_types", "floor_scale"):
        assert ours[key] == getattr(theirs, key), key
    assert ours["rope_parameters"] == theirs.rope_parameters
    assert ours["layer_types"][3] == "full_attention" != ours["layer_types"][2]
    # without a chunk size no layer is chunked, as transformers derives it
    unchunked = llama4_config.prepare({**given, "attention_chunk_size": None}, "Llama4ForCausalLM")
    assert set(unchunked["layer_types"]) == {"full_attention"}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"layer_types": ["sliding_attention"] * 2}, "Unsupported layer types.*sliding"),
        ({"layer_types": ["chunked_attention"] * 2, "attention_chunk_size": None}, "not set"),
        ({"layer_types": ["full_attention"]}, "1 entries for 2 layers"),
        ({"no_rope_layers": [1]}, "no_rope_layers has 1 entries"),
        ({"is_encoder_decoder": True}, "is_encoder_decoder"),
    ],
)
def test_config_fields_it_cannot_run_are_refused_by_name(fields, message):
    hf = {"num_hidden_layers": 2, **fields}
    with pytest.raises(ValueError, match=message):
        llama4_config.prepare(hf, llama4_config.ARCHITECTURE)


def test_other_models_configs_pass_unchanged():
    hf = {"layer_types": ["chunked_attention"]}
    assert llama4_config.prepare(hf, "LlamaForCausalLM") is hf


def test_the_default_backend_is_torch_on_every_device():
    """The one backend that masks chunked local attention, also where the default would be
    triton or flashinfer (CUDA)."""
    from trillm.engine.config_builder import resolve_attention_backend

    for device in ("cpu", "cuda"):
        resolved = resolve_attention_backend(EngineArgs(), device, "bfloat16", "Llama4ForCausalLM")
        assert resolved == "torch"


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_a_backend_without_chunked_attention_is_refused(model, backend):
    with pytest.raises(UnsupportedAttentionFeatureError, match=f"{backend}.*chunked local"):
        load_runner(model[0], attention_backend=backend)


def test_fp8_quantization_is_refused(model):
    with pytest.raises(ValueError, match="fp8 does not cover Llama4ForCausalLM's experts"):
        load_runner(model[0], quantization="fp8")


# ---------------------------------------------------------------- numerics vs transformers


@pytest.mark.parametrize("chunk", [None, 7, 5], ids=["whole", "chunk7", "chunk5"])
def test_greedy_matches_transformers(model, chunk):
    path, _, reference = model
    reqs = run_requests(make_runner(path), random_prompts(PROMPT_LENS), MAX_NEW, chunk=chunk)
    assert [r.output for r in reqs] == reference


def _worst_logprob_diff(runner: ModelRunner, hf, chunk: int = 7) -> float:
    """Prompt and sample logprobs (the target's and the top 2) of two batched prompts that
    cross the attention chunks, against transformers': the largest difference."""
    reqs = run_requests(
        runner,
        random_prompts([17, 38], seed=11),
        4,
        chunk=chunk,
        tag="l",
        logprobs=2,
        prompt_logprobs=2,
    )
    worst = 0.0
    for req in reqs:
        tokens, gen_logits = transformers_greedy(hf, req.prompt, 4)
        with torch.no_grad():
            prompt_logits = hf(torch.tensor([req.prompt])).logits[0, :-1].float()  # [P - 1, V]
        worst = max(worst, _rows_diff(req.prompt_logprobs, prompt_logits, req.prompt[1:]))
        worst = max(worst, _rows_diff(req.logprobs, gen_logits, req.output[:4]))
        if req.output != tokens:
            return float("inf")
    return worst


def _rows_diff(chunks, logits: torch.Tensor, targets: list[int], k: int = 2) -> float:
    ref = torch.log_softmax(logits, dim=-1)  # [n, V]
    assert [row[0] for c in chunks for row in c.token_ids] == targets
    ours = torch.tensor([row for c in chunks for row in c.logprobs])  # [n, 1 + k]
    target = ref.gather(1, torch.tensor(targets)[:, None])
    theirs = torch.cat([target, ref.topk(k, dim=-1).values], dim=1)
    return float((ours - theirs).abs().max())


def test_logprobs_match_transformers(model):
    path, hf, _ = model
    assert _worst_logprob_diff(make_runner(path), hf) < TOLERANCE  # measured: 5.5e-6


VARIANTS = {
    # two experts a token, each on the input scaled by its own score, summed
    "top2": dict(num_experts_per_tok=2),
    # biased projections, no qk norm, explicit per-layer lists, no temperature tuning
    "explicit": dict(
        attention_bias=True,
        use_qk_norm=False,
        no_rope_layers=[0, 1, 0, 1],
        moe_layers=[0],
        attn_temperature_tuning=False,
    ),
    # no attention_chunk_size: every layer attends to the whole sequence
    "unchunked": dict(attention_chunk_size=None, interleave_moe_layer_step=1),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variants_match_transformers(tmp_path, variant):
    path = build_tiny_llama4(tmp_path, seed=1, **VARIANTS[variant])
    assert _worst_logprob_diff(make_runner(path), load_hf(path), chunk=5) < TOLERANCE


def _no_chunks(runner: ModelRunner) -> None:
    for module in runner.model.modules():
        if isinstance(module, Llama4Attention):
            module.chunk, module.torch_backend = None, None


def _no_temperature(runner: ModelRunner) -> None:
    for module in runner.model.modules():
        if isinstance(module, Llama4Attention):
            module.temperature_tuning = False


def _no_qk_norm(runner: ModelRunner) -> None:
    for module in runner.model.modules():
        if isinstance(module, Llama4Attention):
            module.l2_norm = False


def _scores_on_outputs(runner: ModelRunner) -> None:
    def forward(self, x):
        top, ids = torch.topk(self.router(x), self.top_k, dim=-1)
        weights = torch.sigmoid(top.float())
        return self.shared_expert(x) + self.experts.run(x, weights, ids)

    for module in runner.model.modules():
        if isinstance(module, Llama4MoE):
            module.forward = forward.__get__(module)


@pytest.mark.parametrize(
    "mistake",
    [_no_chunks, _no_temperature, _no_qk_norm, _scores_on_outputs, "interleave"],
    ids=["no-chunks", "no-temperature", "no-qk-norm", "scores-on-outputs", "interleave"],
)
def test_each_mechanism_left_out_moves_the_logprobs(model, monkeypatch, mistake):
    """The comparison above sees each mechanism: without it the logprobs differ from
    transformers' by far more than the tolerance (or the greedy tokens do)."""
    path, hf, _ = model
    if mistake == "interleave":  # RoPE on transformers' pairs left interleaved
        monkeypatch.setattr(Llama4ForCausalLM, "_deinterleave", lambda self, rows: rows)
        runner = make_runner(path)
    else:
        runner = make_runner(path)
        mistake(runner)
    assert _worst_logprob_diff(runner, hf) > 100 * TOLERANCE


def test_a_prefix_cache_hit_inside_an_attention_chunk(model):
    """A request whose first two blocks (16 tokens: one attention chunk and 4 tokens of the
    next) are another's equals transformers, computing only its own tokens."""
    path, hf, _ = model
    prefix = random_prompts([2 * BLOCK_SIZE], seed=5)[0]
    first = Req("a", prefix + [7, 8, 9], greedy_params(MAX_NEW), MAX_NEW)
    sched = MiniScheduler(make_runner(path))
    sched.add(first)
    sched.run()
    second = Req("b", prefix + [11, 12, 13, 14, 15, 16, 17, 18, 19], greedy_params(MAX_NEW), 8)
    sched.add(second, prefix_blocks=first.blocks[:2], num_computed=2 * BLOCK_SIZE)
    sched.run()
    assert 2 * BLOCK_SIZE % CHUNK != 0  # the hit ends inside an attention chunk
    assert first.output == transformers_greedy(hf, first.prompt, MAX_NEW)[0]
    assert second.output == transformers_greedy(hf, second.prompt, MAX_NEW)[0]


def test_engine_preempts_chunks_and_hits_the_prefix_cache(model):
    path, _, _ = model
    prompts = random_prompts([40, 9, 33, 25, 50, 17, 30, 12], seed=3)
    prompts = [prompts[0][:20] + p if i % 2 else p for i, p in enumerate(prompts)]  # shared
    new = 2 * MAX_NEW  # decode grows every request past its blocks: the cache runs out
    expected = [hf_greedy(str(path), p, new) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    first, second, stats = two_waves(
        str(path),
        prompts,
        params,
        max_model_len=128,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=16,  # 8 requests need ~50 blocks: forces preemption
        max_num_batched_tokens=30,  # long prompts are chunked (not at attention chunks)
        distributed_executor_backend="uni",
    )
    assert first == expected and second == expected
    assert stats.num_preemptions > 0, "the small KV cache should have forced preemption"
    assert stats.prefix_cache_hits > 0, "the second wave should hit the prefix cache"


def test_a_tp_size_that_does_not_divide_the_dense_mlp_is_refused(model, tmp_path):
    """Refused before any worker starts, naming intermediate_size_mlp (the dense layers')."""
    import json
    import shutil

    from trillm.distributed.sharding import TensorParallelConfigError

    path = tmp_path / "odd"
    shutil.copytree(model[0], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "intermediate_size_mlp": 95}))
    args = EngineArgs(model=str(path), device="cpu", tensor_parallel_size=2)
    with pytest.raises(TensorParallelConfigError, match="intermediate_size_mlp=95"):
        build_config(args)
