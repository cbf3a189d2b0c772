"""The error of a sampling parameter out of range, apart from ``SamplingParams`` so that the
modules its checks live in (``sampling_extras``) can raise it without importing it."""

from __future__ import annotations


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
