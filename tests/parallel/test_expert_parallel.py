"""Expert parallelism (``--enable-expert-parallel``): each of the 2 tensor-parallel ranks holds
half of the experts whole, tokens sent to them and back by all-to-all
(trillm/distributed/expert_parallel.py). Greedy tokens equal the single-rank engine's and
log-probs are within 1e-4 of it on Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 (whose
single-rank engine equals transformers: tests/models/), and with two pipeline stages of two
ranks (each stage's experts over its own ranks) on Mixtral, Qwen3-MoE and DeepSeek-V2.

The routed experts' intermediate sizes here are odd, which tensor parallelism without expert
parallelism refuses (it splits each expert's intermediate size over the ranks): these engines
run only because each rank holds its experts whole. One prompt alone decodes one token per
step, fewer than the ranks, so rank 1 dispatches none of its own (an empty slice).
The dispatch over two engine cores' ranks (each with its own tokens, one idle) is checked
at the all-to-all level here and through the engine in test_expert_parallel_dp.py. What is
not supported is refused by name before any worker starts.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
from expert_parallel_models import LOGPROB_TOL, ODD_EXPERTS, tokens_and_logprobs
from parallel_models import LIMITS, PROMPTS

from trillm.distributed import parallel_state
from trillm.engine.llm import LLM
from trillm.testing.tiny_deepseek import build_tiny_deepseek


def assert_ep_matches_one_rank(path: str, prompt_sets: list[list[str]], **parallel) -> None:
    """``parallel``: more engine arguments than tensor_parallel_size=2 (pipeline stages)."""
    with LLM(path, distributed_executor_backend="uni", **LIMITS) as llm:
        expected = [tokens_and_logprobs(llm, prompts) for prompts in prompt_sets]
    # a reference that repeats one token could not tell a misplaced expert apart
    assert all(len(set(tokens)) > 1 for tokens, _ in expected[0]), expected
    layout = {"tensor_parallel_size": 2, **parallel}
    with LLM(path, enable_expert_parallel=True, **layout, **LIMITS) as llm:
        got = [tokens_and_logprobs(llm, prompts) for prompts in prompt_sets]
    for got_set, expected_set in zip(got, expected):
        assert [t for t, _ in got_set] == [t for t, _ in expected_set]
        diff = max(
            abs(a - b)
            for (_, got_lp), (_, ref_lp) in zip(got_set, expected_set)
            for a, b in zip(got_lp, ref_lp)
        )
        assert diff < LOGPROB_TOL, diff


@pytest.mark.parametrize("arch", sorted(ODD_EXPERTS))
def test_ep2_matches_one_rank(tiny_model_factory, arch):
    path = tiny_model_factory(arch, num_hidden_layers=2, **ODD_EXPERTS[arch])
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide"):
        LLM(path, tensor_parallel_size=2, **LIMITS)  # each expert split: refused
    assert_ep_matches_one_rank(path, [PROMPTS, PROMPTS[:1]])


def test_deepseek_v3_ep2_matches_one_rank(tmp_path):
    """DeepSeek-V3's own router (grouped top-k, noaux_tc), 8 routed experts of odd
    intermediate size, the 2 shared experts (one MLP of 62) tensor-parallel."""
    path = build_tiny_deepseek(
        "v3", tmp_path, num_hidden_layers=2, moe_intermediate_size=31, n_shared_experts=2
    )
    assert_ep_matches_one_rank(str(path), [PROMPTS])


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v2"])
def test_tp2_x_pp2_ep_matches_one_rank(tiny_model_factory, tmp_path, arch):
    """Two pipeline stages of two ranks: each stage's experts spread over its own two ranks
    (4 ranks in all, every stage holding a mixture-of-experts layer: DeepSeek-V2 gets 4
    layers, its first dense)."""
    if arch == "deepseek_v2":
        path = str(
            build_tiny_deepseek(
                "v2", tmp_path, num_hidden_layers=4, moe_intermediate_size=31, n_shared_experts=2
            )
        )
    else:
        path = tiny_model_factory(arch, num_hidden_layers=2, **ODD_EXPERTS[arch])
    assert_ep_matches_one_rank(path, [PROMPTS[:2]], pipeline_parallel_size=2)


@pytest.mark.parametrize(
    ("flags", "ranks"), [(["-tp", "2"], 2), (["-pp", "2", "-tp", "2"], 4)], ids=["tp2", "pp2xtp2"]
)
def test_metrics_show_each_ranks_expert_load(tiny_model_factory, tmp_path, flags, ranks):
    """``trillm serve -tp 2 --enable-expert-parallel`` (and with two pipeline stages, whose
    ranks are labelled by global rank: stage s's rank r is s x 2 + r): /metrics counts the
    pairs routed to each rank's experts; over the ranks, top_k (2) x MoE layers (2) x the
    tokens the model computed (every prompt token, and every generated token but each
    request's last). With two stages each rank holds one layer's experts, so a stage's
    counts lost on the way would halve the sum."""
    import httpx
    from parallel_reference import limit_flags
    from server_harness import ServerProcess

    path = tiny_model_factory("mixtral", num_hidden_layers=2, **ODD_EXPERTS["mixtral"])
    flags = [*flags, "--enable-expert-parallel", *limit_flags(LIMITS)]
    server = ServerProcess([path, *flags], tmp_path / "server.log").start()
    try:
        body = {"prompt": PROMPTS, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(server.base_url + "/completions", json=body, timeout=300)
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        metrics = httpx.get(server.url + "/metrics", timeout=60).text
    finally:
        server.stop()
    series = re.findall(
        r"^trillm:expert_parallel_routed_tokens_total\{(.*)\} (\S+)$", metrics, re.MULTILINE
    )
    per_rank = {re.search(r'rank="(\d+)"', labels)[1]: float(v) for labels, v in series}
    computed = usage["prompt_tokens"] + usage["completion_tokens"] - len(PROMPTS)
    assert set(per_rank) == {str(r) for r in range(ranks)}, per_rank
    assert min(per_rank.values()) > 0, per_rank
    assert sum(per_rank.values()) == 2 * 2 * computed, (per_rank, usage)
    assert "vllm:expert_parallel" not in metrics  # no vLLM name to mirror


def test_stage_loads_are_placed_by_global_rank():
    """The executor's step output under pipeline stages: each stage's first rank's counts at
    its ranks' global places, zeros for a stage without a mixture-of-experts layer (DeepSeek's
    dense first layers alone on stage 0); nothing without expert parallelism."""
    from trillm.executor.worker_steps import step_output
    from trillm.messages import ModelRunnerOutput

    def outputs(*loads: list[int]) -> list[ModelRunnerOutput]:
        return [ModelRunnerOutput(7, ["a"], [[1]], expert_load=load) for load in loads]

    assert step_output(outputs([3, 5], [3, 5], [2, 6], [2, 6]), 2).expert_load == [3, 5, 2, 6]
    assert step_output(outputs([], [], [4, 4], [4, 4]), 2).expert_load == [0, 0, 4, 4]
    assert step_output(outputs([], [], [], []), 2).expert_load == []
    assert step_output(outputs([1, 2], [1, 2]), 0).expert_load == [1, 2]  # one stage


def test_deepseek_shared_experts_must_still_split(tmp_path):
    """The shared experts stay tensor-parallel: one of 31 cannot be halved."""
    path = build_tiny_deepseek("v3", tmp_path, num_hidden_layers=2, moe_intermediate_size=31)
    with pytest.raises(ValueError, match=r"moe_intermediate_size x n_shared_experts=31"):
        LLM(str(path), tensor_parallel_size=2, enable_expert_parallel=True, **LIMITS)


@pytest.mark.parametrize(
    ("arch", "overrides", "parallel", "match"),
    [
        (
            "llama",
            {},
            {},
            r"enable_expert_parallel: expert parallelism does not support LlamaForCausalLM",
        ),
        (
            "mixtral",
            {"num_local_experts": 3},
            {},
            r"enable_expert_parallel: the model's 3 experts do not split evenly over "
            r"tensor_parallel_size=2",
        ),
        (
            "mixtral",
            {},
            {"data_parallel_size": 2, "pipeline_parallel_size": 2},
            r"enable_expert_parallel with data_parallel_size > 1 and pipeline_parallel_size > 1 "
            r"is not implemented",
        ),
        (
            "mixtral",
            {"num_local_experts": 6},
            {"data_parallel_size": 2},
            r"enable_expert_parallel: the model's 6 experts do not split evenly over "
            r"data_parallel_size=2 x tensor_parallel_size=2 = 4 ranks",
        ),
    ],
    ids=["dense", "experts-not-divisible", "dp-x-pp", "experts-not-divisible-over-cores"],
)
def test_what_expert_parallelism_cannot_do_is_refused(
    tiny_model_factory, arch, overrides, parallel, match
):
    path = tiny_model_factory(arch, num_hidden_layers=2, **overrides)
    with pytest.raises(ValueError, match=match):
        LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, **parallel, **LIMITS)


@pytest.mark.parametrize(
    "argv",
    [
        ["--enable-eplb"],
        ["--eplb-config", '{"window_size": 1000}'],
        ["--num-redundant-experts", "2"],
        ["--all2all-backend", "naive"],
        ["--expert-placement-strategy", "round_robin"],
    ],
    ids=lambda a: a[0],
)
def test_load_balancer_flags_are_refused(argv, capsys):
    from trillm.entrypoints.cli.main import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert argv[0] in err and "not implemented yet" in err, err


def test_the_flag_and_linear_placement_parse(capsys):
    from trillm.entrypoints.cli.main import build_parser

    args = build_parser().parse_args(["serve", "-ep", "--expert-placement-strategy", "linear"])
    assert args.enable_expert_parallel is True


def test_each_rank_reads_only_its_experts(tiny_model_factory):
    """Rank r of 2 reads experts [4r, 4r + 4) of Qwen3-MoE's 8, whole; the fused
    ``[E, ...]`` tensors give it the same block; every other tensor is read as under TP."""
    from trillm.config import EngineArgs
    from trillm.distributed.sharding import RankShapes
    from trillm.model_executor.model_config import load_model_config

    path = tiny_model_factory("qwen3_moe", num_hidden_layers=2)
    cfg = load_model_config(EngineArgs(path))
    name = "model.layers.0.mlp.experts.{}.up_proj.weight"
    whole = torch.randn(32, 64)  # [I, H]
    fused = torch.randn(8, 64, 32)  # [E, 2I, H]
    for rank in (0, 1):
        shapes = RankShapes.of(cfg, rank, 2, expert_parallel=True)
        held = [e for e in range(8) if shapes.holds_expert(cfg, name.format(e))]
        assert held == list(range(4 * rank, 4 * rank + 4))
        assert torch.equal(shapes.read_shard(cfg, name.format(held[0]), whole), whole)
        block = shapes.read_shard(cfg, "model.layers.0.mlp.experts.gate_up_proj", fused)
        assert torch.equal(block, fused[4 * rank : 4 * rank + 4])
        assert shapes.holds_expert(cfg, "model.layers.0.mlp.gate.weight")
        tp_only = RankShapes.of(cfg, rank, 2)
        q = "model.layers.0.self_attn.q_proj.weight"
        q_weight = torch.randn(cfg.num_attention_heads * cfg.head_dim, 64)
        assert torch.equal(
            shapes.read_shard(cfg, q, q_weight), tp_only.read_shard(cfg, q, q_weight)
        )


def _dispatch_rank(rank: int, port: int, results) -> None:
    """Rank ``rank`` of 2 (a spawned process): its half of 4 random experts; puts each token
    count's assembled output and the reference's, its routed counts and the bytes it sent."""
    from trillm.distributed import parallel_state
    from trillm.distributed.expert_parallel import (
        ExpertPlacement,
        dispatch_combine,
        load,
        traffic,
    )
    from trillm.kernels.fused_moe_torch import fused_moe

    parallel_state.init_tensor_parallel(rank, 2, port, "cpu", 60.0, expert_parallel=True)
    try:
        gen = torch.Generator().manual_seed(0)  # the same draws on both ranks
        w13, w2 = torch.randn(4, 12, 8, generator=gen), torch.randn(4, 8, 6, generator=gen)
        placement = ExpertPlacement.current(4)
        held = slice(placement.start, placement.start + placement.per_rank)
        for tokens in (1, 5):
            x = torch.randn(tokens, 8, generator=gen)  # [T, H]
            weights = torch.rand(tokens, 2, generator=gen)  # [T, k]
            ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)])
            mine = dispatch_combine(
                placement, x, weights, ids, lambda r, w, i: fused_moe(r, w13[held], w2[held], w, i)
            )
            whole = parallel_state.get_tp_group().all_reduce(mine)
            results.put(
                (rank, tokens, whole.tolist(), fused_moe(x, w13, w2, weights, ids).tolist())
            )
        results.put((rank, "routed", load.take(), traffic.take()[0]))
    finally:
        parallel_state.destroy_tensor_parallel()


def test_dispatch_combine_over_two_gloo_ranks_equals_one_rank():
    """Every token's assembled output on both ranks equals the single-rank reference (1 token:
    rank 1 dispatches none of its own; 5 tokens: slices of 3 and 2); the pairs routed to each
    rank's experts add up to tokens x top_k; each rank sent bytes to the other."""
    import multiprocessing

    from server_harness import free_port

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    ranks = [ctx.Process(target=_dispatch_rank, args=(r, port, results)) for r in (0, 1)]
    for process in ranks:
        process.start()
    got = [results.get(timeout=120) for _ in range(6)]
    for process in ranks:
        process.join(60)
    assert [p.exitcode for p in ranks] == [0, 0]
    routed = {}
    for rank, what, first, second in got:
        if what == "routed":
            routed[rank] = first
            assert second > 0, rank  # bytes sent to the other rank
        else:
            torch.testing.assert_close(torch.tensor(first), torch.tensor(second))
    assert routed[0] == routed[1] and sum(routed[0]) == (1 + 5) * 2


# (core 0's tokens, core 1's) per step: both serving, then each idle while the other serves
CORE_STEPS = [(3, 2), (4, 0), (0, 1)]


def _core_rank(rank: int, port: int, results) -> None:
    """The single rank of engine core ``rank`` of 2 (a spawned process), the experts spread
    over both cores: each step it dispatches its own core's tokens (none when idle) and runs
    its half of 4 random experts on what either core sends it; puts its output and the
    reference's."""
    from trillm.distributed import parallel_state
    from trillm.distributed.expert_parallel import ExpertPlacement, dispatch_combine, load
    from trillm.kernels.fused_moe_torch import fused_moe

    parallel_state.init_tensor_parallel(rank, 2, port, "cpu", 60.0, expert_parallel=True)
    try:
        gen = torch.Generator().manual_seed(1)  # the same draws on both ranks
        w13, w2 = torch.randn(4, 12, 8, generator=gen), torch.randn(4, 8, 6, generator=gen)
        placement = ExpertPlacement(4, rank, 2, core=(0, 1))  # alone in its core
        held = slice(placement.start, placement.start + placement.per_rank)
        for step, tokens in enumerate(CORE_STEPS):
            drawn = []
            for count in tokens:  # both cores' inputs drawn on both ranks, each uses its own
                x = torch.randn(count, 8, generator=gen)
                weights = torch.rand(count, 2, generator=gen)
                picks = [torch.randperm(4, generator=gen)[:2] for _ in range(count)]
                ids = torch.stack(picks) if picks else torch.empty(0, 2, dtype=torch.long)
                drawn.append((x, weights, ids))
            x, weights, ids = drawn[rank]
            out = dispatch_combine(
                placement, x, weights, ids, lambda r, w, i: fused_moe(r, w13[held], w2[held], w, i)
            )
            expected = fused_moe(x, w13, w2, weights, ids) if len(x) else x
            results.put((rank, step, out.tolist(), expected.tolist()))
        results.put((rank, "routed", load.take(), None))
    finally:
        parallel_state.destroy_tensor_parallel()


def test_experts_over_two_cores_with_their_own_tokens_and_one_idle():
    """The dispatch the experts need when they span engine cores (vLLM's -dp with -ep): each
    core's rank dispatches its own core's tokens, and a core
    with none still takes part (an empty step) and runs its experts for the other: every
    core's output equals the single-rank reference on its own tokens, in steps where both
    serve and where either is idle; each core counts only its own tokens' pairs."""
    import multiprocessing

    from server_harness import free_port

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    ranks = [ctx.Process(target=_core_rank, args=(r, port, results)) for r in (0, 1)]
    for process in ranks:
        process.start()
    got = [results.get(timeout=120) for _ in range(2 * (len(CORE_STEPS) + 1))]
    for process in ranks:
        process.join(60)
    assert [p.exitcode for p in ranks] == [0, 0]
    for rank, step, out, expected in got:
        if step == "routed":
            assert sum(out) == 2 * sum(tokens[rank] for tokens in CORE_STEPS), (rank, out)
        else:
            assert len(out) == CORE_STEPS[step][rank], (rank, step)
            torch.testing.assert_close(torch.tensor(out), torch.tensor(expected))


def _rank_left_alone(core: int, store: str, results) -> None:
    """The single rank of engine core ``core`` of 2 in one expert world (``-dp 2 -ep``): core
    1 leaves once both have joined; core 0's all-to-all then fails and it puts the error."""
    from trillm.errors import CollectiveTimeoutError

    parallel_state.init_expert_world(core, 0, 2, 1, store, "cpu", 60.0)
    torch.distributed.barrier()
    if core == 1:
        os._exit(0)  # a dead rank: no clean leave
    time.sleep(0.5)
    try:
        parallel_state.get_ep_group().all_to_all(torch.zeros(2, 4), [1, 1], [1, 1])
        results.put("no error")
    except CollectiveTimeoutError as exc:
        results.put(str(exc))


def test_a_failed_exchange_names_the_expert_rank_and_its_core(tmp_path):
    """Under -dp N -ep the experts' group spans the cores: its error names the rank there and
    the engine core and rank it is (was: "Tensor-parallel rank 0", the rank in its core)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    store = str(tmp_path / "ranks")
    ranks = [ctx.Process(target=_rank_left_alone, args=(c, store, results)) for c in (0, 1)]
    for process in ranks:
        process.start()
    message = results.get(timeout=120)
    for process in ranks:
        process.join(60)
    assert message.startswith("Expert-parallel rank 0 (engine core 0, rank 0): all_to_all failed")
    assert parallel_state.expert_rank_label(1, 1, 2) == (
        "Expert-parallel rank 3 (engine core 1, rank 1)"
    )
