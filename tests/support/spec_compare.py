"""``assert_same``: two engines' outputs for one request agree (tokens, text, finish, logprobs)."""

from __future__ import annotations

import pytest


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
