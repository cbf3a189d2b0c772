"""Errors that cross module boundaries: the engine, the executors and the IPC layer.

Each failure has its own type so callers can tell "this step failed" (the engine fails the
affected requests and carries on) from "the engine is gone" (every request fails, ``/health``
answers 503).
"""

from __future__ import annotations


class TrillmError(Exception):
    """Base class of trillm's own errors."""


class EngineDeadError(TrillmError):
    """The engine cannot serve any more: a worker process died or stopped answering.

    Raised by every in-flight and every later executor call once the supervisor has seen the
    failure; the message names the rank and the exit code or signal.
    """


class EngineStartupError(EngineDeadError):
    """A worker failed while loading the model or allocating the KV cache."""


class ModelExecutionError(TrillmError):
    """One step failed inside a worker (an exception in ``execute_model``/``sample_tokens``).

    The worker stays alive and keeps its state; the engine fails the requests of that step.
    ``output`` is the worker's ``ModelRunnerOutput`` whose ``error`` holds the traceback.
    """

    def __init__(self, message: str, *, rank: int, step_id: int, output: object = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.step_id = step_id
        self.output = output


class CollectiveTimeoutError(TrillmError):
    """A tensor-parallel collective failed on this rank: a peer rank stopped answering within
    the group's timeout, or died. Fatal for the worker (the group cannot be used again)."""

    def __init__(self, message: str, *, rank: int, op: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.op = op


class IPCError(TrillmError):
    """Base class of shared-memory ring and codec failures."""


class RingCorruptError(IPCError):
    """A ring slot failed its magic, sequence, length or checksum check."""


class RingClosedError(IPCError):
    """The ring was closed by its writer (or its owner) while a peer was waiting on it."""


class MessageTooLargeError(IPCError):
    """A message is larger than the ring's ``max_message_size``."""


class CodecError(IPCError):
    """A frame could not be decoded into a message (malformed msgpack or wrong shape)."""


class RequestFailedError(TrillmError):
    """One request ended without its result (the engine aborted it: refused by a worker, a
    shutdown); the engine itself is fine."""


class UnsupportedQuantizationError(ValueError):
    """A quantization method (asked for, or the checkpoint's) trillm cannot run."""
