"""LoRA adapters on the engine: PEFT adapters built by the tests on a tiny model.

Greedy output with an adapter equals transformers + PEFT token for token; a batch mixing three
adapters and the base model gives each request what it gets alone; with max_loras=2 the third
adapter waits and the worker's resident set turns over (LRU) without changing any output; the
prefix cache never hands one adapter's KV blocks to another; what is not implemented is refused.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import trio
from hf_reference import hf_greedy

from trillm import LLM, LoRARequest, SamplingParams, open_engine
from trillm.engine.preprocess import InvalidRequestError
from trillm.testing.lora_adapters import build_peft_adapter, peft_greedy

MAX_NEW = 8
PROMPTS = ["In the beginning", "The license grants you the right to", "A", "Copyright holders"]
ENGINE = dict(max_model_len=256, kv_cache_memory="8MiB", distributed_executor_backend="uni")


@pytest.fixture(scope="module")
def adapters(tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory("qwen2")
    root = tmp_path_factory.mktemp("adapters")
    paths = {
        "all": build_peft_adapter(model, root / "all", seed=1),
        "attn-rslora": build_peft_adapter(
            model,
            root / "attn",
            seed=2,
            rank=4,
            targets=["q_proj", "v_proj", "o_proj"],
            use_rslora=True,
        ),
        "mlp": build_peft_adapter(
            model,
            root / "mlp",
            seed=3,
            rank=16,
            alpha=8,
            targets=["gate_proj", "up_proj", "down_proj"],
        ),
    }
    return model, {name: str(p) for name, p in paths.items()}


@pytest.fixture(scope="module")
def references(adapters):
    """name (None: base) -> prompt -> transformers(+PEFT) greedy tokens."""
    model, paths = adapters
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = [tok.encode(p) for p in PROMPTS]
    refs: dict[str | None, dict[str, list[int]]] = {
        None: {p: hf_greedy(model, i, MAX_NEW) for p, i in zip(PROMPTS, ids)}
    }
    for name, path in paths.items():
        refs[name] = dict(zip(PROMPTS, peft_greedy(model, path, ids, MAX_NEW)))
    for name in paths:  # each adapter changes the output, so the test can fail
        assert refs[name] != refs[None]
    return refs


def _lora(paths, name):
    if name is None:
        return None
    return LoRARequest(name, list(paths).index(name) + 1, paths[name])


def _params():
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _batch_equals_peft(llm, jobs, paths, references):
    """(prompt, adapter name or None) jobs in one generate call: each output equals
    transformers(+PEFT)'s greedy tokens."""
    outs = llm.generate(
        [p for p, _ in jobs],
        _params(),
        use_tqdm=False,
        lora_request=[_lora(paths, n) for _, n in jobs],
    )
    for (prompt, name), out in zip(jobs, outs, strict=True):
        assert out.outputs[0].token_ids == references[name][prompt], (prompt, name)


@pytest.fixture(scope="module")
def llm(adapters):
    with LLM(adapters[0], enable_lora=True, max_loras=3, **ENGINE) as engine:
        yield engine


def test_mixed_batch_equals_peft_and_single_runs(adapters, references, llm):
    """Three adapters and the base model in one generate call (one batch), each request equal
    to transformers + PEFT and to its own run alone."""
    _, paths = adapters
    jobs = [(p, n) for p in PROMPTS for n in [None, *paths]]
    _batch_equals_peft(llm, jobs, paths, references)
    for prompt, name in jobs[:5]:
        alone = llm.generate(prompt, _params(), use_tqdm=False, lora_request=_lora(paths, name))
        assert alone[0].outputs[0].token_ids == references[name][prompt]


def test_more_adapters_than_max_loras_wait_and_rotate(adapters, references):
    """max_loras=2, three adapters at once: the third waits for a free slot, the worker evicts
    the least recently used adapter, every output still equals PEFT's."""
    model, paths = adapters
    jobs = [(p, n) for p in PROMPTS[:2] for n in [*paths, None]] * 2
    with LLM(model, enable_lora=True, max_loras=2, **ENGINE) as llm:
        _batch_equals_peft(llm, jobs, paths, references)


def test_pp2_mixed_batch_equals_peft(adapters, references):
    """Pipeline parallelism (issue 14): each stage attaches the adapters' A/B of its own layers
    only; a batch mixing the three adapters and the base model over two stages equals
    transformers + PEFT."""
    model, paths = adapters
    jobs = [(p, n) for p in PROMPTS[:2] for n in [None, *paths]]
    engine = {**ENGINE, "distributed_executor_backend": "mp"}
    with LLM(model, enable_lora=True, max_loras=3, pipeline_parallel_size=2, **engine) as llm:
        _batch_equals_peft(llm, jobs, paths, references)


@pytest.mark.parametrize("pp", [1, 2])
def test_tp2_mixed_batch_equals_peft(adapters, references, pp):
    """Tensor parallelism (issue 14), alone and with two pipeline stages: each rank holds its
    part of every adapter (q/k/v/gate/up: B's rows of its heads / columns; o/down: A's
    columns, the partial deltas summed by the base layer's all-reduce); a batch mixing the
    three adapters and the base model equals transformers + PEFT."""
    model, paths = adapters
    jobs = [(p, n) for p in PROMPTS[:2] for n in [None, *paths]]
    engine = {**ENGINE, "distributed_executor_backend": "mp"}
    with LLM(
        model,
        enable_lora=True,
        max_loras=3,
        tensor_parallel_size=2,
        pipeline_parallel_size=pp,
        **engine,
    ) as llm:
        _batch_equals_peft(llm, jobs, paths, references)


def test_prefix_cache_is_not_shared_across_adapters(adapters, llm):
    _, paths = adapters
    prompt = "word " * 40  # several blocks of 16

    def run(name):
        return llm.generate(prompt, _params(), use_tqdm=False, lora_request=_lora(paths, name))[0]

    first_a, other, base, again_a = run("all"), run("mlp"), run(None), run("all")
    assert first_a.num_cached_tokens == 0
    assert other.num_cached_tokens == 0  # same tokens, another adapter: no block shared
    assert base.num_cached_tokens == 0
    assert again_a.num_cached_tokens >= 32  # the same adapter does hit its own blocks
    assert again_a.outputs[0].token_ids == first_a.outputs[0].token_ids
    assert other.outputs[0].token_ids != first_a.outputs[0].token_ids


def _variant(tmp_path, src: str, **config_changes) -> str:
    dst = tmp_path / "variant"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(config_changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias='all'"),
        ({"r": 64}, "exceeds max_lora_rank=16"),
        ({"target_modules": ["q_proj", "lm_head"]}, "lm_head"),
        ({"target_modules": ".*proj"}, "target_modules must be a list"),
        ({"peft_type": "IA3"}, "IA3"),
    ],
)
def test_unimplemented_adapters_are_refused_naming_it(adapters, llm, tmp_path, changes, named):
    _, paths = adapters
    bad = _variant(tmp_path, paths["all"], **changes)
    with pytest.raises(InvalidRequestError, match=re.escape(named)):
        llm.generate(
            "x", _params(), use_tqdm=False, lora_request=LoRARequest("bad", 100 + len(named), bad)
        )
    ok = llm.generate("A", _params(), use_tqdm=False, lora_request=_lora(paths, "all"))
    assert ok[0].outputs[0].token_ids  # the engine goes on serving


def test_adapter_for_another_model_and_lora_off_are_refused(adapters, tiny_model_factory):
    from trillm.config import EngineArgs
    from trillm.engine.config_builder import build_config
    from trillm.lora.peft import LoRAAdapterError, check_adapter

    model, paths = adapters
    other = build_config(EngineArgs(tiny_model_factory("llama"), max_model_len=256)).model
    with pytest.raises(LoRAAdapterError, match="do not fit the model"):
        check_adapter(paths["all"], other, 16)  # llama's head_dim 32: q/k/v shapes differ

    async def main():
        async with open_engine(model, **ENGINE) as engine:
            with pytest.raises(InvalidRequestError, match="enable_lora"):
                async with engine.generate("x", _params(), lora_request=_lora(paths, "all")):
                    pass

    trio.run(main)
    with pytest.raises(ValueError, match="max_loras"):
        LLM(model, enable_lora=True, max_loras=0, **ENGINE)


def test_admission_holds_the_adapter_too_many_until_one_is_free():
    """Engine-core side: max_loras=1; a second adapter waits (arrival order kept), an abort
    of a held request ends it there, a finished request frees its adapter."""
    from trillm.lora.admission import LoRAAdmission
    from trillm.messages import EngineCoreRequest, NewRequestData

    def req(rid, lora_id):
        lora = None if lora_id is None else LoRARequest(f"l{lora_id}", lora_id, "/p")
        return EngineCoreRequest(rid, [1], SamplingParams(), 0.0, lora_request=lora)

    gate = LoRAAdmission(max_loras=1)
    assert gate.offer(req("a", 1)) and gate.offer(req("base", None))
    assert not gate.offer(req("b", 2)) and not gate.offer(req("c", 3))
    assert not gate.offer(req("a2", 1))  # behind the held ones: arrival order
    assert gate.abort_held(["c", "zzz"]) == ["c"]
    assert gate.release(lambda rid: True) == []  # "a" still runs
    assert [r.request_id for r in gate.release(lambda rid: rid != "a")] == ["b"]
    news = [
        NewRequestData("b", [1], [], SamplingParams(), [], 0),
        NewRequestData("base", [1], [], SamplingParams(), [], 0),
    ]
    gate.attach(news)
    assert news[0].lora_request == LoRARequest("l2", 2, "/p") and news[1].lora_request is None
    assert gate.has_held  # a2 waits for adapter 2 to finish
    assert [r.request_id for r in gate.release(lambda rid: False)] == ["a2"]


def test_admission_counts_adapters_running_and_waiting():
    """What lora_requests_info shows: adapter name -> requests among the scheduler's running
    and waiting ids, the held ones waiting too; base-model and finished requests not at all."""
    from trillm.lora.admission import LoRAAdmission
    from trillm.messages import EngineCoreRequest

    def req(rid, lora_id):
        lora = None if lora_id is None else LoRARequest(f"l{lora_id}", lora_id, "/p")
        return EngineCoreRequest(rid, [1], SamplingParams(), 0.0, lora_request=lora)

    gate = LoRAAdmission(max_loras=2)
    for r in (req("a", 1), req("a2", 1), req("b", 2), req("base", None), req("c", 3)):
        gate.offer(r)  # "c" is held: two adapters already
    running, waiting = gate.adapter_counts(["a", "base", "b"], ["a2"])
    assert running == {"l1": 1, "l2": 1}
    assert waiting == {"l1": 1, "l3": 1}
    assert gate.adapter_counts([], []) == ({}, {"l3": 1})
    gate.release(lambda rid: rid not in ("b",))  # b ends: c is admitted
    assert gate.adapter_counts(["a", "c"], ["a2"]) == ({"l1": 1, "l3": 1}, {"l1": 1})
    # Several engine cores (data parallelism): the gauge shows their adapters together.
    from trillm.engine.dp_router import sum_stats
    from trillm.messages import SchedulerStats

    total = sum_stats(
        [
            SchedulerStats(running_lora_adapters={"l1": 1}),
            SchedulerStats(
                running_lora_adapters={"l1": 2, "l0": 1}, waiting_lora_adapters={"l3": 1}
            ),
        ]
    )
    assert (total.running_lora_adapters, total.waiting_lora_adapters) == (
        {"l0": 1, "l1": 3},
        {"l3": 1},
    )


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_other_decoders_equal_peft(arch, tiny_model_factory, tmp_path):
    """Llama (head_dim != hidden / heads) and Gemma (gelu MLP, scaled embeddings): base and
    adapter rows in one batch, each equal to transformers(+PEFT)."""
    model = tiny_model_factory(arch)
    adapter = str(build_peft_adapter(model, tmp_path / "a", seed=4, magnitude=0.6))
    with LLM(model, enable_lora=True, **ENGINE) as llm:
        ids = llm.get_tokenizer().encode(PROMPTS[1])
        lora = LoRARequest("a", 1, adapter)
        outs = llm.generate([PROMPTS[1]] * 2, _params(), use_tqdm=False, lora_request=[lora, None])
    want = peft_greedy(model, adapter, [ids], MAX_NEW)[0]
    assert want != hf_greedy(model, ids, MAX_NEW)
    assert outs[0].outputs[0].token_ids == want
    assert outs[1].outputs[0].token_ids == hf_greedy(model, ids, MAX_NEW)


def test_lora_on_an_architecture_without_it_is_refused(tiny_model_factory):
    with pytest.raises(ValueError, match="LoRA is not implemented for GPTNeoXForCausalLM"):
        LLM(tiny_model_factory("gpt_neox"), enable_lora=True, **ENGINE)
