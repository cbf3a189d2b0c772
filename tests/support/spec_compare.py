"""What the speculative-decoding tests share: ``assert_same`` (two engines' outputs for one
request agree: tokens, text, finish, logprobs); the small in-process engine's arguments
(``SMALL``) and prompts (``PROMPTS``); ``run``, ``stats``; and ``recorded_drafts``, each
proposal a drafter made with the request's tokens then."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from trillm import LLM, SamplingParams

SMALL = {
    "max_model_len": 256,
    "kv_cache_memory": "8MiB",
    "distributed_executor_backend": "uni",
    "block_size": 8,
}
PROMPTS = [
    "a b c d a b c d a b c",
    "The license grants the license grants the",
    "hello",
    "The license grants the right to",
]  # different lengths; two share a prefix: cached blocks


def run(engine: LLM, params: SamplingParams, prompts: list[str] = PROMPTS):
    return engine.generate(prompts, params, use_tqdm=False)


def stats(engine: LLM):
    return engine.engine.get_stats().spec_decoding


def recorded_drafts(engine: LLM, params: SamplingParams) -> list[tuple[list[int], list[int]]]:
    """``PROMPTS`` through ``engine`` (shut down after) -> each proposal its drafter made, as
    (the request's tokens then, its drafts), in order."""
    seen: list[tuple[list[int], list[int]]] = []
    drafter = engine.engine.executors[0].runner.drafter
    propose = drafter.propose

    def recording(batch, candidates):
        tokens = {r: batch.token_ids[s, : batch.num_tokens[s]].tolist() for r, s in candidates}
        drafts = propose(batch, candidates)
        seen.extend((tokens[r], d) for r, d in drafts.items())
        return drafts

    drafter.propose = recording
    try:
        run(engine, params)
    finally:
        engine.shutdown()
    return seen


def assert_same(a, b) -> None:
    assert len(a.outputs) == len(b.outputs)
    for x, y in zip(a.outputs, b.outputs):
        assert y.token_ids == x.token_ids
        assert y.text == x.text
        assert (y.finish_reason, y.stop_reason) == (x.finish_reason, x.stop_reason)
        if x.logprobs is not None:
            assert y.logprobs is not None and len(y.logprobs) == len(x.logprobs)
            for px, py in zip(x.logprobs, y.logprobs):
                assert px.keys() == py.keys()
                for t in px:
                    assert py[t].logprob == pytest.approx(px[t].logprob, abs=1e-4)
                    assert py[t].rank == px[t].rank
