"""Triton kernels vs their torch references (fp32, Triton interpreter on CPU), and the torch
references vs independent implementations (Hugging Face Llama modules, dense causal SDPA)."""

import os

# NOTE: triton.jit reads TRITON_INTERPRET when a kernel is *defined*, so it is set before the
# kernel modules are imported; it is restored afterwards so other test modules are unaffected.
_saved_interpret = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

triton = pytest.importorskip("triton")  # optional for CPU users; these tests need it

import trillm.kernels.dispatch as dispatch  # noqa: E402
from trillm.kernels import (  # noqa: E402
    fused_moe_torch,
    fused_moe_triton,
    lora_torch,
    lora_triton,
    paged_attention_torch,
    paged_attention_triton,
    reshape_and_cache_torch,
    reshape_and_cache_triton,
    rms_norm_torch,
    rms_norm_triton,
    rotary_torch,
    rotary_triton,
)

_TRITON_MODULES = [
    fused_moe_triton,
    lora_triton,
    rms_norm_triton,
    rotary_triton,
    reshape_and_cache_triton,
    paged_attention_triton,
]


def _interpreter_ready() -> bool:
    """Whether triton itself was imported under the interpreter (its ``tl.standard`` helpers are
    defined at import, like our kernels); if another test module imported it first without the
    variable, the kernels can only run interpreted in a fresh process."""
    return not isinstance(triton.language.standard.sum, triton.runtime.JITFunction)


INTERPRETED_HERE = _interpreter_ready()
if INTERPRETED_HERE:
    # our kernel modules may still have been imported before the variable was set: redefine them
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

    def test_kernels_in_interpreted_subprocess():
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


@needs_interpreter
def test_kernels_run_interpreted():
    for module in _TRITON_MODULES:
        jitted = [o for o in vars(module).values() if isinstance(o, triton.runtime.KernelInterface)]
        assert jitted, module.__name__
        assert not any(isinstance(o, triton.runtime.JITFunction) for o in jitted)


# --- rms_norm ---------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("shape", [(7, 48), (2, 3, 40)])
def test_rms_norm_triton_matches_torch(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    w = torch.randn(shape[-1], generator=g)
    expected = rms_norm_torch.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(rms_norm_triton.rms_norm(x, w, 1e-6), expected, atol=1e-5, rtol=1e-5)


@needs_interpreter
def test_fused_add_rms_norm_triton_matches_torch():
    g = torch.Generator().manual_seed(1)
    x, residual = torch.randn(5, 24, generator=g), torch.randn(5, 24, generator=g)
    w = torch.randn(24, generator=g)
    x_before, res_before = x.clone(), residual.clone()
    out, new_res = rms_norm_triton.fused_add_rms_norm(x, residual, w, 1e-5)
    ref_out, ref_res = rms_norm_torch.fused_add_rms_norm(x, residual, w, 1e-5)
    torch.testing.assert_close(new_res, x_before + res_before, atol=0, rtol=0)
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(x, x_before) and torch.equal(residual, res_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_torch_matches_hf_llama(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(2)
    hf = LlamaRMSNorm(32, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(32, generator=g))
    x = torch.randn(6, 32, generator=g).to(dtype)
    with torch.no_grad():
        expected = hf(x)
    assert torch.equal(rms_norm_torch.rms_norm(x, hf.weight.detach(), 1e-6), expected)


def test_dispatch_on_cpu_matches_torch_reference():
    # CPU tensors take the native kernels (tests/native/test_cpu_ops.py) when built, else the reference
    g = torch.Generator().manual_seed(3)
    x, res = (torch.randn(4, 16, generator=g) for _ in range(2))
    w = torch.randn(16, generator=g)
    close = dict(atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        dispatch.rms_norm(x, w, 1e-6), rms_norm_torch.rms_norm(x, w, 1e-6), **close
    )
    out, new_res = dispatch.fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = rms_norm_torch.fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(out, ref_out, **close)
    assert torch.equal(new_res, ref_res)


def test_importing_kernels_does_not_import_triton():
    code = "import sys, trillm.kernels.dispatch; print('triton' in sys.modules)"
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
    assert result.stdout.strip() == "False"


# --- rotary -----------------------------------------------------------------------------------


def _rope_inputs(num_tokens, q_heads, k_heads, head_dim, rotary_dim, seed):
    g = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    cache = rotary_torch.build_cos_sin_cache(inv_freq, 64)  # [64, rotary_dim]
    q = torch.randn(num_tokens, q_heads, head_dim, generator=g)
    k = torch.randn(num_tokens, k_heads, head_dim, generator=g)
    positions = torch.randint(0, 64, (num_tokens,), generator=g)
    return q, k, positions, cache, inv_freq


@needs_interpreter
@pytest.mark.parametrize(
    "q_heads,k_heads,head_dim,rotary_dim", [(4, 2, 16, 16), (8, 2, 24, 24), (3, 1, 24, 16)]
)
def test_rotary_triton_matches_torch(q_heads, k_heads, head_dim, rotary_dim):
    q, k, positions, cache, _ = _rope_inputs(6, q_heads, k_heads, head_dim, rotary_dim, seed=4)
    q_before, k_before = q.clone(), k.clone()
    q_ref, k_ref = rotary_torch.apply_rotary(q, k, positions, cache)
    q_out, k_out = rotary_triton.apply_rotary(q, k, positions, cache)
    torch.testing.assert_close(q_out, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)
    assert not torch.allclose(q_out, q_before)


@needs_interpreter
def test_rotary_in_place_on_strided_views_of_fused_qkv():
    q, k, positions, cache, _ = _rope_inputs(5, 4, 2, 16, 16, seed=5)
    qkv = torch.cat([q.flatten(1), k.flatten(1), torch.zeros(5, 32)], dim=1)  # [T, (4+2+2)*16]
    q_view = qkv[:, :64].view(5, 4, 16)
    k_view = qkv[:, 64:96].view(5, 2, 16)
    rotary_triton.apply_rotary_(q_view, k_view, positions, cache)
    q_ref, k_ref = rotary_torch.apply_rotary(q, k, positions, cache)
    torch.testing.assert_close(qkv[:, :64].view(5, 4, 16), q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(qkv[:, 64:96].view(5, 2, 16), k_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, 96:], torch.zeros(5, 32))


def test_rotary_torch_matches_hf_llama():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k, positions, cache, inv_freq = _rope_inputs(7, 4, 2, 32, 32, seed=6)
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, D], HF's layout
    # HF works on [B, H, T, D]
    q_hf, k_hf = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None]
    )
    q_ref, k_ref = rotary_torch.apply_rotary(q, k, positions, cache)
    torch.testing.assert_close(q_ref, q_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_ref, k_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


# --- reshape_and_cache ------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 16), (1, 24)])
def test_reshape_and_cache_triton_matches_torch(num_kv_heads, head_dim):
    g = torch.Generator().manual_seed(7)
    num_blocks, block_size, num_tokens = 6, 4, 9
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[3] = -1  # a padding row
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    expected = cache.clone()
    reshape_and_cache_torch.reshape_and_cache(k, v, expected, slots)
    reshape_and_cache_triton.reshape_and_cache(k, v, cache, slots)
    assert torch.equal(cache, expected)
    block, offset = divmod(int(slots[0]), block_size)
    assert torch.equal(cache[0, block, offset], k[0]) and torch.equal(cache[1, block, offset], v[0])


# --- paged attention --------------------------------------------------------------------------


def make_paged_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, seed):
    """A random step: q rows, a cache holding every position of every request (this step's
    included), and block tables drawn from a shuffled pool (non-contiguous blocks)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    pool = torch.randperm(num_blocks, generator=g).to(torch.int32)
    block_table = torch.zeros(len(query_lens), max(blocks_per_req), dtype=torch.int32)
    taken = 0
    for i, n in enumerate(blocks_per_req):
        block_table[i, :n] = pool[taken : taken + n]
        taken += n
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=g)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]).int()
    return q, cache, query_start_loc, torch.tensor(seq_lens, dtype=torch.int32), block_table


# (query_lens, context_lens): decode rows, chunks starting mid-sequence, a long context over
# many blocks, a fresh prefill from position 0
_MIXED = ([1, 7, 1, 20, 3], [9, 5, 40, 0, 13])


@needs_interpreter
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size",
    [(8, 2, 16, 4), (4, 2, 24, 8), (4, 1, 64, 16), (3, 3, 16, 5)],
)
def test_paged_attention_triton_matches_torch_mixed_batch(
    num_heads, num_kv_heads, head_dim, block_size
):
    batch = make_paged_batch(*_MIXED, num_heads, num_kv_heads, head_dim, block_size, seed=8)
    q, cache, qsl, seq_lens, block_table = batch
    expected = paged_attention_torch.paged_attention(q, cache, qsl, seq_lens, block_table, 0.25)
    got = paged_attention_triton.paged_attention(
        q, cache, qsl, seq_lens, block_table, 0.25, block_n=32
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("num_splits", [2, 5])
def test_paged_attention_triton_split_kv_matches_torch(num_splits):
    """Split-KV on a mixed batch: short requests leave later splits empty, a split boundary
    falls inside the prefill chunks."""
    q, cache, qsl, seq_lens, block_table = make_paged_batch(*_MIXED, 8, 2, 16, 4, seed=11)
    expected = paged_attention_torch.paged_attention(q, cache, qsl, seq_lens, block_table, 0.25)
    got = paged_attention_triton.paged_attention(
        q, cache, qsl, seq_lens, block_table, 0.25, block_n=16, num_splits=num_splits
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_choose_num_splits_only_for_small_decode_steps():
    assert paged_attention_triton.choose_num_splits(8, 4096, decode_only=True) == 16
    assert paged_attention_triton.choose_num_splits(64, 4096, decode_only=True) == 4
    assert paged_attention_triton.choose_num_splits(8, 300, decode_only=True) == 1
    assert paged_attention_triton.choose_num_splits(512, 4096, decode_only=True) == 1
    assert paged_attention_triton.choose_num_splits(8, 4096, decode_only=False) == 1


@needs_interpreter
def test_paged_attention_triton_decode_only_and_small_tiles():
    q, cache, qsl, seq_lens, block_table = make_paged_batch(
        [1, 1, 1], [30, 1, 17], 8, 2, 16, 4, seed=9
    )
    expected = paged_attention_torch.paged_attention(q, cache, qsl, seq_lens, block_table, 0.3)
    schedule = paged_attention_triton.plan_tiles([1, 1, 1], 2, q.device)
    got = paged_attention_triton.paged_attention(
        q, cache, qsl, seq_lens, block_table, 0.3, schedule=schedule, block_n=16
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_plan_tiles_covers_every_query_row_once():
    schedule = paged_attention_triton.plan_tiles([1, 5, 0, 4], 2, torch.device("cpu"))
    assert schedule.tile_req.tolist() == [0, 1, 1, 1, 3, 3]
    assert schedule.tile_start.tolist() == [0, 0, 2, 4, 0, 2]


@needs_interpreter
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 1), (4, 2)])
def test_paged_attention_torch_matches_dense_causal_sdpa(num_heads, num_kv_heads):
    """A whole prompt split into a prefix chunk and the rest equals dense causal attention."""
    g = torch.Generator().manual_seed(10)
    seq_len, head_dim, block_size, split = 11, 16, 4, 6
    q = torch.randn(seq_len, num_heads, head_dim, generator=g)
    k = torch.randn(seq_len, num_kv_heads, head_dim, generator=g)
    v = torch.randn(seq_len, num_kv_heads, head_dim, generator=g)
    dense = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1)  # [seq_len, Hq, D]
    cache = torch.zeros(2, 5, block_size, num_kv_heads, head_dim)
    block_table = torch.tensor([[3, 0, 4, 1, 2]], dtype=torch.int32)
    slots = block_table[0].long()[torch.arange(seq_len) // block_size] * block_size
    reshape_and_cache_torch.reshape_and_cache(k, v, cache, slots + torch.arange(seq_len) % 4)
    # the second chunk alone, after a cached prefix of `split` tokens
    qsl = torch.tensor([0, seq_len - split], dtype=torch.int32)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    scale = head_dim**-0.5
    tail = paged_attention_torch.paged_attention(
        q[split:], cache, qsl, seq_lens, block_table, scale
    )
    torch.testing.assert_close(tail, dense[split:], atol=1e-5, rtol=1e-5)
    tail_triton = paged_attention_triton.paged_attention(
        q[split:], cache, qsl, seq_lens, block_table, scale
    )
    torch.testing.assert_close(tail_triton, dense[split:], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- fused MoE


@needs_interpreter
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 4, 2), (37, 5, 2), (20, 8, 1), (9, 3, 3)])
def test_fused_moe_triton_matches_torch(tokens, experts, top_k):
    gen = torch.Generator().manual_seed(tokens * 100 + experts)
    hidden, inter = 48, 40  # neither a multiple of the 32-wide blocks
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.1
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 0] -= 100.0  # expert 0 never chosen: an expert without tokens
    weights, ids = fused_moe_torch.select_experts(logits, top_k, renormalize=True)
    want = fused_moe_torch.fused_moe(x, w13, w2, weights, ids)
    got = fused_moe_triton.fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_moe_alignment_pads_each_expert_run():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    pairs, tile_expert = fused_moe_triton.align_pairs(ids, num_experts=4, block_m=4)
    assert tile_expert.tolist() == [0, 1, 2]  # expert 3 has no pairs: no tile
    runs = pairs.view(-1, 4).tolist()
    assert runs == [[1, 4, -1, -1], [3, -1, -1, -1], [0, 2, 5, -1]]  # pair = token * k + slot


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens,in_f,rank,out_f,num_slots", [(2, 48, 8, 48, 1), (37, 40, 24, 70, 3)]
)
def test_lora_triton_matches_torch(dtype, tokens, in_f, rank, out_f, num_slots):
    """Batched LoRA: three adapters and base-model tokens in one call; rank and widths not
    multiples of the blocks; bf16 within one bf16 step (both sum in fp32, round once)."""
    gen = torch.Generator().manual_seed(tokens + rank)
    x = torch.randn(tokens, in_f, generator=gen).to(dtype)
    a = (torch.randn(num_slots, rank, in_f, generator=gen) * 0.1).to(dtype)
    bt = (torch.randn(num_slots, rank, out_f, generator=gen) * 0.1).to(dtype)
    y = torch.randn(tokens, out_f, generator=gen).to(dtype)
    slots = torch.randint(-1, num_slots, (tokens,), generator=gen)
    slots[0], slots[-1] = -1, num_slots - 1
    scales = torch.rand(num_slots, generator=gen) + 0.5
    want = lora_torch.add_lora_(y.clone(), x, a, bt, slots, scales)
    got = lora_triton.add_lora_(y.clone(), x, a, bt, slots, scales)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(got[slots < 0], y[slots < 0])
    assert lora_triton.step_plan(slots, num_slots) is lora_triton.step_plan(slots, num_slots)


def test_lora_triton_plan_gives_each_tile_one_slot():
    slots = torch.tensor([1, -1, 0, 1, 1, -1])
    p = lora_triton.plan(slots, num_slots=3)
    tiles = p.tokens.view(-1, lora_triton.BLOCK_M).tolist()
    assert p.tile_slot.tolist() == [0, 1, 3]  # slot 2 has no tokens; 3 = the base-model run
    assert [[t for t in tile if t >= 0] for tile in tiles] == [[2], [0, 3, 4], [1, 5]]
