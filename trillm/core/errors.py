"""Errors raised by the scheduler and the KV block manager (both twins raise the same types)."""

from __future__ import annotations


class RequestTooLargeError(ValueError):
    """A request can never be served: its prompt plus max_tokens exceeds max_model_len, or it
    needs more KV blocks than the whole cache holds. The message carries the numbers."""


class DuplicateRequestError(ValueError):
    """``add_request`` got a request id that is already waiting or running."""


class BlockAllocationError(RuntimeError):
    """``allocate_slots`` was called without a preceding ``can_allocate`` that returned True."""
