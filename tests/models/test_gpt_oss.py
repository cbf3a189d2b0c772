"""gpt-oss (``GptOssForCausalLM``) against transformers on a tiny random checkpoint: attention
sinks drawn large, windows of 8 positions on layers 0 and 2 (full attention on layer 1), four
experts with biases and a SwiGLU clamp that bites, YaRN RoPE. Greedy tokens equal transformers'
and log-probs are close, for batched prompts that cross the window, in whole prompts and
5-token prefill chunks, through the torch and eager attention backends, through the engine
with preemption and prefix-cache hits, and from an MXFP4 checkpoint (dequantized at load)
against transformers' own dequantized forward. The checkpoint is sensitive to each mechanism
(``test_each_mechanism_changes_the_reference``), so a path that dropped one would fail."""

from __future__ import annotations

import dataclasses
import json
import logging
import random

import pytest
import torch
import trio
from hf_reference import hf_greedy
from mxfp4_checkpoint import write_mxfp4_copy
from runner_harness import (
    check_logprobs,
    load_hf,
    make_runner,
    random_prompts,
    run_requests,
    transformers_greedy,
)

from trillm import SamplingParams, open_engine
from trillm.attention.backend import UnsupportedAttentionFeatureError
from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config
from trillm.kernels import paged_attention_cpu
from trillm.model_executor import gpt_oss_config, mxfp4
from trillm.parsers.reasoning import get_reasoning_parser
from trillm.worker.model_runner import ModelRunner

MAX_NEW = 8
PROMPT_LENS = [3, 21, 12, 30]  # the window is 8: all but the first cross it

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def case(tiny_model_factory):
    path = tiny_model_factory("gpt_oss")
    hf = load_hf(path)
    reference = [transformers_greedy(hf, p, MAX_NEW)[0] for p in random_prompts(PROMPT_LENS)]
    return path, hf, reference


def _greedy(runner: ModelRunner, chunk: int | None) -> list[list[int]]:
    reqs = run_requests(runner, random_prompts(PROMPT_LENS), MAX_NEW, chunk=chunk)
    return [r.output for r in reqs]


@pytest.mark.parametrize("backend", ["torch", "eager"])
@pytest.mark.parametrize("chunk", [None, 5], ids=["whole", "chunk5"])
def test_greedy_matches_transformers(case, backend, chunk):
    path, _, reference = case
    assert _greedy(make_runner(path, attention_backend=backend), chunk) == reference


@pytest.mark.skipif(not paged_attention_cpu.available(), reason="cpu_kernels is not built")
def test_fp32_sinks_run_in_the_native_kernel(case, monkeypatch):
    seen: list[bool] = []
    run = paged_attention_cpu.PagedAttentionPlan.run

    def spy(self, q, kv_cache, scale, out=None, window=None, softcap=None, sinks=None):
        seen.append(sinks is not None)
        return run(self, q, kv_cache, scale, out, window, softcap, sinks)

    monkeypatch.setattr(paged_attention_cpu.PagedAttentionPlan, "run", spy)
    assert _greedy(make_runner(case[0]), 5) == case[2]
    assert seen and all(seen)


def test_logprobs_match_transformers(case):
    path, hf, _ = case
    reqs = run_requests(
        make_runner(path),
        random_prompts([17, 26], seed=11),
        4,
        chunk=5,
        tag="l",
        logprobs=2,
        prompt_logprobs=2,
    )
    check_logprobs(hf, reqs, 4, k_prompt=2, k=2)  # within 1e-4, ranks equal


def test_bf16_eager_backend_equals_transformers_bf16(tmp_path):
    """In bf16 the eager backend runs transformers' gpt-oss attention op for op (the sink
    column, the max subtracted, a bf16 softmax): the same greedy tokens."""
    import transformers

    from trillm.testing.tiny_models import build_tiny_model

    path = build_tiny_model("gpt_oss", tmp_path / "bf16", dtype="bfloat16")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    reference = [transformers_greedy(hf, p, MAX_NEW)[0] for p in random_prompts(PROMPT_LENS)]
    runner = make_runner(path, attention_backend="eager", dtype="bfloat16")
    assert _greedy(runner, 5) == reference


def test_each_mechanism_changes_the_reference(case):
    """transformers' own greedy tokens change when a sink, the window, the clamp or the
    expert biases are taken away: the comparisons above see each of them."""
    path, _, reference = case
    prompts = random_prompts(PROMPT_LENS)

    def greedy_with(edit) -> list[list[int]]:
        hf = load_hf(path)
        with torch.no_grad():
            edit(hf)
        return [transformers_greedy(hf, p, MAX_NEW)[0] for p in prompts]

    def no_sinks(hf):
        for layer in hf.model.layers:
            layer.self_attn.sinks.fill_(-1e4)

    def no_window(hf):
        hf.config.sliding_window = 10_000

    def no_clamp(hf):
        for layer in hf.model.layers:
            layer.mlp.experts.limit = 1e9

    def no_expert_bias(hf):
        for layer in hf.model.layers:
            layer.mlp.experts.gate_up_proj_bias.zero_()
            layer.mlp.experts.down_proj_bias.zero_()

    for edit in (no_sinks, no_window, no_clamp, no_expert_bias):
        assert greedy_with(edit) != reference, edit.__name__


# ---------------------------------------------------------------- through the engine

NUM_REQUESTS = 8


def _engine_prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(3, 4096) for _ in range(24)]  # three blocks: prefix-cache hits
    prompts = []
    for i in range(NUM_REQUESTS):
        body = [rng.randrange(3, 4096) for _ in range(rng.randint(3, 30))]
        prompts.append(shared + body if i % 2 == 0 else body)
    return prompts


def test_engine_with_preemption_and_prefix_cache_matches_transformers(case):
    path, _, _ = case
    prompts = _engine_prompts()
    expected = [hf_greedy(path, p, MAX_NEW) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)

    async def wave(engine) -> list[list[int]]:
        results: list[list[int]] = [[] for _ in prompts]

        async def one(i: int) -> None:
            async with engine.generate({"prompt_token_ids": prompts[i]}, params) as outputs:
                async for out in outputs:
                    results[i] = list(out.outputs[0].token_ids)

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        return results

    async def main():
        async with open_engine(
            path,
            dtype="float32",
            max_model_len=64,
            block_size=8,
            num_gpu_blocks_override=12,  # 8 requests need ~40 blocks: forces preemption
            max_num_batched_tokens=16,  # long prompts are chunked
            max_num_seqs=8,
            distributed_executor_backend="uni",
        ) as engine:
            first = await wave(engine)
            second = await wave(engine)  # the same prompts: prefix-cache hits
            return first, second, engine.get_stats()

    first, second, stats = trio.run(main)
    assert first == expected
    assert second == expected
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0


# ---------------------------------------------------------------- MXFP4 checkpoints


@pytest.fixture(scope="module")
def mxfp4_case(case, tmp_path_factory):
    import transformers

    path = write_mxfp4_copy(case[0], tmp_path_factory.mktemp("gpt-oss-mxfp4") / "model")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch.float32,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
    ).eval()
    return path, hf


def test_mxfp4_dequantization_equals_transformers(mxfp4_case):
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path, _ = mxfp4_case
    weights = load_file(path / "model.safetensors")
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj"):
        blocks, scales = weights[f"{name}_blocks"], weights[f"{name}_scales"]
        ours = mxfp4.dequantize(blocks, scales, torch.float32)
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert torch.equal(ours, theirs), name


def test_mxfp4_checkpoint_matches_transformers_dequantized(case, mxfp4_case, caplog):
    path, hf = mxfp4_case
    with caplog.at_level(logging.WARNING, logger="trillm.model_executor.mxfp4"):
        runner = make_runner(path)
    (message,) = [r.getMessage() for r in caplog.records if r.name.endswith("mxfp4")]
    # 3 layers x 4 experts x 3 x 64 x 32 weights: 288 KiB in fp32, 4.25 bits each in the file
    assert "dequantized to float32" in message and "288.0 KiB" in message
    assert "(7.5x)" in message
    reqs = run_requests(
        runner,
        random_prompts(PROMPT_LENS[1:]),
        MAX_NEW,
        chunk=5,
        tag="m",
        logprobs=2,
        prompt_logprobs=2,
    )
    check_logprobs(hf, reqs, MAX_NEW, k_prompt=2, k=2)
    assert [r.output for r in reqs] != case[2][1:]  # 4-bit experts: other tokens than fp32


def test_mxfp4_blocks_without_scales_are_refused(mxfp4_case, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "broken"
    shutil.copytree(mxfp4_case[0], path)
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.down_proj_blocks without"):
        make_runner(path)


# ---------------------------------------------------------------- config and refusals


def test_every_transformers_config_field_is_decided():
    from transformers import GptOssConfig

    fields = {f.name for f in dataclasses.fields(GptOssConfig)}
    assert fields - set(gpt_oss_config.FIELDS) == set()


def test_absent_keys_take_transformers_defaults():
    from transformers import GptOssConfig

    hf = {"architectures": ["GptOssForCausalLM"], "num_hidden_layers": 3, "hidden_size": 64}
    ours = gpt_oss_config.prepare(hf, "GptOssForCausalLM")
    theirs = GptOssConfig(num_hidden_layers=3, hidden_size=64)
    for key in ("head_dim", "sliding_window", "attention_bias", "layer_types", "swiglu_limit"):
        assert ours[key] == getattr(theirs, key), key
    assert ours["rope_parameters"] == theirs.rope_parameters


def test_a_backend_without_sinks_is_refused():
    from trillm.attention import backend as attention_backend
    from trillm.attention.flashinfer_backend import FlashInferAttentionBackend

    assert not getattr(FlashInferAttentionBackend, "supports_sinks", False)
    fake = type("Backend", (), {"name": "flashinfer"})()
    with pytest.raises(UnsupportedAttentionFeatureError, match="flashinfer.*attention sinks"):
        attention_backend.check_backend_supports_sinks(fake)


def test_triton_backend_matches_transformers(case):
    """The Triton kernel (interpreted on CPU) takes the sinks too."""
    from trillm.kernels import paged_attention_triton

    if not paged_attention_triton.runs_interpreted():
        pytest.skip("the Triton kernels were defined without TRITON_INTERPRET (no GPU here)")
    path, _, reference = case
    assert _greedy(make_runner(path, attention_backend="triton"), 5) == reference


def test_fp8_quantization_is_refused(case):
    with pytest.raises(ValueError, match="fp8 does not cover gpt-oss's experts"):
        make_runner(case[0], quantization="fp8")


def test_mxfp4_of_another_architecture_is_refused(tiny_model_factory, tmp_path):
    import json
    import shutil

    path = tmp_path / "llama"
    shutil.copytree(tiny_model_factory("llama"), path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MXFP4 checkpoints are supported for GptOssForCausalLM"):
        make_runner(path)


# ---------------------------------------------------------------- harmony chat


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the weather in Paris?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather now.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    """The harmony checkpoint, its chat prompt as transformers renders it, and its ids."""
    from transformers import AutoTokenizer

    from trillm.testing.tiny_harmony import build_harmony_gpt_oss

    path = build_harmony_gpt_oss(tmp_path_factory.mktemp("harmony") / "model")
    tok = AutoTokenizer.from_pretrained(str(path))
    prompt = tok.apply_chat_template(
        MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    return path, tok, prompt, tok(prompt, add_special_tokens=False).input_ids


def test_http_chat_with_the_harmony_parsers_matches_transformers(harmony, tmp_path):
    """``trillm serve`` with vLLM's gpt-oss flags: the chat renders the folder's template,
    greedy tokens equal transformers', the parsed message has its reasoning field, and the
    stream's deltas add up to the same message."""
    import httpx
    from server_harness import ServerProcess

    path, tok, prompt, ids = harmony
    flags = ["--dtype", "float32", "--max-model-len", "256", "--disable-log-stats"]
    parsers = ["--enable-auto-tool-choice", "--tool-call-parser", "openai"]
    parsers += ["--reasoning-parser", "openai_gptoss"]
    srv = ServerProcess(["--model", str(path), *flags, *parsers], tmp_path / "log").start()
    try:
        body = {
            "model": str(path),
            "messages": MESSAGES,
            "tools": TOOLS,
            "temperature": 0,
            "max_tokens": MAX_NEW,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        r = httpx.post(srv.base_url + "/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        answer = r.json()
        (choice,) = answer["choices"]
        assert answer["prompt_token_ids"] == ids
        assert choice["token_ids"] == hf_greedy(str(path), ids, MAX_NEW)
        text = tok.decode(choice["token_ids"], skip_special_tokens=False)
        reasoning, content = get_reasoning_parser("openai_gptoss")(prompt).extract(text)
        assert choice["message"]["reasoning_content"] == reasoning
        assert choice["message"]["content"] == content
        streamed = ""
        with httpx.stream(
            "POST", srv.base_url + "/chat/completions", json={**body, "stream": True}, timeout=120
        ) as events:
            for line in events.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        streamed += c["delta"].get("content") or ""
        assert streamed == (content or "")
    finally:
        assert srv.stop() == 0, srv.log()


def test_llm_chat_renders_the_harmony_template_and_matches_transformers(harmony):
    """``LLM.chat`` renders the folder's harmony template (transformers renders the same
    prompt), keeps the special tokens for the harmony parsers, and greedy-decodes as
    transformers does from that prompt."""
    from trillm import LLM

    path, tok, prompt, ids = harmony
    assert prompt.endswith("<|end|><|start|>assistant") and "namespace functions {" in prompt
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(
        str(path), dtype="float32", max_model_len=256, distributed_executor_backend="uni"
    ) as llm:
        (out,) = llm.chat(
            MESSAGES,
            params,
            use_tqdm=False,
            tools=TOOLS,
            tool_parser="openai",
            reasoning_parser="openai_gptoss",
        )
    assert out.prompt == prompt and out.prompt_token_ids == ids
    (choice,) = out.outputs
    assert list(choice.token_ids) == hf_greedy(str(path), ids, MAX_NEW)
    # the parsers' markers are special tokens: they stay in the text
    assert choice.text == tok.decode(choice.token_ids, skip_special_tokens=False)
    parsed = get_reasoning_parser("openai_gptoss")(prompt).extract(choice.text)
    assert (choice.reasoning_content, choice.content) == parsed


def test_an_activation_other_than_silu_is_refused(case, tmp_path):
    import shutil

    path = tmp_path / "gelu"
    shutil.copytree(case[0], path)
    config = json.loads((path / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match="Activation 'gelu' is not supported for GptOssForCausalLM"
    ):
        build_config(EngineArgs(model=str(path)))
