"""The startup heap kept out of the garbage collector's way, in the processes trillm owns.

A server process ends its start with a few hundred thousand long-lived objects (torch,
transformers, the app), and Python's oldest-generation collection walks every one of them: in
``trillm serve``'s process under load that was a 160-220 ms pause every few seconds
(benchmarks/archive/RESULTS-journal.md, section 34), a stall of every stream it serves. ``gc.freeze()`` moves
what exists at the end of the start into the permanent generation, which collections skip;
objects made afterwards are collected as before. The young generations are collected first
(cheap); a full collection is not (it would cost a pause of its own on every start), so
whatever cyclic garbage the start left in the oldest generation stays, once.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap(process: str) -> int:
    """Freeze the objects that exist now out of the collector; returns how many are frozen.
    Call once a process has finished starting (``process`` names it in the log)."""
    gc.collect(1)
    gc.freeze()
    count = gc.get_freeze_count()
    logger.info("%s: %d startup objects frozen out of the garbage collector", process, count)
    return count
