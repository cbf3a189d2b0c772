"""Speculative decoding with a draft model, end to end on tiny real checkpoints: a tiny target,
a draft that is the target's copy (every draft accepted), an even tinier random draft with the
same tokenizer (exact output all the same, and the back-off stops its drafts), and drafts
whose vocabulary is not the target's (refused by name before anything loads)."""

from __future__ import annotations

import json
import shutil

import pytest
from spec_compare import PROMPTS, SMALL, assert_same, run, stats

from trillm import LLM, SamplingParams
from trillm.spec_decode.backoff import MAX_PAUSE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# One layer, half the width: a draft that knows nothing of the target.
RANDOM_DRAFT = {
    "seed": 1,
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "head_dim": 16,
}


def draft_config(path: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def models(tiny_model_factory):
    return tiny_model_factory("llama"), tiny_model_factory("llama", **RANDOM_DRAFT)


@pytest.fixture(scope="module")
def engines(models):
    target, random_draft = models
    base = LLM(target, **SMALL)
    copy = LLM(target, speculative_config=draft_config(target), **SMALL)
    rand = LLM(target, speculative_config=draft_config(random_draft), **SMALL)
    yield base, copy, rand
    for engine in (base, copy, rand):
        engine.shutdown()


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(
    temperature=1.0, seed=7, top_k=50, max_tokens=30, ignore_eos=True, n=2, logprobs=1
)


def test_target_copy_as_draft_is_accepted_and_output_is_exact(engines, caplog):
    base, copy, _ = engines
    before = stats(copy)
    for x, y in zip(run(base, GREEDY), run(copy, GREEDY)):
        assert_same(x, y)
    after = stats(copy)
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    # 4 requests x 40 tokens; a step verifies 3 drafts + the target's own token.
    assert drafted >= 90
    assert accepted >= 0.95 * drafted  # the same model proposes what the target samples
    assert "failed to propose" not in caplog.text
    # Its own KV cache, in the same budget: the copy's layers as many again, half the blocks.
    assert copy.engine.num_blocks == base.engine.num_blocks // 2


def test_draft_and_verify_steps_replay_as_step_programs(engines, models):
    """The draft model's small steps and the target's verifying steps run as step programs:
    the same output as with --enforce-eager, replays checked, none given up."""
    target, _ = models
    copy = engines[1]
    eager = LLM(target, speculative_config=draft_config(target), enforce_eager=True, **SMALL)
    try:
        want = run(eager, GREEDY)
    finally:
        eager.shutdown()
    for x, y in zip(want, run(copy, GREEDY)):
        assert_same(x, y)
    runner = copy.engine.executors[0].runner
    for programs in (runner.step_programs, runner.drafter.step_programs):
        assert programs is not None and programs.reason is None
        assert any(p.checked for p in programs.programs.values())
    assert any(False in p.checked for p in runner.step_programs.programs.values())


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy-logprobs", "seeded-n2"])
def test_random_draft_output_is_exact(engines, params):
    base, _, rand = engines
    before = stats(rand).num_drafts
    for x, y in zip(run(base, params), run(rand, params)):
        assert_same(x, y)
    assert stats(rand).num_drafts > before  # the draft model really proposed


def test_seeded_sampling_with_the_copy_is_exact_and_accepts_drafts(engines):
    base, copy, _ = engines
    before = stats(copy).num_accepted_tokens
    for x, y in zip(run(base, SEEDED), run(copy, SEEDED)):
        assert_same(x, y)
    assert stats(copy).num_accepted_tokens > before


def test_backoff_stops_a_failing_draft_model(engines):
    """The random draft's drafts are rejected: after two misses a request pauses, so over 120
    tokens it drafts a few tokens, not 3 per step."""
    _, _, rand = engines
    before = stats(rand)
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    rand.generate(["hello"], params, use_tqdm=False)
    after = stats(rand)
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    if accepted == 0:  # k, 1, then one-draft probes after pauses of 4, 8, 16, 32, 32
        assert drafted <= 3 + 1 + 120 // MAX_PAUSE + 3
    assert drafted < 40  # without the back-off: ~3 per step


def test_draft_with_another_vocabulary_is_refused_by_name(models, tiny_model_factory, tmp_path):
    target, _ = models
    small_vocab = tiny_model_factory("llama", vocab_size=2048, num_hidden_layers=1)
    with pytest.raises(ValueError, match="vocabulary of 2048 tokens"):
        LLM(target, speculative_config=draft_config(small_vocab), **SMALL)
    # Same size, another tokenizer: two tokens swapped in the draft's vocabulary.
    other = tmp_path / "other-tokenizer"
    shutil.copytree(target, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="different tokenizer"):
        LLM(target, speculative_config=draft_config(str(other)), **SMALL)
    with pytest.raises(ValueError, match="draft model '/nonexistent/draft'"):
        LLM(target, speculative_config=draft_config("/nonexistent/draft"), **SMALL)


def test_small_budget_and_preemption_keep_output_exact(engines, models, caplog):
    """A step budget smaller than the prompts (the draft's catch-up spans steps) and a KV
    cache too small for every request at once (preempted requests come back to an empty draft
    cache): still the base output, and the copy's drafts still accepted."""
    base, _, _ = engines
    target, _ = models
    tight = {
        **SMALL,
        "max_num_batched_tokens": 16,
        "num_gpu_blocks_override": 24,
        "max_model_len": 128,
    }
    engine = LLM(target, speculative_config=draft_config(target), **tight)
    try:
        prompts = [p * 3 for p in PROMPTS]  # 20-40 tokens each: several budget-sized chunks
        params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        for x, y in zip(
            base.generate(prompts, params, use_tqdm=False),
            engine.generate(prompts, params, use_tqdm=False),
        ):
            assert_same(x, y)
        s = stats(engine)
        assert engine.engine.get_stats().num_preemptions > 0
        assert s.num_accepted_tokens >= 0.9 * s.num_draft_tokens > 0
        assert "failed to propose" not in caplog.text  # every proposal ran
    finally:
        engine.shutdown()
