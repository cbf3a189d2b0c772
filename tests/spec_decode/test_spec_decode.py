"""Speculative decoding, the fast parts: the n-gram proposer, ``speculative_config`` parsing,
the verification rule's output distribution (a chi-square test over seeded samples), and the
engine core's draft counters and rollback over both scheduler twins (a stub executor that
accepts a chosen number of drafts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trio
from grammar_manager import grammar_manager
from scheduler_twin_helpers import IMPL_NAMES, InProcessStubExecutor, ecr, get_impl, make_scheduler

from trillm.config import EngineArgs
from trillm.engine.core import EngineCore
from trillm.messages import ModelRunnerOutput, SchedulerOutput
from trillm.sample.sampler import Sampler, SamplingState
from trillm.sampling_params import SamplingParams
from trillm.spec_decode.backoff import FIRST_PAUSE, MAX_PAUSE, SpecBackoff
from trillm.spec_decode.config import SpeculativeConfig, parse_speculative_config
from trillm.spec_decode.ngram import NgramProposer, find_ngram_drafts
from trillm.worker.spec_verify import expand_rows, num_accepted

# ---------------------------------------------------------------- the n-gram search


def drafts(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    return find_ngram_drafts(np.asarray(tokens, dtype=np.int32), lo, hi, k)


def test_ngram_continues_the_first_earlier_occurrence_of_the_longest_suffix():
    #          0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 1, 6, 7]
    # Suffix (6, 7) occurs at 1 and 6: the first is continued -> 8, 9, 1.
    assert drafts(tokens, 1, 2, 3) == [8, 9, 1]
    # n=3 is tried first: (1, 6, 7) occurs at 5 -> 2, 1.
    assert drafts(tokens, 2, 3, 2) == [2, 1]
    assert drafts(tokens, 2, 2, 2) == [8, 9]
    # (8, 9, 1, 6, 7) never occurred before: nothing below n=3 is allowed.
    assert drafts([8, 9, 1, 6, 7, 4, 4], 3, 3, 2) == []
    assert drafts([1, 2, 3], 1, 3, 0) == []


def test_ngram_matches_whole_tokens_not_bytes_across_them():
    # 0x01000000 then 0x00000002 contain the bytes of 0x00000200... no whole-token match:
    # the byte search hits unaligned positions and must skip them.
    a, b = 0x02000001, 0x00000100
    # Little-endian bytes of a, b: 01 00 00 02 | 00 01 00 00; 0x00010002 is 02 00 01 00, found
    # at byte 3 (unaligned) before its whole-token occurrence at index 3.
    tokens = [a, b, 7, 0x00010002, 9, 0x00010002]
    assert drafts(tokens, 1, 1, 2) == [9, 0x00010002]
    assert drafts([a, b, 0x00010002], 1, 1, 2) == []


def test_proposer_caps_drafts_and_skips_history_dependent_sampling():
    cfg = SpeculativeConfig("ngram", 4, 1, 2)
    proposer = NgramProposer(cfg, max_model_len=64)

    class R:
        def __init__(self, rid, out, **params):
            self.request_id = rid
            self.all_token_ids = [1, 2, 3, 4, 5, 1, 2] + out
            self.num_tokens = len(self.all_token_ids)
            self.num_output_tokens = len(out)
            self.sampling_params = SamplingParams(**params)
            self.max_tokens = self.sampling_params.max_tokens

    got = proposer.propose(
        [
            R("free", [], max_tokens=10),
            R("near_end", [], max_tokens=2),
            R("penalty", [], max_tokens=10, presence_penalty=0.5),
            R("min_tokens", [], max_tokens=10, min_tokens=2),
            R("at_end", [], max_tokens=1),
        ]
    )
    # near_end: 2 tokens left, the step's own token is one of them -> 1 draft.
    assert got == {"free": [3, 4, 5, 1], "near_end": [3]}


# ---------------------------------------------------------------- speculative_config


def test_speculative_config_parsing_and_defaults():
    assert parse_speculative_config(None) is None
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert cfg == SpeculativeConfig("ngram", 3, 5, 5)  # vLLM's 5..5 when neither is given
    cfg = parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}
    )
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (4, 4)
    # As vLLM: a model without a method is a draft model; "[ngram]" names the n-gram method.
    cfg = parse_speculative_config({"model": "/m", "num_speculative_tokens": 3})
    assert cfg == SpeculativeConfig("draft_model", 3, model="/m")
    cfg = parse_speculative_config({"model": "[ngram]", "num_speculative_tokens": 3})
    assert cfg == SpeculativeConfig("ngram", 3, 5, 5)


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ('{"method": "draft_model", "num_speculative_tokens": 2}', 'needs "model"'),
        (
            '{"model": "x", "num_speculative_tokens": 2, "prompt_lookup_min": 2}',
            "prompt_lookup_min are not supported with draft_model",
        ),
        ('{"method": "medusa", "model": "x", "num_speculative_tokens": 2}', "medusa"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', 'eagle needs "model"'),
        (
            '{"method": "mlp_speculator", "model": "x", "num_speculative_tokens": 2}',
            "'mlp_speculator'",
        ),
        (
            '{"method": "mtp", "model": 3, "num_speculative_tokens": 2}',
            'mtp "model" must be a folder',
        ),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 99}', "<= 32"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 2}',
            "prompt_lookup_min (4)",
        ),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}',
            "draft_tensor_parallel_size",
        ),
        ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens"),
        ("[1]", "JSON object"),
        ("{nope", "not valid JSON"),
    ],
)
def test_speculative_config_refused_with_the_reason(value, named):
    with pytest.raises(ValueError, match="speculative_config") as exc:
        EngineArgs(speculative_config=value)
    assert named in str(exc.value)


# ---------------------------------------------------------------- the verification rule


def verify(p0: np.ndarray, p1: np.ndarray, draft: list[int], seeds: range, exact: bool = True):
    """Each seed: one request whose 3 drafted positions have target distributions p0, p1, p1;
    returns the emitted runs. ``exact=False`` is a wrong rule (on a rejection, a fresh draw
    from p that may repeat the draft), to show the test can fail."""
    vocab, n = len(p0), len(seeds)
    state = SamplingState(n, vocab, "cpu")
    for slot, seed in enumerate(seeds):
        state.add_request(slot, SamplingParams(temperature=1.0, seed=seed), [0], [])
    logits = torch.log(torch.tensor(np.stack([p0, p1, p1]), dtype=torch.float32))  # [3, V]
    rows, owner, offset = expand_rows(np.arange(n) * 3 + 2, np.full(n, 2))
    sampled = Sampler()(logits[rows % 3], state, torch.from_numpy(owner), None, offset.tolist())
    ys = sampled.sampled_token_ids.view(n, 3).tolist()
    runs = []
    for i, y in enumerate(ys):
        a = num_accepted(y, draft)
        if not exact and a == 0:
            g = torch.Generator().manual_seed(10_000 + i)
            y = [int(torch.multinomial(torch.from_numpy(p0), 1, generator=g))]
        runs.append(y[: a + 1])
    return runs


def chi_square(counts: np.ndarray, p: np.ndarray) -> float:
    expected = p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# df = 5 (six tokens): the 0.999 quantile; deterministic seeds make the statistic fixed.
CHI2_CRIT_DF5 = 20.515


def test_verification_keeps_the_target_distribution():
    p0 = np.array([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
    p1 = np.array([0.05, 0.10, 0.40, 0.15, 0.20, 0.10])
    draft = [0, 2]  # p0(draft0) = 0.3, p1(draft1) = 0.4
    runs = verify(p0, p1, draft, range(6000))
    first = np.bincount([r[0] for r in runs], minlength=6)
    assert chi_square(first, p0) < CHI2_CRIT_DF5
    accepted = [r for r in runs if len(r) > 1]
    assert abs(len(accepted) / len(runs) - p0[0]) < 0.02  # acceptance = p(draft)
    second = np.bincount([r[1] for r in accepted], minlength=6)
    assert chi_square(second, p1) < CHI2_CRIT_DF5  # given the accepted draft, p1 again
    # A rejected first draft: the token comes from p0 without the draft, renormalized.
    rejected = np.bincount([r[0] for r in runs if len(r) == 1], minlength=6)
    assert rejected[0] == 0
    q = p0.copy()
    q[0] = 0
    assert chi_square(rejected[1:], q[1:] / q.sum()) < 18.467  # df = 4, 0.999


def test_the_distribution_test_fails_a_wrong_rule():
    p0 = np.array([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
    runs = verify(p0, p0, [0, 0], range(6000), exact=False)
    first = np.bincount([r[0] for r in runs], minlength=6)
    assert chi_square(first, p0) > 10 * CHI2_CRIT_DF5


def test_seeded_verification_emits_what_sampling_one_at_a_time_emits():
    """Per-request seeds stay reproducible: row j draws the noise of output position j."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(50), size=4)  # [4, V] four positions
    logits = torch.log(torch.tensor(p, dtype=torch.float32))
    one = SamplingState(1, 50, "cpu")
    one.add_request(0, SamplingParams(temperature=1.0, seed=123), [0], [])
    plain = []
    for j in range(4):
        t = int(Sampler()(logits[j : j + 1], one, torch.tensor([0])).sampled_token_ids[0])
        plain.append(t)
        one.append_token(0, t)
    state = SamplingState(1, 50, "cpu")
    state.add_request(0, SamplingParams(temperature=1.0, seed=123), [0], [])
    out = Sampler()(logits, state, torch.zeros(4, dtype=torch.long), None, [0, 1, 2, 3])
    assert out.sampled_token_ids.tolist() == plain


# ---------------------------------------------------------------- engine core counters


class StubExecutor(InProcessStubExecutor):
    """Accepts ``accept[req_id]`` drafts of each verified run (then a token not among them)."""

    def __init__(self, accept: dict[str, int], own: dict[str, int]) -> None:
        self.accept = accept
        self.own = own
        self.sched: SchedulerOutput | None = None
        self.runs: list[tuple[str, list[int], list[int]]] = []

    async def execute_model(self, sched: SchedulerOutput) -> None:
        self.sched = sched

    async def sample_tokens(self, req) -> ModelRunnerOutput:
        sched = self.sched
        assert sched is not None
        ids, sampled = [], []
        for req_id in sched.num_scheduled_tokens:
            d = sched.scheduled_spec_decode_tokens.get(req_id, [])
            a = min(self.accept.get(req_id, 0), len(d))
            run = d[:a] + [self.own[req_id]]  # a token seen before: drafts keep coming
            self.runs.append((req_id, d, run))
            ids.append(req_id)
            sampled.append(run)
        return ModelRunnerOutput(sched.step_id, ids, sampled)


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_engine_core_counts_drafts_and_rolls_back(impl_name):
    sched = make_scheduler(get_impl(impl_name), block_size=4)
    executor = StubExecutor({"a": 2, "b": 0}, {"a": 1, "b": 5})
    proposer = NgramProposer(SpeculativeConfig("ngram", 3, 1, 1), 256)
    core = EngineCore(sched, executor, grammar_manager(), proposer=proposer)
    # A prompt that repeats: the proposer always finds the last token earlier.
    core.handle_input(ecr("a", [1, 2, 3, 4, 1, 2, 3, 4, 1], max_tokens=12))
    core.handle_input(ecr("b", [5, 6, 7, 5, 6, 7, 5], max_tokens=12))

    async def run():
        while sched.has_unfinished_requests():
            await core.step()

    trio.run(run)
    verified = [(rid, d, run) for rid, d, run in executor.runs if d]
    stats = core.spec_stats
    assert stats.num_drafts == len(verified) > 4
    assert stats.num_draft_tokens == sum(len(d) for _, d, _ in verified)
    assert stats.num_accepted_tokens == sum(len(run) - 1 for _, _, run in verified)
    per_pos = [sum(1 for _, _, run in verified if len(run) - 1 > i) for i in range(3)]
    assert stats.num_accepted_tokens_per_pos == per_pos and per_pos[2] == 0
    assert per_pos[0] == sum(1 for rid, _, _ in verified if rid == "a")  # b accepts none
    # Every request got exactly max_tokens tokens: the scheduler cut the last run.
    for req_id in "ab":
        got = [t for rid, _, run in executor.runs if rid == req_id for t in run]
        assert len(got) >= 12
    assert core._stats().spec_decoding == stats


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_rejected_drafts_are_never_prefix_cached(impl_name):
    """Drafts fill a block, all are rejected: only verified tokens' blocks get hashes."""
    sched = make_scheduler(get_impl(impl_name), block_size=4)
    sched.add_request(ecr("a", [1, 2, 3, 4, 5, 6], max_tokens=10))
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(out.step_id, ["a"], [[7]]))
    sched.update_draft_token_ids({"a": [8, 9, 10]})  # with 7: positions 6..9, past block 1
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [8, 9, 10]}
    sched.update_from_output(out, ModelRunnerOutput(out.step_id, ["a"], [[11]]))
    req = sched.get_request("a")
    assert (req.num_computed_tokens, req.num_tokens) == (7, 8)
    kv = sched.kv_cache_manager
    assert kv.num_cached_blocks_total() == 1  # block 0 only: block 1 holds rejected drafts' KV


# ---------------------------------------------------------------- back-off


def test_backoff_rule_shrinks_pauses_doubles_and_resets():
    b = SpecBackoff(4)
    assert b.limit("r") == 4
    b.record("r", 4, 2)  # two right: propose about that far
    assert b.limit("r") == 3
    b.record("r", 3, 3)  # all right: grow back one at a time
    assert b.limit("r") == 4
    b.record("r", 4, 0)
    assert b.limit("r") == 1
    b.record("r", 1, 0)  # PATIENCE misses in a row: FIRST_PAUSE opportunities without drafts
    assert [b.limit("r") for _ in range(FIRST_PAUSE + 1)] == [0] * FIRST_PAUSE + [1]
    b.record("r", 1, 0)  # the probe fails: a pause twice as long, at once
    assert [b.limit("r") for _ in range(2 * FIRST_PAUSE + 1)] == [0] * 2 * FIRST_PAUSE + [1]
    for _ in range(10):  # never longer than MAX_PAUSE
        b.record("r", 1, 0)
        pauses = 0
        while b.limit("r") == 0:
            pauses += 1
    assert pauses == MAX_PAUSE
    b.record("r", 1, 1)  # one accepted draft: growth again, and the next pause is short
    assert b.limit("r") == 2
    b.record("r", 2, 0)
    b.record("r", 1, 0)
    assert [b.limit("r") for _ in range(FIRST_PAUSE + 1)] == [0] * FIRST_PAUSE + [1]
    b.retain(set())
    assert b.limit("r") == 4  # a finished request's state is gone


@pytest.mark.parametrize("impl_name", IMPL_NAMES)
def test_engine_core_backs_off_a_request_whose_drafts_keep_failing(impl_name):
    """n-gram drafts for "b" always find a match and are always rejected: after the back-off
    it proposes about one draft per MAX_PAUSE steps, while "a" (all accepted) keeps k."""
    sched = make_scheduler(get_impl(impl_name), block_size=4)
    executor = StubExecutor({"a": 3, "b": 0}, {"a": 1, "b": 5})
    proposer = NgramProposer(SpeculativeConfig("ngram", 3, 1, 1), 512)
    core = EngineCore(sched, executor, grammar_manager(), proposer=proposer)
    core.handle_input(ecr("a", [1, 2, 3, 4, 1, 2, 3, 4, 1], max_tokens=120))
    core.handle_input(ecr("b", [5, 6, 7, 5, 6, 7, 5], max_tokens=200))

    async def run():
        while sched.has_unfinished_requests():
            await core.step()

    trio.run(run)
    b_steps = [d for rid, d, _ in executor.runs if rid == "b"]
    b_drafted = [len(d) for d in b_steps]
    # Without back-off every one of b's ~200 steps would verify 3 drafts.
    assert len(b_steps) >= 190
    # The prompt, k, then 1; pauses of 4, 8, 16, then 32 opportunities, each ended by a
    # probe of one draft.
    expected = [0, 3, 1]
    pause = FIRST_PAUSE
    while len(expected) < len(b_steps):
        expected += [0] * pause + [1]
        pause = min(MAX_PAUSE, 2 * pause)
    assert b_drafted == expected[: len(b_steps)]
    assert sum(b_drafted) <= 12  # of ~600 without the back-off
    a_drafted = [len(d) for rid, d, _ in executor.runs if rid == "a"]
    assert all(n == 3 for n in a_drafted[1:-2])  # the first step is the prompt; the end is cut
