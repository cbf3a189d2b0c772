"""The producer's bound on the shared-storage folder: ``max_local_disk_size`` (LMCache's name
for its disk tier's cap, in GiB) with least-recently-used eviction.

Without it any client sending many distinct long prompts would grow the folder without bound.
The producer's worker keeps a running total of the folder's ``.kv`` bytes and an LRU index
(built by one scan at start, then kept up to date by its own writes), so a save costs a
stat of its file plus one unlink per evicted file, never a directory scan.

"Used" counts the other instances sharing the folder: a consumer touches a file's mtime when
it loads it (``touch``), and the producer, before evicting its oldest entry, stats it and gives
it a second place at the young end if a reader touched it since (each touch buys one pass).

Under tensor or pipeline parallelism every rank is a producer of its own files
(``<key>.r<rank>.kv``, ``storage.py``): each rank's budget indexes its own rank's files and
takes the rank's share of the cap (its share of a block's bytes: ``rank_share``), so the
folder's bytes over all ranks stay under ``max_local_disk_size``.

Safe with readers in other processes: files appear whole by rename (``storage.write_file``) and
go by ``unlink``, atomic on POSIX: a reader with the file open reads it whole, a reader that
opens it later finds none. A file evicted between a consumer's lookup and its load fails that
load in the worker, and the request is recomputed (``kv_load_failure_policy`` "recompute").
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import OrderedDict
from dataclasses import dataclass

logger = logging.getLogger(__name__)

SUFFIX = ".kv"
# NOTE: the default cap: this share of what the store could use at start (the folder's
# free disk plus its files): a fixed figure would be too small on a dedicated volume and could
# fill a small /tmp (vLLM's default folder); this leaves the rest of the disk to everything else.
DEFAULT_DISK_SHARE = 0.25
_LOG_EVERY_S = 10.0  # the eviction log line, at most this often


@dataclass
class DiskStats:
    cap_bytes: int
    stored_bytes: int = 0  # in the folder now (this producer's index)
    stored_files: int = 0
    written_bytes: int = 0  # cumulative
    evicted_bytes: int = 0  # cumulative
    evicted_files: int = 0
    too_large: int = 0  # files over the cap, not written


def default_cap_bytes(folder: str, stored: int) -> int:
    return int((shutil.disk_usage(folder).free + stored) * DEFAULT_DISK_SHARE)


def touch(path: str) -> None:
    """A reader used ``path``: young again for the producer's LRU (gone meanwhile: no matter)."""
    try:
        os.utime(path)
    except OSError:
        pass


def rank_share(num_layers: int, stage_layers: int, tp_size: int) -> float:
    """A rank's share of a block's bytes over every rank: its stage's share of the layers,
    split evenly over the stage's tensor-parallel ranks (each holds as many KV heads)."""
    return stage_layers / num_layers / tp_size


class DiskBudget:
    """``suffix``: the end of the names of the files this producer writes and counts (a
    rank's, ``storage.rank_suffix``); ``share``: its share of the cap (``rank_share``)."""

    def __init__(
        self, folder: str, cap_gib: float | None, suffix: str = SUFFIX, share: float = 1.0
    ) -> None:
        self.folder = folder
        self.suffix = suffix
        self._lru: OrderedDict[str, tuple[int, int]] = OrderedDict()  # path -> (size, mtime_ns)
        files = sorted(_scan(folder, suffix), key=lambda item: item[2])  # oldest first
        for path, size, mtime in files:
            self._lru[path] = (size, mtime)
        total = sum(size for _, size, _ in files)
        whole = default_cap_bytes(folder, total) if cap_gib is None else int(cap_gib * 2**30)
        cap = int(whole * share)
        self.stats = DiskStats(cap_bytes=cap, stored_bytes=total, stored_files=len(files))
        self._logged_at = float("-inf")
        logger.info(
            "KV store %s: %d B in %d %s files at start; cap %d B (max_local_disk_size%s%s)",
            folder,
            total,
            len(files),
            suffix,
            cap,
            "" if cap_gib is not None else f": default, {DEFAULT_DISK_SHARE:.0%} of free + stored",
            "" if share == 1 else f"; this rank's share {share:.3g}",
        )
        self._evict_until(0)

    def admit(self, path: str, size: int) -> bool:
        """Room for a file of ``size`` bytes at ``path`` (evicting the least recently used):
        False when it alone is over the cap (not written, counted)."""
        if size > self.stats.cap_bytes:
            self.stats.too_large += 1
            self._log()
            return False
        self._forget(path)  # NOTE: rewritten: the old file's bytes go with the rename
        self._evict_until(size)
        return True

    def written(self, path: str) -> None:
        """``path`` was renamed into place: counted, youngest."""
        try:
            st = os.stat(path)
        except OSError:
            return  # NOTE: evicted by another producer already: nothing to count
        self._lru[path] = (st.st_size, st.st_mtime_ns)
        self.stats.stored_bytes += st.st_size
        self.stats.stored_files += 1
        self.stats.written_bytes += st.st_size

    def _forget(self, path: str) -> None:
        old = self._lru.pop(path, None)
        if old is not None:
            self.stats.stored_bytes -= old[0]
            self.stats.stored_files -= 1

    def _evict_until(self, incoming: int) -> None:
        """Evict the oldest files until ``incoming`` more bytes fit under the cap. Each entry
        touched by a reader since it was indexed moves to the young end once per pass."""
        second_chances = len(self._lru)
        evicted = False
        while self._lru and self.stats.stored_bytes + incoming > self.stats.cap_bytes:
            path, (size, mtime) = self._lru.popitem(last=False)
            self.stats.stored_bytes -= size
            self.stats.stored_files -= 1
            try:
                st = os.stat(path)
            except OSError:
                continue  # removed by someone else: its bytes are gone already
            if st.st_mtime_ns > mtime and second_chances > 0:
                second_chances -= 1
                self._lru[path] = (st.st_size, st.st_mtime_ns)
                self.stats.stored_bytes += st.st_size
                self.stats.stored_files += 1
                continue
            try:
                os.unlink(path)
            except OSError:
                continue
            self.stats.evicted_bytes += st.st_size
            self.stats.evicted_files += 1
            evicted = True
        if evicted:
            self._log()

    def _log(self) -> None:
        now = time.monotonic()
        if now - self._logged_at < _LOG_EVERY_S:
            return
        self._logged_at = now
        s = self.stats
        logger.info(
            "KV store %s: %d B in %d files (cap %d B); evicted %d files, %d B so far; "
            "%d over the cap not written",
            self.folder,
            s.stored_bytes,
            s.stored_files,
            s.cap_bytes,
            s.evicted_files,
            s.evicted_bytes,
            s.too_large,
        )


def _is_kv_file(name: str, suffix: str = SUFFIX) -> bool:
    """``<key><suffix>``, the key a 40-digit hex digest (``storage.prefix_key``): the folder
    may be shared with other files (vLLM's default is /tmp), which are neither counted nor
    evicted, and with other ranks' files, which their own rank counts."""
    stem = name[: -len(suffix)]
    return name.endswith(suffix) and len(stem) == 40 and all(c in "0123456789abcdef" for c in stem)


def _scan(folder: str, suffix: str = SUFFIX) -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) of the folder's KV files ending in ``suffix`` (temporary files
    are not counted)."""
    found = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if _is_kv_file(entry.name, suffix) and entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                found.append((entry.path, st.st_size, st.st_mtime_ns))
    return found
