"""The native CPU elementwise ops (ext/cpu_ops.cpp: RMSNorm, fused add + RMSNorm, rotary,
silu * mul, the K/V cache write) against their torch references: fp32 and bf16, widths with a
partial 8-lane tail, strided rows, rotary on the q/k views of a fused qkv buffer, thread counts,
in-place semantics, bad inputs, and the dispatch in ``trillm.kernels.dispatch`` (native, or the
reference under autograd or ``TRILLM_NO_EXTENSIONS=1``)."""

from __future__ import annotations

import pytest
import torch

import trillm.kernels.dispatch as dispatch
from trillm.kernels import (
    activation_cpu,
    activation_torch,
    rms_norm_cpu,
    rms_norm_torch,
    rotary_cpu,
    rotary_torch,
)

pytestmark = pytest.mark.skipif(
    not rms_norm_cpu.available(), reason="trillm._ext.cpu_kernels is not built"
)

DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-6


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: the reduction order of the norm's sum or silu's exp (~1 ulp); bf16: one bf16 ulp
    (a value that lands on a rounding boundary may round the other way)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = 1e-6 if actual.dtype == torch.float32 else 2**-7
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _strided_rows(rows: int, hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[rows, hidden] whose rows are 3 * hidden + 5 elements apart (columns of a wider buffer)."""
    return _randn(rows, 3 * hidden + 5, dtype=dtype, seed=seed)[:, hidden + 1 : 2 * hidden + 1]


# --- rms_norm ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [512, 8, 37, 3, 100])
def test_rms_norm_matches_torch(dtype, hidden):
    x = _randn(67, hidden, dtype=dtype, seed=0, scale=3.0)
    w = _randn(hidden, dtype=dtype, seed=1)
    _close(rms_norm_cpu.rms_norm(x, w, EPS), rms_norm_torch.rms_norm(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_and_3d_inputs(dtype):
    w = _randn(40, dtype=dtype, seed=2)
    x = _strided_rows(9, 40, dtype, seed=3)
    assert not x.is_contiguous()
    _close(rms_norm_cpu.rms_norm(x, w, EPS), rms_norm_torch.rms_norm(x, w, EPS))
    # per-head norms (Qwen3's q_norm): [T, heads, D] views of a fused buffer
    qkv = _randn(5, 7 * 40, dtype=dtype, seed=4)
    heads = qkv[:, : 4 * 40].view(5, 4, 40)
    _close(rms_norm_cpu.rms_norm(heads, w, EPS), rms_norm_torch.rms_norm(heads, w, EPS))
    one_row = x[0]
    _close(rms_norm_cpu.rms_norm(one_row, w, EPS), rms_norm_torch.rms_norm(one_row, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [512, 37])
def test_fused_add_rms_norm_in_place(dtype, hidden):
    x = _randn(70, hidden, dtype=dtype, seed=5)
    residual = _randn(70, hidden, dtype=dtype, seed=6, scale=4.0)
    w = _randn(hidden, dtype=dtype, seed=7)
    ref_out, ref_residual = rms_norm_torch.fused_add_rms_norm(x, residual, w, EPS)
    w_before = w.clone()
    rms_norm_cpu.fused_add_rms_norm_(x, residual, w, EPS)
    assert torch.equal(residual, ref_residual)  # the add is exact: one rounding, as torch's
    _close(x, ref_out)
    assert torch.equal(w, w_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_strided_rows_leave_the_rest_alone(dtype):
    buffer = _randn(12, 3 * 24 + 5, dtype=dtype, seed=8)
    before = buffer.clone()
    x = buffer[:, 25:49]
    residual = _strided_rows(12, 24, dtype, seed=9)
    w = _randn(24, dtype=dtype, seed=10)
    ref_out, ref_residual = rms_norm_torch.fused_add_rms_norm(x, residual, w, EPS)
    rms_norm_cpu.fused_add_rms_norm_(x, residual, w, EPS)
    assert torch.equal(residual, ref_residual)
    _close(x, ref_out)
    assert torch.equal(buffer[:, :25], before[:, :25]) and torch.equal(
        buffer[:, 49:], before[:, 49:]
    )


# --- rotary -----------------------------------------------------------------------------------


def _cache(rotary_dim: int, max_pos: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    return rotary_torch.build_cos_sin_cache(inv_freq, max_pos)


def _fused_qkv(tokens, q_heads, kv_heads, head_dim, dtype, seed):
    """(qkv buffer, q view [T, Hq, D], k view [T, Hkv, D]) as the model slices them."""
    qkv = _randn(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=seed)
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    q = qkv[:, :q_size].view(tokens, q_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
    return qkv, q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "q_heads,kv_heads,head_dim,rotary_dim",
    [(8, 4, 64, 64), (4, 2, 24, 24), (3, 1, 40, 16), (2, 2, 20, 12), (2, 1, 8, 2)],
)
def test_rotary_in_place_on_fused_qkv_views(dtype, q_heads, kv_heads, head_dim, rotary_dim):
    tokens, max_pos = 33, 300
    qkv, q, k = _fused_qkv(tokens, q_heads, kv_heads, head_dim, dtype, seed=11)
    positions = torch.randint(0, max_pos, (tokens,), generator=torch.Generator().manual_seed(12))
    cache = _cache(rotary_dim, max_pos)
    q_ref, k_ref = rotary_torch.apply_rotary(q, k, positions, cache)
    before, q_before = qkv.clone(), q.clone()
    rotary_cpu.apply_rotary_(q, k, positions, cache)
    # no reduction: fp32 matches the reference to the bit (the build does not fuse mul + add)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    v_start = (q_heads + kv_heads) * head_dim
    assert torch.equal(qkv[:, v_start:], before[:, v_start:])  # v untouched
    assert torch.equal(q[..., rotary_dim:], q_before[..., rotary_dim:])  # past rotary_dim


def test_rotary_contiguous_inputs_and_int32_positions():
    q = _randn(6, 4, 32, dtype=torch.float32, seed=13)
    k = _randn(6, 2, 32, dtype=torch.float32, seed=14)
    positions = torch.tensor([0, 5, 1, 63, 2, 2], dtype=torch.int32)
    cache = _cache(32, 64)
    q_ref, k_ref = rotary_torch.apply_rotary(q, k, positions, cache)
    rotary_cpu.apply_rotary_(q, k, positions, cache)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


@pytest.mark.parametrize("bad", [-1, 64, 10**12])
def test_rotary_position_outside_the_cache_raises_and_writes_nothing(bad):
    qkv, q, k = _fused_qkv(4, 2, 1, 16, torch.float32, seed=15)
    before = qkv.clone()
    positions = torch.tensor([0, 3, bad, 1])
    with pytest.raises(ValueError, match="outside the cos/sin cache"):
        rotary_cpu.apply_rotary_(q, k, positions, _cache(16, 64))
    assert torch.equal(qkv, before)


# --- silu_and_mul -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1408, 8, 13, 3])
def test_silu_and_mul_matches_torch(dtype, width):
    gate_up = _randn(65, 2 * width, dtype=dtype, seed=16, scale=4.0)
    _close(activation_cpu.silu_and_mul(gate_up), activation_torch.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_extremes_strided_rows_and_out(dtype):
    values = [
        0.0,
        -0.0,
        1e-30,
        -1e-30,
        20.0,
        -20.0,
        87.5,
        -87.5,
        88.5,
        -88.5,
        89.5,
        -89.5,
        200.0,
        -200.0,
        float("inf"),
        float("-inf"),
        float("nan"),
    ]
    gate = torch.tensor(values)
    gate_up = torch.cat([gate, torch.full_like(gate, 1.5)])[None].to(dtype)  # [1, gate | up]
    expected = activation_torch.silu_and_mul(gate_up)
    torch.testing.assert_close(
        activation_cpu.silu_and_mul(gate_up), expected, atol=1e-6, rtol=1e-6, equal_nan=True
    )
    wide = _randn(7, 3 * 40, dtype=dtype, seed=17)
    strided = wide[:, 10:90]
    out = torch.full((7, 40), 7.0, dtype=dtype)
    assert activation_cpu.silu_and_mul(strided, out=out) is out
    _close(out, activation_torch.silu_and_mul(strided))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_lanes_do_not_depend_on_their_place_in_the_row(dtype):
    """The same gate/up values as one 37-wide row (full vector chunks, then a partial one) and
    as 37 rows of width 1 (a partial chunk each): bit-identical results; a row's partial chunk
    writes nothing past its width (the out rows here are views into a wider buffer)."""
    gate_up = _randn(3, 2 * 37, dtype=dtype, seed=18, scale=6.0)
    buffer = torch.full((3, 48), 5.0, dtype=dtype)
    activation_cpu.silu_and_mul(gate_up, out=buffer[:, :37])
    one_each = torch.stack([gate_up[:, :37], gate_up[:, 37:]], dim=-1).reshape(3 * 37, 2)
    single = activation_cpu.silu_and_mul(one_each).reshape(3, 37)
    assert torch.equal(buffer[:, :37], single)
    assert torch.equal(buffer[:, 37:], torch.full((3, 11), 5.0, dtype=dtype))
    _close(single, activation_torch.silu_and_mul(gate_up))


# --- threads, bad inputs, dispatch ------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_results_do_not_depend_on_the_thread_count(dtype, monkeypatch):
    # above cpu_ops.cpp's kMinParallelWork for every op (so the pool runs), partial chunks
    rows, hidden = 700, 520
    x = _randn(rows, hidden, dtype=dtype, seed=18)
    residual = _randn(rows, hidden, dtype=dtype, seed=19)
    w = _randn(hidden, dtype=dtype, seed=20)
    gate_up = _randn(rows, 2 * hidden, dtype=dtype, seed=21)
    positions = torch.randint(0, 500, (rows,), generator=torch.Generator().manual_seed(22))
    results = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        xs, rs = x.clone(), residual.clone()
        rms_norm_cpu.fused_add_rms_norm_(xs, rs, w, EPS)
        _, q, k = _fused_qkv(rows, 8, 4, 64, dtype, seed=23)
        rotary_cpu.apply_rotary_(q, k, positions, _cache(64, 500))
        results.append(
            [rms_norm_cpu.rms_norm(x, w, EPS), xs, rs, q, k, activation_cpu.silu_and_mul(gate_up)]
        )
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_bad_inputs_raise_value_error():
    x, w = torch.randn(4, 16), torch.randn(16)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_cpu.rms_norm(x, torch.randn(15), EPS)
    with pytest.raises(ValueError):
        rms_norm_cpu.rms_norm(x.to(torch.float64), w.to(torch.float64), EPS)
    with pytest.raises(ValueError):
        rms_norm_cpu.rms_norm(x.t(), torch.randn(4), EPS)  # last dim not contiguous
    with pytest.raises(ValueError):
        rms_norm_cpu.fused_add_rms_norm_(x, torch.randn(3, 16), w, EPS)
    with pytest.raises(ValueError):
        rms_norm_cpu.fused_add_rms_norm_(x, torch.randn(4, 16).to(torch.bfloat16), w, EPS)
    q, k, cache = torch.randn(3, 2, 16), torch.randn(3, 1, 16), _cache(16, 8)
    with pytest.raises(ValueError, match="disagree"):
        rotary_cpu.apply_rotary_(q, torch.randn(2, 1, 16), torch.zeros(3, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="disagree"):
        rotary_cpu.apply_rotary_(q, k, torch.zeros(4, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary_cpu.apply_rotary_(q, k, torch.zeros(3, dtype=torch.long), _cache(32, 8))
    with pytest.raises(ValueError):
        rotary_cpu.apply_rotary_(q, k, torch.zeros(3), cache)  # float positions
    with pytest.raises(ValueError):
        rotary_cpu.apply_rotary_(q, k, torch.zeros(3, dtype=torch.long), cache.double())
    with pytest.raises(ValueError, match="even"):
        activation_cpu.silu_and_mul(torch.randn(4, 7))
    with pytest.raises(ValueError, match="out"):
        activation_cpu.silu_and_mul(torch.randn(4, 8), out=torch.empty(4, 3))
    with pytest.raises(ValueError):
        activation_cpu.silu_and_mul(torch.randn(4, 8).to(torch.float16))


def test_empty_inputs():
    w = torch.randn(16)
    assert rms_norm_cpu.rms_norm(torch.empty(0, 16), w, EPS).shape == (0, 16)
    rms_norm_cpu.fused_add_rms_norm_(torch.empty(0, 16), torch.empty(0, 16), w, EPS)
    empty = torch.empty(0, 2, 16)
    rotary_cpu.apply_rotary_(empty, empty, torch.empty(0, dtype=torch.long), _cache(16, 8))
    assert activation_cpu.silu_and_mul(torch.empty(0, 8)).shape == (0, 4)


def test_dispatch_in_place_apis():
    x, residual = torch.randn(5, 24), torch.randn(5, 24)
    w = torch.randn(24)
    ref_out, ref_residual = rms_norm_torch.fused_add_rms_norm(x, residual, w, EPS)
    assert dispatch.fused_add_rms_norm_(x, residual, w, EPS) is x
    _close(x, ref_out)
    assert torch.equal(residual, ref_residual)
    qkv, q, k = _fused_qkv(5, 4, 2, 16, torch.float32, seed=24)
    positions, cache = torch.tensor([4, 0, 9, 9, 1]), _cache(16, 10)
    q_ref, k_ref = rotary_torch.apply_rotary(q, k, positions, cache)
    before = qkv.clone()
    q_out, k_out = dispatch.apply_rotary(q, k, positions, cache)  # copies
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref) and torch.equal(qkv, before)
    dispatch.apply_rotary_(q, k, positions, cache)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    gate_up = torch.randn(5, 32)
    _close(dispatch.silu_and_mul(gate_up), activation_torch.silu_and_mul(gate_up))


def test_dispatch_under_autograd_takes_the_torch_reference():
    x = torch.randn(3, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    out = dispatch.rms_norm(x, w, EPS)
    out.sum().backward()
    assert x.grad is not None and w.grad is not None
    gate_up = torch.randn(3, 8, requires_grad=True)
    dispatch.silu_and_mul(gate_up).sum().backward()
    assert gate_up.grad is not None
    hidden = torch.randn(3, 16, requires_grad=True) * 1.0  # non-leaf: in-place ops allowed
    residual = torch.randn(3, 16, requires_grad=True) * 1.0
    dispatch.fused_add_rms_norm_(hidden, residual, w, EPS)
    assert hidden.grad_fn is not None and residual.grad_fn is not None


def test_extensions_switch_falls_back_to_torch(python_without_extensions):
    code = (
        "import torch, trillm.kernels.dispatch as k\n"
        "from trillm.kernels import rms_norm_cpu, rotary_cpu, activation_cpu\n"
        "assert not (rms_norm_cpu.available() or rotary_cpu.available()"
        " or activation_cpu.available())\n"
        "x, r, w = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)\n"
        "k.fused_add_rms_norm_(x, r, w, 1e-6)\n"
        "q, kk = torch.randn(4, 2, 16), torch.randn(4, 1, 16)\n"
        "k.apply_rotary_(q, kk, torch.arange(4), k.build_cos_sin_cache(torch.ones(8), 8))\n"
        "print(k.silu_and_mul(torch.randn(4, 8)).shape)\n"
    )
    assert python_without_extensions(code) == "torch.Size([4, 4])"


# ---------------------------------------------------------------------------- K/V cache write


def _cache_problem(tokens: int, *, dtype: torch.dtype, seed: int, heads: int = 4, dim: int = 64):
    """k/v as strided views of a fused qkv (as the model passes them), a cache of blocks of 8
    slots with 4 to spare, distinct random slots."""
    qkv = _randn(tokens, (8 + 2 * heads) * dim, dtype=dtype, seed=seed)
    k = qkv[:, 8 * dim : (8 + heads) * dim].view(tokens, heads, dim)
    v = qkv[:, (8 + heads) * dim :].view(tokens, heads, dim)
    blocks = tokens // 8 + 5
    cache = _randn(2, blocks, 8, heads, dim, dtype=dtype, seed=seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    slots = torch.randperm(blocks * 8, generator=g)[:tokens]
    return k, v, cache, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 96, 1100])  # 1100: split over the pool
@pytest.mark.parametrize("threads", [1, 2])
def test_reshape_and_cache_matches_reference(monkeypatch, dtype, tokens, threads):
    from trillm.kernels import reshape_and_cache_cpu, reshape_and_cache_torch

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    k, v, cache, slots = _cache_problem(tokens, dtype=dtype, seed=tokens)
    if tokens > 2:
        slots[1] = -1  # padding: skipped
    expected = cache.clone()
    reshape_and_cache_torch.reshape_and_cache(k, v, expected, slots)
    assert reshape_and_cache_cpu.supports(k, v, cache)
    reshape_and_cache_cpu.reshape_and_cache(k, v, cache, slots)
    assert torch.equal(cache, expected)  # copies: bit for bit, everything else untouched


def test_reshape_and_cache_refuses_bad_inputs():
    from trillm.kernels import reshape_and_cache_cpu

    k, v, cache, slots = _cache_problem(5, dtype=torch.float32, seed=3)
    before = cache.clone()
    with pytest.raises(ValueError, match="outside the cache"):
        bad = slots.clone()
        bad[2] = cache.shape[1] * 8
        reshape_and_cache_cpu.reshape_and_cache(k, v, cache, bad)
    with pytest.raises(ValueError, match="int64"):
        reshape_and_cache_cpu.reshape_and_cache(k, v, cache, slots.int())
    with pytest.raises(ValueError, match="same dtype"):
        reshape_and_cache_cpu.reshape_and_cache(k.double(), v.double(), cache, slots)
    with pytest.raises(ValueError, match="same dtype"):
        reshape_and_cache_cpu.reshape_and_cache(k[:, :2], v[:, :2], cache, slots)
    assert torch.equal(cache, before)  # a refused call writes nothing
