"""Native step programs (ext/cpu_program.h): a kernel's ``bind_<name>`` binds the same arguments
as the kernel into a ``Thunk``, a ``Program`` runs thunks in order, ``PlanSlots`` hands a replay's
attention plans to its bound attention calls; a step program's replay through them gives the
bits of the Python replay and of the eager forward."""

from __future__ import annotations

import time

import pytest
import torch
from step_runs import decode_shrinking_batch, step_runner

from trillm._native import cpu_kernels
from trillm.kernels import paged_attention_cpu, recording
from trillm.kernels._cpu_ops import rows
from trillm.testing.tiny_models import build_tiny_model
from trillm.worker import step_program

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ops = cpu_kernels("ops")
attention = cpu_kernels("attention")
program = cpu_kernels("program")
pytestmark = [
    pytestmark,
    pytest.mark.skipif(program is None, reason="trillm._ext.cpu_kernels is not built"),
]


def _rms_args(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> dict:
    return dict(
        out=rows(out),
        x=rows(x),
        weight=w.data_ptr(),
        num_rows=x.shape[0],
        hidden=x.shape[1],
        eps=1e-6,
        dtype=0,
        num_threads=1,
    )


def test_a_bound_call_computes_what_the_kernel_computes_on_the_buffers_at_run_time():
    torch.manual_seed(0)
    x, w = torch.randn(3, 64), torch.randn(64)
    direct, bound = torch.empty(3, 64), torch.zeros(3, 64)
    ops.rms_norm(**_rms_args(direct, x, w))
    thunk = ops.bind_rms_norm(**_rms_args(bound, x, w))
    assert not bound.any()  # binding computes nothing
    thunk()
    assert torch.equal(bound, direct)
    # The thunk holds pointers, not values: new data in the same buffer, a new result.
    x.copy_(torch.randn(3, 64))
    ops.rms_norm(**_rms_args(direct, x, w))
    thunk()
    assert torch.equal(bound, direct)


def _norm_then_silu(num_rows: int, width: int, seed: int):
    """A program: rms_norm of x into a, then silu_and_mul of a into b -> (program, x, w, a, b).
    The thunks keep raw addresses: the caller holds the tensors while the program runs."""
    torch.manual_seed(seed)
    x, w = torch.randn(num_rows, 2 * width), torch.randn(2 * width)
    a, b = torch.empty(num_rows, 2 * width), torch.empty(num_rows, width)
    prog = program.Program()
    prog.append(ops.bind_rms_norm(**_rms_args(a, x, w)))
    prog.append(
        ops.bind_silu_and_mul(
            out=rows(b), gate_up=rows(a), num_rows=num_rows, width=width, dtype=0, num_threads=1
        )
    )
    return prog, x, w, a, b


def test_a_program_runs_its_thunks_in_order():
    """rms_norm into a, then silu_and_mul of a into b: b is only right if the order held."""
    prog, x, w, _a, b = _norm_then_silu(2, 32, seed=1)
    assert len(prog) == 2
    prog.run()
    ref = torch.empty(2, 64)
    ops.rms_norm(**_rms_args(ref, x, w))
    assert torch.equal(b, torch.nn.functional.silu(ref[:, :32]) * ref[:, 32:])


def test_a_timed_run_computes_what_run_computes_and_times_each_thunk():
    """run_timed (benchmarks/engine/step_breakdown.py): the same results as run, one (thread CPU
    ns, wall ns) pair per thunk, which add up to no more than the run's own time."""
    prog, _x, _w, _a, b = _norm_then_silu(256, 512, seed=2)
    prog.run()
    ref = b.clone()
    b.zero_()
    cpu0, wall0 = time.thread_time_ns(), time.perf_counter_ns()
    times = prog.run_timed()
    cpu1, wall1 = time.thread_time_ns(), time.perf_counter_ns()
    assert torch.equal(b, ref)
    assert len(times) == 2
    assert all(cpu >= 0 and wall > 0 for cpu, wall in times)
    assert sum(cpu for cpu, _ in times) <= cpu1 - cpu0
    assert sum(wall for _, wall in times) <= wall1 - wall0
    for threads in (1, 2):
        wall, cpu = program.pool_dispatch_ns(threads, 4, 100)
        assert 0 <= wall < 1e8 and 0 <= cpu < 1e8


def test_binding_checks_the_arguments_and_a_kernels_error_stops_the_run():
    with pytest.raises(TypeError):
        ops.bind_rms_norm(out=0)  # the kernel's own signature: missing arguments
    q, k = torch.randn(1, 2, 8), torch.randn(1, 1, 8)
    positions = torch.tensor([99])  # outside a 16-position cos/sin cache
    cache = torch.randn(16, 8)
    thunk = ops.bind_rotary(
        q=rows(q),
        k=rows(k),
        positions=positions.data_ptr(),
        cos_sin_cache=cache.data_ptr(),
        num_tokens=1,
        head_dim=8,
        rotary_dim=8,
        max_pos=16,
        cache_stride=8,
        dtype=0,
        num_threads=1,
    )
    x, w, out = torch.randn(1, 64), torch.randn(64), torch.zeros(1, 64)
    prog = program.Program()
    prog.append(thunk)
    prog.append(ops.bind_rms_norm(**_rms_args(out, x, w)))
    with pytest.raises(ValueError, match="position 99"):
        prog.run()
    assert not out.any()  # the run stopped at the failing call
    positions[0] = 3
    prog.run()
    assert out.any()


def test_plan_slots_are_checked_when_bound_and_when_run():
    slots = attention.PlanSlots(1)
    kwargs = dict(
        out=0,
        q=0,
        k_cache=0,
        v_cache=0,
        q_token_stride=0,
        q_head_stride=0,
        out_token_stride=0,
        out_head_stride=0,
        scale=1.0,
        dtype=0,
    )
    with pytest.raises(IndexError):
        slots.bind_run(1, **kwargs)
    thunk = slots.bind_run(0, **kwargs)
    with pytest.raises(RuntimeError, match="not set"):
        thunk()  # no plan in the slot: refused, nothing read through the null pointers
    with pytest.raises(TypeError):
        slots.set(0, object())


def test_a_bound_attention_call_runs_the_plan_in_its_slot_at_run_time():
    """The same thunk, two plans (two steps' metadata) set in turn: each run attends with the
    plan in the slot then, as a direct ``run`` of that plan does."""
    torch.manual_seed(2)
    num_blocks, block, heads, dim = 4, 4, 2, 8
    kv = torch.randn(2, num_blocks, block, heads, dim)
    q = torch.randn(2, heads, dim)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32)
    plans = [
        paged_attention_cpu.PagedAttentionPlan(
            starts, torch.tensor(lens, dtype=torch.int32), table, q.shape, kv.shape
        )
        for lens in ([3, 7], [8, 5])
    ]
    slots = attention.PlanSlots(1)
    out = torch.empty_like(q)
    kwargs = dict(
        q=q.data_ptr(),
        k_cache=kv[0].data_ptr(),
        v_cache=kv[1].data_ptr(),
        q_token_stride=q.stride(0),
        q_head_stride=q.stride(1),
        out_token_stride=out.stride(0),
        out_head_stride=out.stride(1),
        scale=0.3,
        dtype=0,
    )
    thunk = slots.bind_run(0, out=out.data_ptr(), **kwargs)
    results = []
    for plan in plans:
        slots.set(0, plan.native)
        thunk()
        ref = torch.empty_like(q)
        plan.native.run(out=ref.data_ptr(), **kwargs)
        assert torch.equal(out, ref)
        results.append(out.clone())
    assert not torch.equal(results[0], results[1])
    slots.clear()
    with pytest.raises(RuntimeError, match="not set"):
        thunk()


@pytest.mark.parametrize("arch", ["llama", "gemma2", "mixtral"])
def test_native_replay_gives_the_python_replays_bits(tmp_path, monkeypatch, arch):
    """Native kernels only after the embedding (llama: one native run per step), torch ops between them (gemma2)
    and opaque expert calls (mixtral): the native replay, the Python replay of the same
    recorded calls and the eager forward agree on every token and logprob."""
    monkeypatch.setattr(step_program, "CAPTURE_AFTER", 1)
    path = build_tiny_model(arch, tmp_path / arch)
    eager = decode_shrinking_batch(step_runner(path, eager=True))
    results = {}
    for native in (True, False):
        monkeypatch.setattr(step_program, "NATIVE_REPLAY", native)
        runner = step_runner(path)
        results[native] = decode_shrinking_batch(runner)
        programs = runner.step_programs
        assert programs is not None and programs.reason is None
        assert sorted(programs.programs) == [1, 2, 3, 4, 5]
    assert results[True] == results[False] == eager
    for prog in programs.programs.values():
        natives = [s for s in prog.steps if getattr(s, "__name__", "") == "run"]
        python = [s for s in prog.steps if s not in natives]
        bound = sum(
            1
            for c in prog.calls
            if recording.bind(c, prog.plan_slots, {key: i for i, key in enumerate(prog.plan_keys)})
            is not None
        )
        assert bound + len(python) == len(prog.calls)
        if arch == "llama":  # the embedding's lookup (a torch op), then one native run
            assert len(python) == 1 and len(natives) == 1 and prog.steps[1] in natives
        else:
            assert len(python) > 1 and natives
