"""Step programs (trillm/worker/step_program.py): small decode steps replayed from their
recorded kernel calls give the same bits as the eager forward, on every architecture that
replays; a forward that cannot be replayed falls back to eager, with the reason.

The runner is driven by the small scheduler of tests/worker/test_model_runner.py; requests of
different lengths finish at different steps, so the batch shrinks through several token counts
(one program each), and contexts cross block boundaries while programs replay.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runner_harness import MiniScheduler, Req, random_prompts
from step_runs import decode_shrinking_batch, step_runner
from torch.utils._python_dispatch import TorchDispatchMode

from trillm.kernels import recording
from trillm.sampling_params import SamplingParams
from trillm.testing.tiny_models import build_tiny_model
from trillm.worker import step_program
from trillm.worker.model_runner import ModelRunner
from trillm.worker.step_capture import _tensors
from trillm.worker.step_program import NotReplayable, StepPrograms, _check_pointers

pytestmark = pytest.mark.usefixtures("one_torch_thread", "capture_at_once")


@pytest.fixture
def capture_at_once(monkeypatch):
    """Each size captured at its first step (the default waits for a size's 4th): these
    requests meet each batch size for 3 steps."""
    monkeypatch.setattr(step_program, "CAPTURE_AFTER", 1)


# Layouts that differ in what their forward runs: biases (qwen2), q/k norms (qwen3), an
# embedding scale, windows and soft-caps (gemma2), partial rotary and a fused qkv (phi3),
# LayerNorm and parallel residuals (gpt_neox), experts chosen per token (mixtral; qwen2_moe with
# its gated shared expert: the grouping by expert is one opaque call that a replay repeats).
ARCHES = ["llama", "qwen2", "qwen3", "gemma2", "phi3", "gpt_neox", "mixtral", "qwen2_moe"]


class _Counting:
    """The model, counting its eager forwards."""

    def __init__(self, model) -> None:
        self.model, self.calls = model, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)


@pytest.fixture(scope="module", params=ARCHES)
def arch_model(request, tmp_path_factory):
    return build_tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def test_replay_gives_the_eager_bits_and_replaces_the_eager_forward(arch_model):
    eager = decode_shrinking_batch(step_runner(arch_model, eager=True))
    runner = step_runner(arch_model)
    programs = runner.step_programs
    assert programs is not None
    counting = programs.model = _Counting(programs.model)
    replayed = decode_shrinking_batch(runner)
    assert replayed == eager  # tokens and logprobs, exactly
    assert programs.reason is None
    sizes = sorted(programs.programs)
    assert sizes == [1, 2, 3, 4, 5]
    # Every program's replay matched the eager forward on a decode step (the only kind here).
    assert all(p.checked == {True} for p in programs.programs.values())
    # Per token count: the capture, its eager twin, one verifying eager forward; every other
    # decode step of the 4 + 7 + 10 + 13 + 16 - 5 = 45 is a replay.
    assert counting.calls == 3 * len(sizes)


class _Alternating(MiniScheduler):
    """Steps that schedule the requests of one group, then the other's, in turn (the other
    group's requests wait): the two groups' step sizes interleave."""

    def __init__(self, runner: ModelRunner, groups: list[list[Req]]) -> None:
        super().__init__(runner)
        self.groups = groups

    def run(self) -> None:
        turn = 0
        while any(r in self.active for g in self.groups for r in g):
            group = [r for r in self.groups[turn % 2] if r in self.active]
            turn += 1
            if group:
                waiting = [r for r in self.active if r not in group]
                self.active = group
                self.step()
                self.active += waiting


def _alternate(runner: ModelRunner, big: int):
    """Tokens and logprobs of a group of ``big`` requests (most finish after 4 tokens, 6 after
    6) decoding in turn with a group of 3 (9 tokens): step sizes big, 3, big, 3, ..., 6, 3."""
    prompts = random_prompts([2 + i % 7 for i in range(big + 3)], seed=3)
    params = lambda n: SamplingParams(temperature=0.0, max_tokens=n, logprobs=2)  # noqa: E731
    a = [
        Req(f"a{i}", p, params(6 if i < 6 else 4), 6 if i < 6 else 4)
        for i, p in enumerate(prompts[:big])
    ]
    b = [Req(f"b{i}", p, params(9), 9) for i, p in enumerate(prompts[big:])]
    sched = _Alternating(runner, [a, b])
    for req in a + b:
        sched.add(req)
    sched.run()
    return [r.output for r in a + b], [r.logprobs for r in a + b]


class _Allocations(TorchDispatchMode):
    """Bytes of the new tensors (allocations and results of ops that compute) of a captured
    forward, outside its opaque calls: what its program would keep without reuse."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as the step programs' watch: no torch._dynamo import

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if recording._state.active is not None:  # capturing, outside opaque calls
            inputs = {
                t.untyped_storage().data_ptr() for t in _tensors([*args, *(kwargs or {}).values()])
            }
            for t in _tensors(out if isinstance(out, (list, tuple)) else [out]):
                if t.untyped_storage().data_ptr() not in inputs:
                    self.nbytes += t.nbytes
        return out


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("deep"), num_hidden_layers=6)


# Native kernels only (llama); torch ops recorded between them (gemma2's norms and soft-caps);
# opaque expert calls (mixtral).
@pytest.fixture(scope="module", params=["llama", "gemma2", "mixtral"])
def deep_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"deep-{request.param}")
    return build_tiny_model(request.param, path, num_hidden_layers=6)


def test_programs_of_the_largest_size_interleaved_with_small_ones_replay_exactly(deep_llama):
    """Programs of MAX_ROWS tokens and of a few, replayed in turn (each program's buffers are
    its own, so one does not disturb the other), give the eager bits."""
    big = step_program.MAX_ROWS
    eager = _alternate(step_runner(deep_llama, eager=True, seqs=big + 3), big)
    runner = step_runner(deep_llama, seqs=big + 3)
    programs = runner.step_programs
    assert programs is not None
    counting = programs.model = _Counting(programs.model)
    assert _alternate(runner, big) == eager
    assert programs.reason is None
    assert sorted(programs.programs) == [3, 6, big]
    assert all(p.checked == {True} for p in programs.programs.values())
    # 3 forwards per size (capture, its twin, the checked replay); every other decode step of
    # 3 + 5 + 8 replays.
    assert counting.calls == 3 * 3


def test_a_program_keeps_a_few_slabs_not_every_buffer_of_its_forward(deep_model):
    """The arena: a buffer whose tensors died during the capture serves later allocations, so
    a program keeps a fraction of the bytes its forward allocates (6 layers: every layer's
    buffers fit in the first one's), also where recorded torch ops and opaque calls hold
    buffers (by place while the capture runs)."""
    runner = step_runner(deep_model)
    programs = runner.step_programs
    assert programs is not None
    model, counts = programs.model, {}

    def counted(input_ids, *args):
        with _Allocations() as mode:
            out = model(input_ids, *args)
        if mode.nbytes:  # the capture
            counts[len(input_ids)] = mode.nbytes
        return out

    programs.model = counted
    assert decode_shrinking_batch(runner) == decode_shrinking_batch(
        step_runner(deep_model, eager=True)
    )
    assert programs.reason is None and sorted(programs.programs) == [1, 2, 3, 4, 5]
    for rows, program in programs.programs.items():
        assert program.allocated == counts[rows]
        assert 0 < program.nbytes < counts[rows] / 4, (rows, program.nbytes, counts[rows])


@pytest.mark.parametrize("after", [2, 4])
def test_a_size_is_captured_at_its_capture_after_th_step(tmp_path, monkeypatch, after):
    """Sizes met fewer than CAPTURE_AFTER times run eagerly (no capture cost for a size a
    draining batch passes through); at the CAPTURE_AFTER-th step the size is captured."""
    monkeypatch.setattr(step_program, "CAPTURE_AFTER", after)
    path = build_tiny_model("llama", tmp_path / "llama")
    eager = decode_shrinking_batch(step_runner(path, eager=True))
    runner = step_runner(path)
    programs = runner.step_programs
    assert programs is not None
    counting = programs.model = _Counting(programs.model)
    assert decode_shrinking_batch(runner) == eager
    # Each of the sizes 5 .. 1 decodes 3 steps.
    if after == 2:  # step 1 eager, step 2 the capture and its twin, step 3 a checked replay
        assert sorted(programs.programs) == [1, 2, 3, 4, 5]
        assert counting.calls == 5 * (1 + 2 + 1)
    else:
        assert programs.programs == {} and programs.seen == {n: 3 for n in range(1, 6)}
        assert counting.calls == 5 * 3


def test_seeded_sampling_and_bf16_replay_exactly(tmp_path):
    path = build_tiny_model("llama", tmp_path / "llama")
    assert decode_shrinking_batch(step_runner(path), seed=7) == decode_shrinking_batch(
        step_runner(path, eager=True), seed=7
    )
    bf16 = step_runner(path, dtype="bfloat16")
    assert decode_shrinking_batch(bf16) == decode_shrinking_batch(
        step_runner(path, eager=True, dtype="bfloat16")
    )
    assert bf16.step_programs is not None and bf16.step_programs.reason is None
    assert sorted(bf16.step_programs.programs) == [1, 2, 3, 4, 5]


def test_a_forward_that_cannot_be_replayed_runs_eagerly(tmp_path, monkeypatch):
    """An op whose data comes from Python inside the forward (here a constant made by
    torch.tensor in the MLP) cannot be repeated by a replay: the programs give up, naming it,
    and the output is the eager forward's."""
    path = build_tiny_model("llama", tmp_path / "llama")
    eager = decode_shrinking_batch(step_runner(path, eager=True))
    runner = step_runner(path)
    for layer in runner.model.model.layers:
        mlp = layer.mlp
        forward = mlp.forward
        monkeypatch.setattr(mlp, "forward", lambda x, f=forward: f(x) * torch.tensor(1.0))
    assert decode_shrinking_batch(runner) == eager
    assert runner.step_programs is not None
    assert "aten.lift_fresh" in (runner.step_programs.reason or "")
    assert runner.step_programs.programs == {}


def test_a_replay_that_differs_from_eager_turns_programs_off(tmp_path):
    """The first replay of each program is checked against the eager forward on that step: a
    program whose recorded calls no longer compute the forward (one call dropped here) is
    thrown away and the step's output is the eager one."""
    path = build_tiny_model("llama", tmp_path / "llama")
    eager = decode_shrinking_batch(step_runner(path, eager=True))
    runner = step_runner(path)
    programs = runner.step_programs
    assert programs is not None
    capture = programs._capture

    def capture_then_break(*args):
        out = capture(*args)
        for program in programs.programs.values():
            del program.calls[len(program.calls) // 2]
            program.bind_native()  # what a replay runs
        return out

    programs._capture = capture_then_break
    assert decode_shrinking_batch(runner) == eager
    assert programs.reason == "a replay differs from the eager forward"


def test_steps_past_the_largest_program_run_eagerly(tmp_path, monkeypatch):
    monkeypatch.setattr(step_program, "MAX_ROWS", 3)
    path = build_tiny_model("llama", tmp_path / "llama")
    runner = step_runner(path)
    assert decode_shrinking_batch(runner) == decode_shrinking_batch(step_runner(path, eager=True))
    assert runner.step_programs is not None
    assert sorted(runner.step_programs.programs) == [1, 2, 3]


def test_programs_stop_at_the_memory_budget(tmp_path, monkeypatch):
    """Programs keep their forward's buffers: once the next would pass the budget no more are
    captured (the batch shrinks 5 -> 1, so the first capture is the largest); the steps of
    other sizes run eagerly, with the same output."""
    path = build_tiny_model("llama", tmp_path / "llama")
    probe = step_runner(path)
    decode_shrinking_batch(probe)
    assert probe.step_programs is not None
    sizes = {n: p.nbytes for n, p in probe.step_programs.programs.items()}
    assert sizes[5] > sizes[4] > sizes[1] > 0
    monkeypatch.setattr(step_program, "MEMORY_BUDGET", sizes[5] + sizes[4] // 2)
    runner = step_runner(path)
    assert decode_shrinking_batch(runner) == decode_shrinking_batch(step_runner(path, eager=True))
    programs = runner.step_programs
    assert programs is not None and programs.full
    assert sorted(programs.programs) == [5] and programs.nbytes == sizes[5]


def test_enforce_eager_turns_programs_off(tmp_path):
    path = build_tiny_model("llama", tmp_path / "llama")
    assert step_runner(path, eager=True).step_programs is None
    assert isinstance(step_runner(path).step_programs, StepPrograms)


def test_a_kernel_reading_a_step_input_that_is_not_refreshed_is_refused():
    block_table = torch.zeros(2, 4, dtype=torch.int32)
    slots = torch.zeros(2, dtype=torch.int64)
    inside = block_table.data_ptr() + 4
    with pytest.raises(NotReplayable, match="step input"):
        _check_pointers([(print, (inside,), {})], [block_table], (slots,))
    _check_pointers([(print, (), {"slot_mapping": slots.data_ptr()})], [block_table], (slots,))


def test_a_capture_that_raises_gives_up_and_the_step_runs_eagerly(tmp_path, monkeypatch):
    path = build_tiny_model("llama", tmp_path / "llama")
    eager = decode_shrinking_batch(step_runner(path, eager=True))
    runner = step_runner(path)

    def refuse():
        raise RuntimeError("no recording here")

    monkeypatch.setattr(step_program.recording, "start", refuse)
    assert decode_shrinking_batch(runner) == eager
    assert runner.step_programs is not None
    assert runner.step_programs.reason == "the capture raised RuntimeError: no recording here"


def test_a_capture_does_not_import_torch_dynamo(tmp_path):
    """The recording mode tells torch it needs no dynamo guard: by default a dispatch mode's
    first call imports torch._dynamo (about 1 s of CPU, a stall on the first capture). In a
    fresh interpreter, since this one may have imported it already."""
    path = build_tiny_model("llama", tmp_path / "m")
    script = (
        "import sys\n"
        "sys.path.insert(0, 'tests/support')\n"  # the cwd is the repository root
        "from step_runs import decode_shrinking_batch, step_runner\n"
        "from trillm.worker import step_program\n"
        "step_program.CAPTURE_AFTER = 1\n"
        f"runner = step_runner({str(path)!r})\n"
        "decode_shrinking_batch(runner)\n"
        "assert sorted(runner.step_programs.programs) == [1, 2, 3, 4, 5]\n"
        "print('dynamo' if 'torch._dynamo' in sys.modules else 'no dynamo')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["no", "dynamo"], out.stdout
