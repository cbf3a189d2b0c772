"""DeepSeek-V2 / V3 (MLA on the latent KV cache, dense first layer, routed + shared experts)
against transformers on tiny random checkpoints (``trillm/testing/tiny_deepseek.py``: V2-Lite's
shape without q-LoRA, V2 with q-LoRA and group-limited routing, V3 with noaux_tc routing,
interleaved RoPE and YaRN mscale, V3 without interleaving), in fp32 through the real
ModelRunner: greedy tokens equal token for token (whole prompts of different lengths batched,
and 7-token prefill chunks), logprobs close; through the engine, preempted and resumed and
with prefix-cache hits. The cache holds kv_lora_rank + qk_rope_head_dim values a token and
layer, and the runner sizes its blocks from that."""

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
from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config
from trillm.model_executor import deepseek_config
from trillm.testing.tiny_deepseek import BASE, CASES, build_tiny_deepseek
from trillm.testing.tiny_models import build_tiny_model
from trillm.worker.model_runner import ModelRunner

MAX_NEW = 8
PROMPT_LENS = [3, 21, 12, 30]
LATENT = BASE["kv_lora_rank"] + BASE["qk_rope_head_dim"]  # 40 values a token and layer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def get(case: str):
        if case not in cache:
            path = build_tiny_deepseek(case, tmp_path_factory.mktemp(case))
            hf = load_hf(path)
            prompts = random_prompts(PROMPT_LENS)
            cache[case] = path, hf, [transformers_greedy(hf, p, MAX_NEW)[0] for p in prompts]
        return cache[case]

    return get


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunk7"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(built, case, chunk):
    path, _, reference = built(case)
    reqs = run_requests(make_runner(path), random_prompts(PROMPT_LENS), MAX_NEW, chunk=chunk)
    assert [r.output for r in reqs] == reference


@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_match_transformers(built, case):
    path, hf, _ = built(case)
    reqs = run_requests(
        make_runner(path),
        random_prompts([17, 26], seed=11),
        4,
        chunk=7,
        tag="l",
        logprobs=2,
        prompt_logprobs=2,
    )
    worst = 0.0
    for req in reqs:
        tokens, gen_logits = transformers_greedy(hf, req.prompt, 4)
        assert req.output == tokens
        with torch.no_grad():
            prompt_logits = hf(torch.tensor([req.prompt])).logits[0, :-1].float()  # [P - 1, V]
        worst = max(worst, _check_rows(req.prompt_logprobs, prompt_logits, req.prompt[1:]))
        worst = max(worst, _check_rows(req.logprobs, gen_logits, tokens))
    assert worst < 1e-4  # measured: 6.7e-6 at most (v2_lite, v3)


def _check_rows(chunks, logits: torch.Tensor, targets: list[int], k: int = 2) -> float:
    """Top-k and target logprobs against transformers' -> the largest difference. A rank may
    differ only where another logit is within 1e-5 of the target's (the absorbed MLA sums in
    another order: ties at fp32 noise)."""
    ref = torch.log_softmax(logits, dim=-1)  # [n, V]
    token_ids = [row for c in chunks for row in c.token_ids]
    assert [row[0] for row in token_ids] == targets and all(len(r) == 1 + k for r in token_ids)
    ours = torch.tensor([row for c in chunks for row in c.logprobs])
    target = ref.gather(1, torch.tensor(targets)[:, None])  # [n, 1]
    theirs = torch.cat([target, ref.topk(k, dim=-1).values], dim=1)
    ranks = torch.tensor([r for c in chunks for r in c.ranks])
    assert ((ref > target + 1e-5).sum(-1) + 1 <= ranks).all()
    assert (ranks <= (ref > target - 1e-5).sum(-1) + 1).all()
    return float((ours - theirs).abs().max())


def test_a_prefix_cache_hit_reads_the_latent_blocks(built):
    """A request whose first two blocks are another's (their latents already cached) equals
    transformers, computing only its own tokens."""
    path, hf, _ = built("v3")
    prefix = random_prompts([2 * BLOCK_SIZE], seed=5)[0]
    first = Req("a", prefix + [7, 8, 9], greedy_params(MAX_NEW), MAX_NEW)
    sched = MiniScheduler(make_runner(path))
    sched.add(first)
    sched.run()
    second = Req("b", prefix + [11, 12, 13, 14], greedy_params(MAX_NEW), MAX_NEW)
    sched.add(second, prefix_blocks=first.blocks[:2], num_computed=2 * BLOCK_SIZE)
    sched.run()
    assert first.output == transformers_greedy(hf, first.prompt, MAX_NEW)[0]
    assert second.output == transformers_greedy(hf, second.prompt, MAX_NEW)[0]


def test_engine_preempts_chunks_and_hits_the_prefix_cache(built):
    path, _, _ = built("v2")
    prompts = random_prompts([40, 9, 33, 25, 50, 17, 30, 12], seed=3)
    prompts = [prompts[0][:24] + p if i % 2 else p for i, p in enumerate(prompts)]  # shared
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
        max_num_batched_tokens=32,  # long prompts are chunked
        distributed_executor_backend="uni",
    )
    assert first == expected and second == expected
    assert stats.num_preemptions > 0, "the small KV cache should have forced preemption"
    assert stats.prefix_cache_hits > 0, "the second wave should hit the prefix cache"


def _runner(path, **kw) -> ModelRunner:
    return load_runner(path, max_model_len=128, **kw)


def test_the_cache_holds_the_latent_not_full_kv(built, tmp_path):
    """Bytes per token and layer: (kv_lora_rank + qk_rope_head_dim) x 4 for DeepSeek, against
    2 x heads x head_dim x 4 for a Llama of the same width; --kv-cache-memory buys blocks by
    those bytes."""
    path, _, _ = built("v3")
    memory = 1 << 20
    deepseek = _runner(path, kv_cache_memory=memory)
    llama_path = build_tiny_model(
        "llama", tmp_path / "llama", num_hidden_layers=3, num_key_value_heads=4, head_dim=16
    )
    llama = _runner(llama_path, kv_cache_memory=memory)
    layers = BASE["num_hidden_layers"]
    per_token = {r: r.kv_block_bytes() // BLOCK_SIZE for r in (deepseek, llama)}
    assert per_token[deepseek] == layers * LATENT * 4 == 480
    assert per_token[llama] == layers * 2 * 4 * 16 * 4 == 1536
    num_blocks = deepseek.determine_num_blocks()
    assert num_blocks == memory // (480 * BLOCK_SIZE)
    deepseek.initialize_kv_cache(num_blocks)
    assert [tuple(c.shape) for c in deepseek.kv_caches] == [(1, num_blocks, BLOCK_SIZE, 1, 40)] * 3
    assert llama.determine_num_blocks() == memory // (1536 * BLOCK_SIZE)


def test_fp8_latent_cache(built):
    """kv_cache_dtype fp8: one byte a value, and the model still follows transformers
    closely (greedy tokens of the first steps, where fp8 noise has not yet accumulated)."""
    path, _, reference = built("v2_lite")
    runner = _runner(path, kv_cache_dtype="fp8", num_gpu_blocks_override=64)
    assert runner.kv_block_bytes() == 3 * LATENT * BLOCK_SIZE
    runner.initialize_kv_cache(64)
    assert runner.kv_caches[0].dtype == torch.float8_e4m3fn
    sched = MiniScheduler(runner)
    prompts = random_prompts(PROMPT_LENS)
    reqs = [Req(f"f{i}", p, greedy_params(2), 2) for i, p in enumerate(prompts)]
    for req in reqs:
        sched.add(req)
    sched.run()
    assert [r.output for r in reqs] == [ref[:2] for ref in reference]


def test_bf16_follows_transformers_up_to_a_tie(built):
    """bf16, the router kept in fp32 as transformers keeps it: each request's greedy tokens
    equal transformers' (in bf16) until a step where the two top logits are a bf16 tie, where
    ours must be transformers' runner-up (the absorbed MLA rounds elsewhere; vLLM's
    ``check_logprobs_close`` rule)."""
    import transformers

    path, _, _ = built("v3")
    args = EngineArgs(
        model=str(path), dtype="bfloat16", device="cpu", block_size=BLOCK_SIZE, max_model_len=256
    )
    runner = ModelRunner(build_config(args))
    runner.load_model()
    runner.initialize_kv_cache(128)
    gate = runner.model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompts = random_prompts(PROMPT_LENS)
    reqs = [Req(f"b{i}", p, greedy_params(MAX_NEW), MAX_NEW) for i, p in enumerate(prompts)]
    sched = MiniScheduler(runner, chunk=7)
    for req in reqs:
        sched.add(req)
    sched.run()
    exact = 0
    for req in reqs:
        theirs, logits = transformers_greedy(hf, req.prompt, MAX_NEW)
        step = next((i for i, (a, b) in enumerate(zip(req.output, theirs)) if a != b), None)
        if step is None:
            exact += 1
            continue
        top2 = logits[step].topk(2)
        assert req.output[step] == top2.indices[1] and top2.values[0] == top2.values[1]
    assert exact >= len(reqs) - 1  # measured: 3 of 4 exact, the fourth a tie at step 3


def test_mtp_layers_are_skipped_at_load(built, tmp_path):
    """DeepSeek-V3 checkpoints carry their multi-token-prediction layer after the decoder's
    layers; transformers skips it, and so does trillm."""
    import shutil

    from safetensors.torch import load_file, save_file

    path, _, _ = built("v3")
    copy = tmp_path / "with_mtp"
    shutil.copytree(path, copy)
    weights = load_file(copy / "model.safetensors")
    weights["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    weights["model.layers.3.mlp.experts.0.up_proj.weight"] = torch.zeros(32, 64)
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    make_runner(copy)  # loads


# ---------------------------------------------------------------- config fields


def test_every_config_field_is_mapped():
    import transformers

    for cls in (transformers.DeepseekV2Config, transformers.DeepseekV3Config):
        names = {f.name for f in dataclasses.fields(cls)} | set(cls.attribute_map)
        unmapped = names - set(deepseek_config.FIELDS) - {"num_experts", "num_local_experts"}
        assert not unmapped, f"{cls.__name__}: decide what trillm does with {sorted(unmapped)}"


def _hf(version: str, **fields):
    return {**BASE, **CASES["v3" if version == "V3" else "v2"][1], **fields}


@pytest.mark.parametrize(
    ("version", "fields", "named"),
    [
        ("V2", {"scoring_func": "sigmoid"}, "scoring_func"),
        ("V3", {"scoring_func": "softmax"}, "scoring_func"),
        ("V2", {"topk_method": "noaux_tc"}, "topk_method"),
        ("V3", {"topk_method": "group_limited_greedy"}, "topk_method"),
        ("V2", {"norm_topk_prob": True}, "norm_topk_prob"),
        ("V3", {"num_key_value_heads": 128}, "num_key_value_heads"),
        ("V3", {"moe_layer_freq": 2}, "moe_layer_freq"),
        ("V2", {"mlp_bias": True}, "mlp_bias"),
        ("V2", {"pretraining_tp": 2}, "pretraining_tp"),
        ("V3", {"n_group": 3}, "n_group"),
        ("V3", {"topk_group": 5}, "topk_group"),
        ("V3", {"n_shared_experts": 0}, "n_shared_experts"),
        ("V3", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ],
)
def test_a_field_trillm_would_not_honour_is_refused_by_name(version, fields, named):
    arch = f"Deepseek{version}ForCausalLM"
    with pytest.raises(deepseek_config.DeepseekConfigError, match=named):
        deepseek_config.prepare(_hf(version, **fields), arch)


def test_defaults_are_transformers(tmp_path):
    """An absent key means what it means to transformers (V2 and V3 differ); head_dim is the
    rope width."""
    import transformers

    for version in ("V2", "V3"):
        arch = f"Deepseek{version}ForCausalLM"
        minimal = {k: BASE[k] for k in ("hidden_size", "num_attention_heads", "vocab_size")}
        ours = deepseek_config.prepare({**minimal, "num_experts_per_tok": 2}, arch)
        theirs = getattr(transformers, f"Deepseek{version}Config")(**minimal)
        for key in ("q_lora_rank", "routed_scaling_factor", "n_group", "topk_group"):
            assert ours[key] == getattr(theirs, key), (version, key)
        assert ours["head_dim"] == theirs.head_dim == theirs.qk_rope_head_dim


def test_mla_attends_in_its_own_torch_path(built):
    """The default backend of these models is torch on every device (MLA's own attention);
    naming another is refused when the model is built, not ignored."""
    from trillm.engine.config_builder import resolve_attention_backend

    for device in ("cpu", "cuda"):
        resolved = resolve_attention_backend(
            EngineArgs(), device, "bfloat16", "DeepseekV3ForCausalLM"
        )
        assert resolved == "torch"
    assert (
        resolve_attention_backend(EngineArgs(), "cuda", "bfloat16", "LlamaForCausalLM") != "torch"
    )
    path, _, _ = built("v2_lite")
    with pytest.raises(ValueError, match="attention-backend eager is not supported"):
        _runner(path, attention_backend="eager")


def test_numerics_transformers_is_refused(built):
    path, _, _ = built("v2_lite")
    runner = make_runner(path)
    cfg = dataclasses.replace(runner.config.model, numerics="transformers")
    with pytest.raises(ValueError, match="numerics"):
        type(runner.model)(cfg, runner.attn_backend)
