"""Step programs: a small decode step's forward replayed from its recorded native kernel calls.

At batch 1 a decode step of a 30-layer model is ~360 native kernel calls, and the Python around
them (module calls, argument checks, views, allocations) took as long as the kernels on the
CPU (benchmarks/RESULTS.md, section 19). A ``StepProgram`` is the CPU counterpart of a CUDA
graph: the forward of a step with T tokens whose requests all attend cached context (a decode
step, or one that verifies speculative drafts; no fresh prompt) runs once with a
``kernels.recording.Recording`` active; the program keeps the buffers that forward used, and
later such steps with T tokens copy their inputs (embeddings, positions, slots) into the
captured buffers, build the step's attention plan and call the recorded kernels again, in
order, with the same arguments. Same kernels, same arguments: the same bits as the eager path.
The calls' arguments are converted once, at capture, into native thunks (``bind_native``; ext/
cpu_program.h), so a replay runs the kernels without Python between them.
The capture's allocations come from the program's arena (``step_capture.Arena``): a buffer
whose tensors have died serves a later allocation, as freed memory does in the eager forward,
so a program keeps a few cache-warm slabs (about the buffers of one layer), not every layer's.

A forward is replayable only if everything it computes goes through recorded kernels. Checks,
each of which drops the program and keeps the eager path (``reason`` says why):
- a dispatch mode watches every torch op of the captured forward: only allocations and ops whose
  outputs are views of their inputs may run (anything else computes outside the recording);
- no recorded argument may point into a step input other than the three that are refreshed;
  the K/V cache writes must read the refreshed slot mapping;
- at most one attention plan ran (the step's, rebuilt by the replay from its metadata);
- no buffer of the arena was resized (moved from under the recorded pointers);
- the capture's output equals the eager forward's on the same step, and the first replay's equals
  the eager forward's on that later step (bit for bit), before a program is trusted; again on
  the first replay of the other kind of step (decode vs longer queries).
``enforce_eager`` (``--enforce-eager``) turns programs off, as it turns off CUDA graphs in vLLM.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from trillm._native import cpu_kernels
from trillm.attention.backend import AttentionMetadata
from trillm.config import TrillmConfig
from trillm.kernels import paged_attention_cpu, recording
from trillm.worker.step_capture import TorchOp, Watch, storage_ptr

logger = logging.getLogger(__name__)

# Programs for steps of 1 .. MAX_ROWS tokens: at those sizes a step reads every weight once
# whatever its rows, so the Python between kernels is a large share of it. Before the arena a
# program kept every layer's buffers (cache-cold, where the eager forward reuses freed memory)
# and was held to 32 rows; with it a program keeps a few slabs (the 8-layer benchmark model:
# 28.5 KiB per row, was 216 KiB). One thread, thread CPU time per decode step, eager / replay
# (arena; the one-buffer-per-allocation layout in brackets), eager and both replays alternated
# in one process, 5 rounds, 32-token prompts: 8 rows 1.20x (1.20x), 16 1.17x (1.15x),
# 32 1.13x (1.09x), 48 1.11x (1.05x), 64 1.14x (1.11x), 96 1.10x (1.06x), 128 1.08x (1.05x);
# 128-token prompts, 3 rounds: 48 1.11x (1.10x), 64 1.10x (1.06x), 96 1.08x, 128 1.05x.
# Replay pays at every size measured, but past 64 rows its gain (the same few ms of Python a
# step) shrinks while a program's buffers grow with its rows: larger steps stay eager, leaving
# MEMORY_BUDGET (shared by all sizes, first captured first) to the sizes that gain most.
MAX_ROWS = 64
# A budget on the programs' buffers (all sizes together): their slabs scale with rows x the
# widest layer, not with depth (benchmark model, sizes 1 .. 64: about 58 MiB; a 7B fp32 model
# ~14 MiB at 64 rows). No program is kept once they would pass it.
MEMORY_BUDGET = 256 << 20
# A capture costs three forwards and more (the recorded one under the dispatch mode, its eager
# twin, the first replay's check) and a replay saves 10-20% of one at 1-64 rows, so a program
# pays for itself after a few dozen replays: a size is captured at its CAPTURE_AFTER-th step.
# Sizes a draining batch passes through once or twice stay eager (an offline run of 96 requests
# met 45 sizes in 93 steps, 34 of them fewer than 3 times), also when the same engine runs the
# batch again; a server's steady sizes reach it within seconds. With 4 the offline benchmark
# (benchmarks/offline_cpu_time.py, 2 rounds on one engine, one thread, CPU s) captured sizes in
# its second round and ran 20.90 / 21.15, 20.75 / 22.81 s against 19.09 / 20.15, 20.10 / 19.41
# with 16 and 20.90 / 20.79, 19.77 / 20.98 without programs (alternated, 2026-12-02 15:50 UTC).
CAPTURE_AFTER = 16
# Replay through native programs (``StepProgram.bind_native``); False replays the recorded calls
# from Python, one pybind11 call each (what benchmarks/step_program.py compares it with).
NATIVE_REPLAY = True


class NotReplayable(Exception):
    """Why a forward cannot be a step program."""


@dataclass
class StepProgram:
    """One decode-step shape (T tokens): the recorded calls and the buffers they point into."""

    calls: list[recording.Call]
    input_ids: torch.Tensor  # [T] int64: a replay copies the step's inputs into these three
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64
    output: torch.Tensor  # [T, H]: the final norm's output; valid until the next replay
    plan_keys: list[tuple[Any, ...]]  # the attention plans' shapes (``PagedAttentionPlan.key``)
    # The storages the calls point into: the arena's, and new outputs of ops that write inputs.
    keep: list[torch.UntypedStorage | torch.Tensor] = field(default_factory=list)
    nbytes: int = 0  # of those storages (not the weights' or the caches')
    allocated: int = 0  # bytes the captured forward allocated, which the arena's storages serve
    # The kinds of step (decode_only) on which a replay has matched the eager forward.
    checked: set[bool] = field(default_factory=set)
    # The calls bound natively (``bind_native``): runs of native thunks (``Program.run``) and the
    # calls without a thunk (torch ops, opaque functions), in order; plan_slots holds the step's
    # attention plans while they run.
    steps: list[Callable[[], None]] = field(default_factory=list)
    plan_slots: Any = None

    def bind_native(self) -> None:
        """Convert every recorded call's arguments once (``recording.bind``): a replay then runs
        the native kernels without Python between them."""
        program, attention = cpu_kernels("program"), cpu_kernels("attention")
        if program is None or attention is None:
            raise RuntimeError("trillm._ext.cpu_kernels is not built")
        self.plan_slots = attention.PlanSlots(len(self.plan_keys))
        slot_of = {key: i for i, key in enumerate(self.plan_keys)}
        steps: list[Callable[[], None]] = []
        run = None
        for call in self.calls:
            thunk = recording.bind(call, self.plan_slots, slot_of)
            if thunk is None:
                kernel, args, kwargs = call
                assert kernel is not None  # a plan run (kernel None) always binds
                steps.append(functools.partial(kernel, *args, **kwargs))  # type: ignore[misc]
                run = None
                continue
            if run is None:
                run = program.Program()
                steps.append(run.run)
            run.append(thunk)
        self.steps = steps

    def replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [T, H]
        self.input_ids.copy_(input_ids)
        self.positions.copy_(positions)
        self.slots.copy_(meta.slot_mapping)
        plans = {
            key: paged_attention_cpu.PagedAttentionPlan(
                meta.query_start_loc, meta.seq_lens, meta.block_table, key[0], key[1]
            )
            for key in self.plan_keys
        }
        if NATIVE_REPLAY and self.plan_slots is not None:
            for i, key in enumerate(self.plan_keys):
                self.plan_slots.set(i, plans[key].native)
            try:
                for step in self.steps:
                    step()
            finally:
                self.plan_slots.clear()
            return self.output
        for kernel, args, kwargs in self.calls:
            if kernel is None:
                plans[args[0]].native.run(**kwargs)
            else:
                kernel(*args, **kwargs)
        return self.output


def step_programs_for(
    model: Callable[..., Any],
    config: TrillmConfig,
    device: torch.device,
    attn_backend: object,
    lora: bool = False,
) -> StepPrograms | None:
    """Programs for a model's forward where they apply: CPU, one rank (no collective: not
    with -dp N -ep either), no LoRA, the torch backend with its native attention kernel; not
    with enforce_eager (None otherwise)."""
    from trillm.attention.torch_backend import TorchAttentionBackend

    if (
        config.enforce_eager
        or device.type != "cpu"
        or config.parallel.joins_group
        or lora
        or not isinstance(attn_backend, TorchAttentionBackend)
        or not attn_backend.native_available
    ):
        return None
    return StepPrograms(model)


class StepPrograms:
    """The runner's programs by token count, each captured at its size's CAPTURE_AFTER-th
    step; off for good (``reason``) when the model's forward turns out not to be replayable."""

    def __init__(self, model: Callable[..., Any]) -> None:
        self.model = model  # (input_ids, positions, kv_caches, meta) -> [T, H]
        self.programs: dict[int, StepProgram] = {}
        self.nbytes = 0  # the programs' buffers (MEMORY_BUDGET at most)
        self.full = False  # a program did not fit in MEMORY_BUDGET: no more captures
        self.reason: str | None = None  # why programs are off, once they are
        self.seen: dict[int, int] = {}  # steps met, per size not captured yet

    def applies(self, meta: AttentionMetadata) -> bool:
        """A step of at most MAX_ROWS tokens whose requests all attend their cached context
        through the paged kernel: decode steps, and steps that verify drafts or continue a
        chunk (not fresh prompts, which go through the prefill kernel)."""
        if self.reason is not None or meta.num_tokens > MAX_ROWS:
            return False
        if meta.decode_only:
            return True
        lens = zip(meta.query_lens_cpu, meta.seq_lens_cpu)
        return not any(q == s > 1 for q, s in lens)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        program = self.programs.get(meta.num_tokens)
        if program is None:
            seen = self.seen[meta.num_tokens] = self.seen.get(meta.num_tokens, 0) + 1
            if self.full or seen < CAPTURE_AFTER:
                return self.model(input_ids, positions, kv_caches, meta)
            del self.seen[meta.num_tokens]
            return self._capture(input_ids, positions, kv_caches, meta)
        out = program.replay(input_ids, positions, meta)
        if meta.decode_only not in program.checked:
            # Once per program and kind of step (decode, or queries longer than one token), on
            # a step other than the captured one: the eager forward (which rewrites the same
            # K/V rows) must agree bit for bit.
            eager = self.model(input_ids, positions, kv_caches, meta)
            if not torch.equal(eager, out):
                self._give_up("a replay differs from the eager forward")
                return eager
            program.checked.add(meta.decode_only)
        return out

    def _capture(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # The program owns its inputs: nothing it points into belongs to the runner's batch.
        ids, pos = input_ids.clone(), positions.clone()
        own = replace(meta, slot_mapping=meta.slot_mapping.clone())
        forbidden = {storage_ptr(t) for t in (input_ids, positions, *_step_inputs(meta))}
        try:
            rec = recording.start()
            watch = Watch(rec, forbidden)
            with watch:
                out = self.model(ids, pos, kv_caches, own)
        except Exception as e:  # the eager forward below says whether the step itself fails
            self._give_up(f"the capture raised {type(e).__name__}: {e}")
            return self.model(input_ids, positions, kv_caches, meta)
        finally:
            recording.stop()
        # The eager forward's result is the step's (it also rewrites this step's K/V rows).
        eager = self.model(input_ids, positions, kv_caches, meta)
        try:
            program = self._program(rec, watch, (ids, pos, own.slot_mapping), meta, out)
            if not torch.equal(out, eager):
                raise NotReplayable("the recorded forward differs from the eager one")
        except NotReplayable as e:
            self._give_up(str(e))
            return eager
        if self.nbytes + program.nbytes > MEMORY_BUDGET:
            self.full = True  # no more captures; the programs kept so far stay
        else:
            self.programs[meta.num_tokens] = program
            self.nbytes += program.nbytes
        return eager

    def _program(
        self,
        rec: recording.Recording,
        watch: Watch,
        refreshed: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        out: Any,
    ) -> StepProgram:
        if watch.refused is not None:
            raise NotReplayable(f"the forward runs an op a replay cannot repeat ({watch.refused})")
        if not isinstance(out, torch.Tensor):
            raise NotReplayable("the forward does not return one hidden-state tensor")
        if watch.arena.moved():
            raise NotReplayable("the forward resized a buffer that recorded calls point into")
        keys = list(dict.fromkeys(args[0] for kernel, args, _ in rec.calls if kernel is None))
        if not all(key[2] for key in keys):
            raise NotReplayable("an attention plan attends only some requests")
        ids, positions, slots = refreshed
        calls = watch.calls()
        _check_pointers(calls, _step_inputs(meta), refreshed)
        for kernel, _, kwargs in calls:
            if kernel is not None and not isinstance(kernel, TorchOp) and "slot_mapping" in kwargs:
                if kwargs["slot_mapping"] != slots.data_ptr():
                    raise NotReplayable("a K/V cache write reads another slot mapping")
        program = StepProgram(
            calls=calls,
            input_ids=ids,
            positions=positions,
            slots=slots,
            output=out,
            plan_keys=keys,
            keep=[*watch.arena.storages, *watch.pinned],
            nbytes=watch.arena.nbytes + sum(t.untyped_storage().nbytes() for t in watch.pinned),
            allocated=watch.arena.served,
        )
        try:
            program.bind_native()
        # a call the binder cannot convert; AttributeError: an extension built before cpu_program
        except (TypeError, ValueError, RuntimeError, AttributeError) as e:
            raise NotReplayable(f"a recorded call cannot be bound natively ({e})") from e
        return program

    def _give_up(self, reason: str) -> None:
        self.reason = reason
        self.programs.clear()
        self.nbytes = 0
        logger.info("Decode-step replay is off for this model: %s; it runs eagerly.", reason)


def _step_inputs(meta: AttentionMetadata) -> list[torch.Tensor]:
    """The step's metadata tensors: new every step, read by the attention plan only."""
    return [
        t
        for t in (meta.query_start_loc, meta.seq_lens, meta.context_lens, meta.block_table)
        if isinstance(t, torch.Tensor)
    ]


def _check_pointers(
    calls: list[recording.Call],
    step_inputs: list[torch.Tensor],
    refreshed: tuple[torch.Tensor, ...],
) -> None:
    """No recorded argument may point into a step input that a replay does not refresh."""
    fresh = {t.data_ptr() for t in refreshed}
    spans = [
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for t in step_inputs
        if t.numel() and t.data_ptr() not in fresh
    ]
    for _, args, kwargs in calls:
        for v in (*args, *kwargs.values()):
            if isinstance(v, torch.Tensor) and v.numel():  # an opaque call's tensors
                v = v.data_ptr()
            if isinstance(v, int) and not isinstance(v, bool):
                if any(lo <= v < hi for lo, hi in spans):
                    raise NotReplayable("a kernel reads a step input that a replay cannot refresh")
