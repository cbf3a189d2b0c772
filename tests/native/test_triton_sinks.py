"""Attention sinks (gpt-oss) in the Triton paged-attention kernel, under the Triton interpreter
on CPU (fp32): equal to the torch reference with one split and with split-KV (the sink added
in the merge), with a window, for decode and prefill tiles; the backend passes them through."""

import os

# NOTE: triton.jit reads TRITON_INTERPRET when a kernel is *defined* (tests/conftest.py sets it
# for the session; tests/native/test_triton_backend.py handles a run without it).
_saved_interpret = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from paged_batches import sink_problem  # noqa: E402

from trillm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from trillm.kernels import paged_attention_torch, paged_attention_triton  # noqa: E402

if _saved_interpret is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _saved_interpret

pytestmark = pytest.mark.skipif(
    not paged_attention_triton.runs_interpreted(),
    reason="the Triton kernels were defined without TRITON_INTERPRET (no GPU here)",
)

HQ, HKV, D, BLOCK = 4, 2, 16, 8


def _problem(query_lens, seq_lens):
    return sink_problem(query_lens, seq_lens, HQ, HKV, D, block_size=BLOCK, seed=5)


@pytest.mark.parametrize(
    "query_lens,seq_lens,num_splits",
    [([1, 1, 1], [5, 40, 70], 1), ([1, 1, 1], [5, 40, 70], 3), ([9, 1, 4], [9, 33, 20], 1)],
    ids=["decode", "decode-split3", "prefill"],
)
@pytest.mark.parametrize("window", [None, 6])
def test_sinks_match_the_reference(query_lens, seq_lens, num_splits, window):
    q, kv, qsl, lens, table, sinks = _problem(query_lens, seq_lens)
    scale = D**-0.5
    out = paged_attention_triton.paged_attention(
        q, kv, qsl, lens, table, scale, num_splits=num_splits, window=window, sinks=sinks
    )
    ref = paged_attention_torch.paged_attention(
        q, kv, qsl, lens, table, scale, window=window, sinks=sinks
    )
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    without = paged_attention_torch.paged_attention(q, kv, qsl, lens, table, scale, window=window)
    assert not torch.allclose(out, without, atol=1e-3)


def test_the_backend_takes_sinks():
    assert TritonAttentionBackend.supports_sinks
