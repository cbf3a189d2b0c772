"""Small helpers with one owner: a ceiling division and how an exception group is unwrapped."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (b > 0): blocks for tokens, words for bits, ..."""
    return -(-a // b)


def unwrap_group(group: BaseException) -> BaseException:
    """The only leaf of nested single-member exception groups (a nursery around one failing
    task), else ``group`` itself (several errors stay a group)."""
    exc = group
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def first_leaf(group: BaseException) -> BaseException:
    """The first leaf of an exception group, however many it holds: the error to raise when
    the others are its consequences (requests cancelled because one was refused)."""
    exc = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc
