"""TritonAttentionBackend end to end (Triton interpreter on CPU, fp32): against the torch
reference kernels, against dense causal attention over steps of chunked prefill and decode,
and against the torch backend when it is present. Also FlashInfer's page-table translation."""

import os

# NOTE: triton.jit reads TRITON_INTERPRET when a kernel is *defined*, so it is set before the
# kernel modules are imported; it is restored afterwards so other test modules are unaffected.
_saved_interpret = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

triton = pytest.importorskip("triton")  # optional for CPU users; these tests need it

from trillm.attention import flashinfer_backend, triton_backend  # noqa: E402
from trillm.attention.backend import AttentionMetadata  # noqa: E402
from trillm.kernels import (  # noqa: E402
    paged_attention_torch,
    paged_attention_triton,
    reshape_and_cache_torch,
    reshape_and_cache_triton,
)

_TRITON_MODULES = [reshape_and_cache_triton, paged_attention_triton]

# see tests/native/test_kernels.py: triton's own helpers must be interpreted too, else a subprocess
INTERPRETED_HERE = not isinstance(triton.language.standard.sum, triton.runtime.JITFunction)
if INTERPRETED_HERE:
    for _module in _TRITON_MODULES:
        if any(isinstance(obj, triton.runtime.JITFunction) for obj in vars(_module).values()):
            importlib.reload(_module)
if _saved_interpret is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _saved_interpret

# subprocesses run from the checkout, where ``trillm`` imports whatever the install mode
_REPO_ROOT = Path(__file__).resolve().parents[2]

needs_interpreter = pytest.mark.skipif(
    not INTERPRETED_HERE, reason="triton imported without TRITON_INTERPRET: run in a subprocess"
)

if not INTERPRETED_HERE:

    def test_backend_in_interpreted_subprocess():
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
        result = subprocess.run(
            cmd, capture_output=True, text=True, env=env, cwd=_REPO_ROOT, timeout=600
        )
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.fixture(autouse=True)
def _interpret_at_launch(monkeypatch):
    # NOTE: the interpreter reads the variable again when a kernel is launched.
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def make_meta(query_lens, context_lens, block_table) -> AttentionMetadata:
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    block_size = _BLOCK_SIZE
    positions = [p for c, s in zip(context_lens, seq_lens) for p in range(c, s)]
    req_of_row = [i for i, q in enumerate(query_lens) for _ in range(q)]
    slots = [
        int(block_table[i, p // block_size]) * block_size + p % block_size
        for i, p in zip(req_of_row, positions)
    ]
    return AttentionMetadata(
        num_reqs=len(query_lens),
        num_tokens=sum(query_lens),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]).int(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
    )


_BLOCK_SIZE = 4


def shuffled_block_table(blocks_per_req, num_blocks, seed):
    """Each request gets distinct, non-contiguous blocks from a shuffled pool."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.zeros(len(blocks_per_req), max(blocks_per_req), dtype=torch.int32)
    taken = 0
    for i, n in enumerate(blocks_per_req):
        table[i, :n] = pool[taken : taken + n]
        taken += n
    return table


def random_step(query_lens, context_lens, num_heads, num_kv_heads, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks = [-(-s // _BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks) + 2
    meta = make_meta(query_lens, context_lens, shuffled_block_table(blocks, num_blocks, seed))
    # the cache already holds every request's context (earlier steps); this step's rows are new
    cache = torch.randn(2, num_blocks, _BLOCK_SIZE, num_kv_heads, head_dim, generator=g)
    n = meta.num_tokens
    q = torch.randn(n, num_heads, head_dim, generator=g)
    k = torch.randn(n, num_kv_heads, head_dim, generator=g)
    v = torch.randn(n, num_kv_heads, head_dim, generator=g)
    return q, k, v, cache, meta


def reference_forward(q, k, v, cache, meta, scale, window=None, softcap=None):
    reshape_and_cache_torch.reshape_and_cache(k, v, cache, meta.slot_mapping)
    return paged_attention_torch.paged_attention(
        q, cache, meta.query_start_loc, meta.seq_lens, meta.block_table, scale, window, softcap
    )


@needs_interpreter
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 16), (4, 2, 24), (4, 1, 64)])
def test_backend_matches_reference_on_mixed_step(num_heads, num_kv_heads, head_dim):
    q, k, v, cache, meta = random_step(
        [1, 6, 1, 9], [11, 3, 0, 22], num_heads, num_kv_heads, head_dim, seed=20
    )
    expected_cache = cache.clone()
    expected = reference_forward(q, k, v, expected_cache, meta, 0.2)
    backend = triton_backend.TritonAttentionBackend(block_n=32)
    backend.plan(meta)
    got = backend.forward(q, k, v, cache, meta, 0.2)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache, expected_cache)


@needs_interpreter
def test_backend_decode_step_with_split_kv_matches_reference():
    q, k, v, cache, meta = random_step([1, 1, 1], [1100, 7, 129], 4, 1, 16, seed=26)
    assert paged_attention_triton.choose_num_splits(3, meta.max_seq_len, True) == 4
    expected_cache = cache.clone()
    expected = reference_forward(q, k, v, expected_cache, meta, 0.2)
    backend = triton_backend.TritonAttentionBackend()  # splits chosen by the step: 3 programs
    backend.plan(meta)
    got = backend.forward(q, k, v, cache, meta, 0.2)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache, expected_cache)


@needs_interpreter
@pytest.mark.parametrize("window,softcap", [(5, None), (40, None), (None, 0.7), (9, 3.0)])
@pytest.mark.parametrize(
    "query_lens,context_lens,num_splits",
    [([1, 6, 1, 30], [11, 3, 0, 22], 1), ([1, 1, 1], [300, 7, 129], 3)],
    ids=["mixed", "split-kv"],
)
def test_sliding_window_and_softcap_match_reference(
    query_lens, context_lens, num_splits, window, softcap
):
    q, k, v, cache, meta = random_step(query_lens, context_lens, 4, 2, 16, seed=27)
    expected_cache = cache.clone()
    expected = reference_forward(q, k, v, expected_cache, meta, 0.3, window, softcap)
    backend = triton_backend.TritonAttentionBackend(block_n=16, num_splits=num_splits)
    backend.plan(meta)
    got = backend.forward(q, k, v, cache, meta, 0.3, window=window, softcap=softcap)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@needs_interpreter
def test_backend_two_layers_share_the_plan_and_replan_on_new_meta():
    backend = triton_backend.TritonAttentionBackend(block_n=32)
    for seed in (21, 22):  # two steps
        q, k, v, cache, meta = random_step([1, 5], [7, 2], 4, 2, 16, seed=seed)
        backend.plan(meta)
        for layer in range(2):
            layer_cache = cache.clone() + layer
            expected_cache = layer_cache.clone()
            expected = reference_forward(q, k, v, expected_cache, meta, 0.25)
            got = backend.forward(q, k, v, layer_cache, meta, 0.25)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert len(backend._schedules) == 1


@needs_interpreter
def test_backend_steps_of_chunked_prefill_and_decode_match_dense_attention():
    """Two requests go through chunked prefill, a prefill+decode mix and decode steps; every
    output row equals dense causal attention over the request's whole sequence."""
    g = torch.Generator().manual_seed(23)
    num_heads, num_kv_heads, head_dim, scale = 4, 2, 16, 0.25
    total = [13, 6]  # final sequence length per request
    steps = [  # (query_lens, context_lens) per step
        ([5, 3], [0, 0]),
        ([6, 2], [5, 3]),
        ([2, 1], [11, 5]),
    ]
    seqs = [
        {
            "q": torch.randn(n, num_heads, head_dim, generator=g),
            "k": torch.randn(n, num_kv_heads, head_dim, generator=g),
            "v": torch.randn(n, num_kv_heads, head_dim, generator=g),
        }
        for n in total
    ]
    table = shuffled_block_table([4, 2], 9, seed=23)
    cache = torch.zeros(2, 9, _BLOCK_SIZE, num_kv_heads, head_dim)
    backend = triton_backend.TritonAttentionBackend(block_n=16)
    outputs = [torch.zeros(n, num_heads, head_dim) for n in total]
    for query_lens, context_lens in steps:
        meta = make_meta(query_lens, context_lens, table)
        rows = [(i, c, c + n) for i, (n, c) in enumerate(zip(query_lens, context_lens))]
        q, k, v = (torch.cat([seqs[i][t][a:b] for i, a, b in rows]) for t in "qkv")
        backend.plan(meta)
        out = backend.forward(q, k, v, cache, meta, scale)
        offset = 0
        for i, a, b in rows:
            outputs[i][a:b] = out[offset : offset + b - a]
            offset += b - a
    for i, seq in enumerate(seqs):
        dense = F.scaled_dot_product_attention(
            seq["q"].transpose(0, 1),
            seq["k"].transpose(0, 1),
            seq["v"].transpose(0, 1),
            is_causal=True,
            enable_gqa=True,
            scale=scale,
        ).transpose(0, 1)
        torch.testing.assert_close(outputs[i], dense, atol=1e-5, rtol=1e-5)


@needs_interpreter
def test_backend_matches_torch_backend():
    torch_backend = pytest.importorskip("trillm.attention.torch_backend")
    q, k, v, cache, meta = random_step([1, 4, 7], [9, 4, 0], 4, 2, 16, seed=24)
    expected_cache = cache.clone()
    reference = torch_backend.TorchAttentionBackend()
    reference.plan(meta)
    expected = reference.forward(q, k, v, expected_cache, meta, 0.25)
    backend = triton_backend.TritonAttentionBackend(block_n=32)
    backend.plan(meta)
    got = backend.forward(q, k, v, cache, meta, 0.25)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache, expected_cache)


def test_backend_on_cpu_without_interpreter_says_why():
    code = textwrap.dedent(
        """
        import torch
        from trillm.attention.triton_backend import TritonAttentionBackend
        try:
            TritonAttentionBackend().forward(
                torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), torch.zeros(1, 1, 16),
                torch.zeros(2, 1, 4, 1, 16), None, 1.0)
        except RuntimeError as e:
            print(e)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=_REPO_ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "needs CUDA tensors, or TRITON_INTERPRET=1" in result.stdout


def test_flashinfer_page_table_translation():
    query_lens, context_lens = [1, 3, 2], [8, 0, 13]
    table = shuffled_block_table([3, 1, 4], 10, seed=25)
    meta = make_meta(query_lens, context_lens, table)
    indptr, indices, last_page_len = flashinfer_backend.paged_kv_layout(meta, _BLOCK_SIZE)
    assert indptr.tolist() == [0, 3, 4, 8]
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        pages = indices[indptr[i] : indptr[i + 1]]
        assert torch.equal(pages, table[i, : len(pages)])
        assert (len(pages) - 1) * _BLOCK_SIZE + int(last_page_len[i]) == seq_len
        assert 1 <= int(last_page_len[i]) <= _BLOCK_SIZE
