"""An adapter folder's files, read so that no path can stall or swamp the reader.

An adapter path may come from a client (``/v1/load_lora_adapter``), so what it names may be a
FIFO (a blocking ``open`` waits forever for a writer), a device (``/dev/zero`` never ends), or
a huge file. Only regular files are opened, never blocking (``O_NONBLOCK``), checked again on
the open descriptor (the path may change between ``stat`` and ``open``), and read up to a size
limit.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json: PEFT writes about 1 KB
# What a safetensors file holds beside its tensors (the JSON header); PEFT's is ~150 bytes a
# tensor, so this is far above any adapter's.
MAX_HEADER_BYTES = 16 << 20


class AdapterFileError(OSError):
    """A file of the adapter is missing, not a regular file, or over its size limit."""


def regular_file_size(path: Path, limit: int) -> int:
    """The size of the regular file at ``path`` (symlinks followed), at most ``limit``."""
    return _checked_size(path, os.stat(path), limit)


def read_regular_file(path: Path, limit: int) -> bytes:
    """The bytes of the regular file at ``path`` (at most ``limit``): never blocks on a FIFO
    or a device, since those are refused before any read (and before a blocking open)."""
    regular_file_size(path, limit)  # a device is never opened: opening some has effects
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        size = _checked_size(path, os.fstat(fd), limit)
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read(size + 1)
    finally:
        os.close(fd)
    if len(data) > size:  # grew since fstat
        raise AdapterFileError(f"{path.name} is larger than {limit} bytes.")
    return data


def _checked_size(path: Path, st: os.stat_result, limit: int) -> int:
    if not stat.S_ISREG(st.st_mode):
        raise AdapterFileError(f"{path.name} is not a regular file.")
    if st.st_size > limit:
        raise AdapterFileError(f"{path.name} is {st.st_size} bytes; the limit is {limit}.")
    return st.st_size
