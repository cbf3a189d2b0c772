"""The capture of a step program (``trillm/worker/step_program.py``): the torch dispatch mode
that watches the recorded forward, and the arena its buffers come from.

``Watch`` sees every torch op of the forward: allocations are served from the program's
``Arena``; ops that compute are recorded (``TorchOp``) with their results moved into the arena;
views need nothing; ops a replay cannot repeat are noted (the program is then refused). The
arena hands a storage none of whose tensors is alive any more to the next allocation it holds,
as freed memory serves the eager forward, so a program keeps a few cache-warm slabs instead of
every layer's buffers. Recorded calls that hold arena tensors (torch ops, opaque calls) hold
them by place (``ArenaView``) while the capture runs, so they do not keep a storage from being
handed on; ``calls_with_tensors`` turns them back into tensors once it is over.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trillm.kernels import recording

_ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty"})
# Ops a replay cannot repeat: data from Python (a constant made in the forward) or read back.
_UNREPLAYABLE = frozenset({"lift_fresh", "lift_fresh_copy", "_local_scalar_dense", "item"})
_UNREPLAYABLE_TAGS = (
    torch.Tag.nondeterministic_seeded,  # random
    torch.Tag.dynamic_output_shape,  # the shape depends on the data
    torch.Tag.data_dependent_output,
)


def _tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(_tensors(v))
    return out


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class TorchOp:
    """A torch op of the captured forward, replayed on the captured tensors: an op that writes
    its inputs runs again as it is; one that makes new outputs runs and its results are copied
    into the captured outputs (which later ops read)."""

    def __init__(self, func: Any, outputs: list[torch.Tensor], writes: bool) -> None:
        self.func, self.writes = func, writes
        self.outputs: list[Any] = list(outputs)  # tensors (``ArenaView`` during the capture)

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        result = self.func(*args, **kwargs)
        if not self.writes:
            new = _tensors(result if isinstance(result, (list, tuple)) else [result])
            for captured, value in zip(self.outputs, new):
                captured.copy_(value)


def _unused(storage: torch.UntypedStorage) -> bool:
    """No tensor or view holds ``storage`` any more: only the arena's own reference is left
    (torch hands out one Python object per storage, so the count does not see the arena twice;
    model code holds tensors, not storage objects)."""
    return torch._C._storage_Use_Count(storage._cdata) == 1


class ArenaView:
    """An arena tensor that a recorded call holds during the capture: its storage and place,
    which do not count as a use of the storage (``_unused``), and the tensor again after it."""

    __slots__ = ("storage", "offset", "size", "stride", "dtype")

    def __init__(self, t: torch.Tensor, storage: torch.UntypedStorage) -> None:
        self.storage, self.offset, self.dtype = storage, t.storage_offset(), t.dtype
        self.size, self.stride = t.size(), t.stride()

    def tensor(self) -> torch.Tensor:
        empty = torch.empty(0, dtype=self.dtype, device=self.storage.device)
        return empty.set_(self.storage, self.offset, self.size, self.stride)


def _replace(v: Any, fn: Callable[[Any], Any]) -> Any:
    """v with fn applied to the tensors and views in it, through lists and plain tuples (v
    itself where nothing changed; other containers keep their tensors)."""
    if isinstance(v, (torch.Tensor, ArenaView)):
        return fn(v)
    if type(v) in (list, tuple):
        new = [_replace(x, fn) for x in v]
        if all(a is b for a, b in zip(new, v)):
            return v
        return new if isinstance(v, list) else tuple(new)
    return v


def _replace_in_calls(calls: list[recording.Call], start: int, fn: Callable[[Any], Any]) -> None:
    for i in range(start, len(calls)):
        kernel, args, kwargs = calls[i]
        if isinstance(kernel, TorchOp):
            kernel.outputs = _replace(kernel.outputs, fn)
        calls[i] = (kernel, _replace(args, fn), {k: _replace(v, fn) for k, v in kwargs.items()})


class Arena:
    """The storages a program's buffers live in. During the capture every allocation of the
    forward is served from here, as the eager forward's are from freed memory: a storage none
    of whose tensors and views is alive any more goes to the next allocation it holds (the
    smallest such), a new storage only when none fits. The recorded native calls keep raw
    pointers, not tensors, and a replay calls them in the captured order, so a storage's old
    tensor has had its last use when its new one is first written: a program keeps a few
    cache-warm slabs, not one buffer per layer. Recorded torch ops and opaque calls hold the
    arena's tensors by place (``ArenaView``) for the same reason; the forward's output and
    anything the model keeps stay alive, so their storages are never handed on."""

    def __init__(self) -> None:
        self.storages: list[torch.UntypedStorage] = []
        self.by_ptr: dict[int, torch.UntypedStorage] = {}
        self.served = 0  # bytes of the tensors served (what the program would keep without reuse)

    def like(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor of t's dtype, size and strides in one of the arena's storages."""
        need = t.untyped_storage().nbytes()
        self.served += need
        best: torch.UntypedStorage | None = None
        for s in self.storages:
            if s.nbytes() >= need and (best is None or s.nbytes() < best.nbytes()) and _unused(s):
                best = s
        if best is None:
            best = torch.UntypedStorage(need)
            self.storages.append(best)
            self.by_ptr[best.data_ptr()] = best
        empty = torch.empty(0, dtype=t.dtype, device=t.device)
        return empty.set_(best, t.storage_offset(), t.size(), t.stride())

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.storages)

    def moved(self) -> bool:
        """Whether a storage was resized (its memory moved from under the recorded pointers)."""
        return any(ptr != s.data_ptr() for ptr, s in self.by_ptr.items())


class Watch(TorchDispatchMode):
    """Records every torch op of the captured forward that computes (views and allocations
    need nothing at replay), serves its allocations and the results of the ops it records from
    the program's arena, and notes the first op that cannot be replayed: random,
    data-dependent or reading a step input that a replay does not refresh."""

    def __init__(self, rec: recording.Recording, forbidden: set[int]) -> None:
        super().__init__()
        self.rec = rec
        self.forbidden = forbidden  # storages of step inputs a replay does not refresh
        self.arena = Arena()
        self.pinned: list[torch.Tensor] = []  # new outputs of recorded ops that write an input
        self.refused: str | None = None
        self.by_place = 0  # calls[:by_place] hold the arena's tensors by place

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch's documented hook: by default a mode's __torch_dispatch__ is wrapped in dynamo's
        # disable, whose first call imports torch._dynamo (1.1 s of CPU, on the first capture:
        # 5% of the offline benchmark's run, a one-off stall in a server). No torch.compile runs
        # under this mode, so there is nothing to disable.
        return False

    def _in_arena(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu" or t.untyped_storage().nbytes() == 0:
            return t
        return self.arena.like(t)

    def _by_place(self, v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            storage = self.arena.by_ptr.get(storage_ptr(v))
            if storage is not None:
                return ArenaView(v, storage)
        return v

    def calls(self) -> list[recording.Call]:
        """The recorded calls, holding tensors again (once the capture is over)."""
        _replace_in_calls(
            self.rec.calls, 0, lambda v: v.tensor() if isinstance(v, ArenaView) else v
        )
        return self.rec.calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if recording.in_opaque():  # recorded as one call, which a replay repeats as a whole
            return func(*args, **kwargs)
        # The calls recorded since the last op (this mode's torch ops, opaque calls) hold the
        # arena's tensors by place: a replay repeats them in order, as it does the native calls
        # that hold raw pointers, so they need not keep a storage from serving later tensors.
        _replace_in_calls(self.rec.calls, self.by_place, self._by_place)
        self.by_place = len(self.rec.calls)
        out = func(*args, **kwargs)
        if func.overloadpacket.__name__ in _ALLOCATIONS:
            return self._in_arena(out) if isinstance(out, torch.Tensor) else out
        if self.refused is not None:
            return out
        inputs = _tensors([*args, *kwargs.values()])
        if (
            func.overloadpacket.__name__ in _UNREPLAYABLE
            or any(tag in func.tags for tag in _UNREPLAYABLE_TAGS)
            or any(storage_ptr(t) in self.forbidden for t in inputs)
        ):
            self.refused = str(func)
            return out
        schema = func._schema
        writes = schema.is_mutable or any(
            a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
        )
        sources = {storage_ptr(t) for t in inputs}
        outputs = _tensors(out if isinstance(out, (list, tuple)) else [out])
        fresh = [t for t in outputs if storage_ptr(t) not in sources]
        if not writes and fresh:
            # It computes new tensors: a replay runs it again and copies its results into
            # these, which live in the arena (the copy is exact).
            if isinstance(out, torch.Tensor):
                out = self._in_arena(out).copy_(out)
                outputs = [out]
            elif isinstance(out, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in out):
                moved = [
                    self._in_arena(t).copy_(t) if any(t is f for f in fresh) else t for t in out
                ]
                out = type(out)(moved) if isinstance(out, tuple) else moved
                outputs = list(moved)
            else:  # nested results: kept as they are
                self.pinned.extend(fresh)
            self.rec.calls.append((TorchOp(func, outputs, writes), args, kwargs))
        elif writes:
            self.rec.calls.append((TorchOp(func, outputs, writes), args, kwargs))
            self.pinned.extend(fresh)
        return out
