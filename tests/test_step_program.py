"""Step programs (trillm/worker/step_program.py): small decode steps replayed from their
recorded kernel calls give the same bits as the eager forward, on every architecture that
replays; a forward that cannot be replayed falls back to eager, with the reason.

The runner is driven by the small scheduler of tests/test_model_runner.py; requests of
different lengths finish at different steps, so the batch shrinks through several token counts
(one program each), and contexts cross block boundaries while programs replay.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_model_runner import BLOCK_SIZE, NUM_BLOCKS, MiniScheduler, _prompts, _Req
from trillm.config import EngineArgs
from trillm.engine.config_builder import build_config
from trillm.sampling_params import SamplingParams
from trillm.testing.tiny_models import build_tiny_model
from trillm.worker import step_program
from trillm.worker.model_runner import ModelRunner
from trillm.worker.step_program import NotReplayable, StepPrograms, _check_pointers

pytestmark = pytest.mark.usefixtures("one_torch_thread", "capture_at_once")


@pytest.fixture
def capture_at_once(monkeypatch):
    """Each size captured at its first step (the default waits for a size's 4th): these
    requests meet each batch size for 3 steps."""
    monkeypatch.setattr(step_program, "CAPTURE_AFTER", 1)


PROMPT_LENS = [3, 29, 12, 41, 8]
# Layouts that differ in what their forward runs: biases (qwen2), q/k norms (qwen3), an
# embedding scale, windows and soft-caps (gemma2), partial rotary and a fused qkv (phi3),
# LayerNorm and parallel residuals (gpt_neox), experts chosen per token (mixtral; qwen2_moe with
# its gated shared expert: the grouping by expert is one opaque call that a replay repeats).
ARCHES = ["llama", "qwen2", "qwen3", "gemma2", "phi3", "gpt_neox", "mixtral", "qwen2_moe"]


def _runner(path, *, eager: bool = False, dtype: str = "float32") -> ModelRunner:
    args = EngineArgs(
        model=str(path), dtype=dtype, device="cpu", block_size=BLOCK_SIZE, max_num_seqs=16,
        max_model_len=256, num_gpu_blocks_override=NUM_BLOCKS,
        distributed_executor_backend="uni", enforce_eager=eager,
    )  # fmt: skip
    runner = ModelRunner(build_config(args))
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_blocks())
    return runner


def _decode(runner: ModelRunner, lens=PROMPT_LENS, seed: int | None = None):
    """Each request's tokens and per-step logprobs (greedy, or seeded sampling)."""
    sched = MiniScheduler(runner)
    reqs = []
    for i, prompt in enumerate(_prompts(lens)):
        n = 4 + 3 * i  # the batch shrinks as they finish
        if seed is None:
            params = SamplingParams(temperature=0.0, max_tokens=n, logprobs=3)
        else:
            params = SamplingParams(temperature=1.0, top_p=0.9, seed=seed + i, max_tokens=n,
                                    logprobs=3)  # fmt: skip
        reqs.append(_Req(f"r{i}", prompt, params, n))
        sched.add(reqs[-1])
    sched.run()
    return [r.output for r in reqs], [r.logprobs for r in reqs]


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
    eager = _decode(_runner(arch_model, eager=True))
    runner = _runner(arch_model)
    programs = runner.step_programs
    assert programs is not None
    counting = programs.model = _Counting(programs.model)
    replayed = _decode(runner)
    assert replayed == eager  # tokens and logprobs, exactly
    assert programs.reason is None
    sizes = sorted(programs.programs)
    assert sizes == [1, 2, 3, 4, 5]
    # Every program's replay matched the eager forward on a decode step (the only kind here).
    assert all(p.checked == {True} for p in programs.programs.values())
    # Per token count: the capture, its eager twin, one verifying eager forward; every other
    # decode step of the 4 + 7 + 10 + 13 + 16 - 5 = 45 is a replay.
    assert counting.calls == 3 * len(sizes)


@pytest.mark.parametrize("after", [2, 4])
def test_a_size_is_captured_at_its_capture_after_th_step(tmp_path, monkeypatch, after):
    """Sizes met fewer than CAPTURE_AFTER times run eagerly (no capture cost for a size a
    draining batch passes through); at the CAPTURE_AFTER-th step the size is captured."""
    monkeypatch.setattr(step_program, "CAPTURE_AFTER", after)
    path = build_tiny_model("llama", tmp_path / "llama")
    eager = _decode(_runner(path, eager=True))
    runner = _runner(path)
    programs = runner.step_programs
    assert programs is not None
    counting = programs.model = _Counting(programs.model)
    assert _decode(runner) == eager
    # Each of the sizes 5 .. 1 decodes 3 steps.
    if after == 2:  # step 1 eager, step 2 the capture and its twin, step 3 a checked replay
        assert sorted(programs.programs) == [1, 2, 3, 4, 5]
        assert counting.calls == 5 * (1 + 2 + 1)
    else:
        assert programs.programs == {} and programs.seen == {n: 3 for n in range(1, 6)}
        assert counting.calls == 5 * 3


def test_seeded_sampling_and_bf16_replay_exactly(tmp_path):
    path = build_tiny_model("llama", tmp_path / "llama")
    assert _decode(_runner(path), seed=7) == _decode(_runner(path, eager=True), seed=7)
    bf16 = _runner(path, dtype="bfloat16")
    assert _decode(bf16) == _decode(_runner(path, eager=True, dtype="bfloat16"))
    assert bf16.step_programs is not None and bf16.step_programs.reason is None
    assert sorted(bf16.step_programs.programs) == [1, 2, 3, 4, 5]


def test_a_forward_that_cannot_be_replayed_runs_eagerly(tmp_path, monkeypatch):
    """An op whose data comes from Python inside the forward (here a constant made by
    torch.tensor in the MLP) cannot be repeated by a replay: the programs give up, naming it,
    and the output is the eager forward's."""
    path = build_tiny_model("llama", tmp_path / "llama")
    eager = _decode(_runner(path, eager=True))
    runner = _runner(path)
    for layer in runner.model.model.layers:
        mlp = layer.mlp
        forward = mlp.forward
        monkeypatch.setattr(mlp, "forward", lambda x, f=forward: f(x) * torch.tensor(1.0))
    assert _decode(runner) == eager
    assert runner.step_programs is not None
    assert "aten.lift_fresh" in (runner.step_programs.reason or "")
    assert runner.step_programs.programs == {}


def test_a_replay_that_differs_from_eager_turns_programs_off(tmp_path):
    """The first replay of each program is checked against the eager forward on that step: a
    program whose recorded calls no longer compute the forward (one call dropped here) is
    thrown away and the step's output is the eager one."""
    path = build_tiny_model("llama", tmp_path / "llama")
    eager = _decode(_runner(path, eager=True))
    runner = _runner(path)
    programs = runner.step_programs
    assert programs is not None
    capture = programs._capture

    def capture_then_break(*args):
        out = capture(*args)
        for program in programs.programs.values():
            del program.calls[len(program.calls) // 2]
        return out

    programs._capture = capture_then_break
    assert _decode(runner) == eager
    assert programs.reason == "a replay differs from the eager forward"


def test_steps_past_the_largest_program_run_eagerly(tmp_path, monkeypatch):
    monkeypatch.setattr(step_program, "MAX_ROWS", 3)
    path = build_tiny_model("llama", tmp_path / "llama")
    runner = _runner(path)
    assert _decode(runner) == _decode(_runner(path, eager=True))
    assert runner.step_programs is not None
    assert sorted(runner.step_programs.programs) == [1, 2, 3]


def test_programs_stop_at_the_memory_budget(tmp_path, monkeypatch):
    """Programs keep their forward's buffers: once the next would pass the budget no more are
    captured (the batch shrinks 5 -> 1, so the first capture is the largest); the steps of
    other sizes run eagerly, with the same output."""
    path = build_tiny_model("llama", tmp_path / "llama")
    probe = _runner(path)
    _decode(probe)
    assert probe.step_programs is not None
    sizes = {n: p.nbytes for n, p in probe.step_programs.programs.items()}
    assert sizes[5] > sizes[4] > sizes[1] > 0
    monkeypatch.setattr(step_program, "MEMORY_BUDGET", sizes[5] + sizes[4] // 2)
    runner = _runner(path)
    assert _decode(runner) == _decode(_runner(path, eager=True))
    programs = runner.step_programs
    assert programs is not None and programs.full
    assert sorted(programs.programs) == [5] and programs.nbytes == sizes[5]


def test_enforce_eager_turns_programs_off(tmp_path):
    path = build_tiny_model("llama", tmp_path / "llama")
    assert _runner(path, eager=True).step_programs is None
    assert isinstance(_runner(path).step_programs, StepPrograms)


def test_a_kernel_reading_a_step_input_that_is_not_refreshed_is_refused():
    block_table = torch.zeros(2, 4, dtype=torch.int32)
    slots = torch.zeros(2, dtype=torch.int64)
    inside = block_table.data_ptr() + 4
    with pytest.raises(NotReplayable, match="step input"):
        _check_pointers([(print, (inside,), {})], [block_table], (slots,))
    _check_pointers([(print, (), {"slot_mapping": slots.data_ptr()})], [block_table], (slots,))


def test_a_capture_that_raises_gives_up_and_the_step_runs_eagerly(tmp_path, monkeypatch):
    path = build_tiny_model("llama", tmp_path / "llama")
    eager = _decode(_runner(path, eager=True))
    runner = _runner(path)

    def refuse():
        raise RuntimeError("no recording here")

    monkeypatch.setattr(step_program.recording, "start", refuse)
    assert _decode(runner) == eager
    assert runner.step_programs is not None
    assert runner.step_programs.reason == "the capture raised RuntimeError: no recording here"


def test_a_capture_does_not_import_torch_dynamo(tmp_path):
    """The recording mode tells torch it needs no dynamo guard: by default a dispatch mode's
    first call imports torch._dynamo (about 1 s of CPU, a stall on the first capture). In a
    fresh interpreter, since this one may have imported it already."""
    path = build_tiny_model("llama", tmp_path / "m")
    script = (
        "import sys\n"
        "from tests.test_step_program import _decode, _runner\n"
        "from trillm.worker import step_program\n"
        "step_program.CAPTURE_AFTER = 1\n"
        f"runner = _runner({str(path)!r})\n"
        "_decode(runner)\n"
        "assert sorted(runner.step_programs.programs) == [1, 2, 3, 4, 5]\n"
        "print('dynamo' if 'torch._dynamo' in sys.modules else 'no dynamo')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["no", "dynamo"], out.stdout
