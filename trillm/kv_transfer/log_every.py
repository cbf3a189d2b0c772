"""A warning that one kind of event repeats (a request's KV transfer failed, a push was
dropped, a request named an unlisted address): logged at most once every ``every_s`` seconds
with the running count and how many were not logged since the last line (those go to the
debug log), so that a client sending many such requests, or a prefill instance that is gone,
cannot fill the log."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

LOG_EVERY_S = 10.0


class EveryWarning:
    def __init__(self, logger: logging.Logger, what: str, every_s: float = LOG_EVERY_S) -> None:
        self.logger = logger
        self.what = what  # the events, counted: "transfer failures"
        self.every_s = every_s
        self.count = 0  # events so far, logged or not
        self._unlogged = 0  # since the last line
        self._logged_at = -math.inf
        self._lock = threading.Lock()

    def warn(self, message: str, *args: Any) -> bool:
        """One event: ``message % args`` and " (N <what> so far, M not logged since the last
        line)" as a warning, or at debug level within ``every_s`` of the last warning ->
        whether it was the warning."""
        with self._lock:
            self.count += 1
            now = time.monotonic()
            if now - self._logged_at < self.every_s:
                self._unlogged += 1
                count, unlogged, loud = self.count, 0, False
            else:
                self._logged_at = now
                count, unlogged, loud = self.count, self._unlogged, True
                self._unlogged = 0
        level = logging.WARNING if loud else logging.DEBUG
        self.logger.log(
            level,
            message + " (%d %s so far, %d not logged since the last line)",
            *args,
            count,
            self.what,
            unlogged,
            stacklevel=2,  # NOTE: the caller's line, not this one
        )
        return loud
