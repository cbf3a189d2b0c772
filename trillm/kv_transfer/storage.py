"""The shared-storage connector's files: one per stored prompt prefix, ``DIR/<key>.kv``.

Under tensor or pipeline parallelism each rank writes and reads its own share of the KV (its
KV heads, its stage's layers) as its own file, ``DIR/<key>.r<rank>.kv``, whose header's
identity names the rank (``rank_identity``): a prefix is found only when every rank's file is.

``<key>`` is a BLAKE2b digest of the cache identity (model config, dtypes, block size), the
request's cache salt and extra hash keys (adapter, images) and the prefix's token ids, so a
reader with another model or cache layout never finds a writer's file. A file is a magic line,
a JSON header (the identity again, the layout, the token count, the payload's size and
digest) and the payload: for each KV layer, that layer's cache rows of the prefix's blocks,
``[planes, num_blocks, block_size, *entry]`` in the cache dtype, C order. A writer writes a
temporary file and renames it, so a reader sees a whole file or none. The scheduler's lookup
reads the header alone (one small read: ``read_header``) and checks the file's size against it,
so its cost does not grow with the prompt; the worker reads the payload and checks its digest
(``read_file``), so a damaged file is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from trillm.config import TrillmConfig

MAGIC = b"trillm-kv/1\n"
_HEADER_LEN_BYTES = 4
# NOTE: the scheduler reads at most this much of a file: writers' headers are ~300 bytes
HEADER_READ_BYTES = 4096


def cache_identity(config: TrillmConfig, split: bool = True) -> str:
    """What a stored KV depends on besides the tokens: the model's config, its dtypes, the
    block size and the tensor-parallel split (a rank's heads), and the pipeline split (a
    stage's layers; named only when there are stages, so one rank's keys stay as they were).
    ``split=False``: without the two splits (the P2P connector names them apart, so that
    instances of different splits find each other's KV and can say why they cannot load it)."""
    model = config.model
    fields = {
        "architecture": model.architecture,
        "hf_config": model.hf_config,
        "dtype": model.dtype,
        "quantization": model.quantization,
        "numerics": model.numerics,
        "cache_dtype": config.cache.cache_dtype,
        "block_size": config.cache.block_size,
    }
    if split:
        fields["tensor_parallel_size"] = config.parallel.tensor_parallel_size
    if split and config.parallel.pipeline_parallel_size > 1:
        fields["pipeline_parallel_size"] = config.parallel.pipeline_parallel_size
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def prefix_key(
    identity: str, token_ids: Sequence[int], cache_salt: str | None, extra_keys: Sequence[str]
) -> str:
    h = hashlib.blake2b(digest_size=20)
    h.update(json.dumps([identity, cache_salt, list(extra_keys)]).encode())
    h.update(b"".join(t.to_bytes(8, "little", signed=True) for t in token_ids))
    return h.hexdigest()


def rank_suffix(rank: int, world_size: int) -> str:
    """The end of rank ``rank``'s file names: ``.kv`` alone for one rank."""
    return ".kv" if world_size == 1 else f".r{rank}.kv"


def rank_identity(identity: str, rank: int, world_size: int) -> str:
    """The identity rank ``rank``'s file headers carry (the engine's, for one rank)."""
    return identity if world_size == 1 else f"{identity}/rank{rank}"


def file_path(folder: str, key: str, rank: int = 0, world_size: int = 1) -> str:
    return os.path.join(folder, key + rank_suffix(rank, world_size))


@dataclass(frozen=True)
class Header:
    identity: str
    num_tokens: int
    num_layers: int
    planes: int
    entry: list[int]
    dtype: str
    payload_bytes: int
    digest: str  # BLAKE2b of the payload


def file_size(header: Header) -> int:
    """The bytes ``write_file`` writes for ``header`` and its payload."""
    return len(MAGIC) + _HEADER_LEN_BYTES + len(json.dumps(asdict(header))) + header.payload_bytes


def pack(header: Header, payload: bytes) -> bytes:
    """A file's bytes (the network connector sends the same)."""
    head = json.dumps(asdict(header)).encode()
    return MAGIC + len(head).to_bytes(_HEADER_LEN_BYTES, "little") + head + payload


def write_file(path: str, header: Header, payload: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(pack(header, payload))
    os.replace(tmp, path)


def payload_digest(payload: bytes | memoryview) -> str:
    return hashlib.blake2b(payload, digest_size=20).hexdigest()


def read_file(path: str, identity: str, num_tokens: int) -> tuple[Header, memoryview] | None:
    """The header and payload of a whole, undamaged file of this identity and token count;
    None when it is missing, another identity's, truncated or damaged."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    return unpack(data, identity, num_tokens)


def unpack(data: bytes, identity: str, num_tokens: int) -> tuple[Header, memoryview] | None:
    """``pack``'s bytes -> header and payload; None unless whole, undamaged and of this
    identity and token count."""
    header = _parse_header(data)
    if header is None or header[0].identity != identity or header[0].num_tokens != num_tokens:
        return None
    head, start = header
    payload = memoryview(data)[start:]
    if len(payload) != head.payload_bytes or payload_digest(payload) != head.digest:
        return None
    return head, payload


def read_header(path: str, identity: str, num_tokens: int) -> Header | None:
    """The header of a file of this identity and token count whose size is the header's plus
    its payload's (one read of at most ``HEADER_READ_BYTES``; the payload is not read): None
    when it is missing, another identity's, truncated or its header is damaged."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(HEADER_READ_BYTES)
    except OSError:
        return None
    header = _parse_header(data)
    if header is None or header[0].identity != identity or header[0].num_tokens != num_tokens:
        return None
    head, start = header
    return head if size == start + head.payload_bytes else None


def header_of(data: bytes) -> Header | None:
    """The header at the start of ``pack``'s bytes (at most ``HEADER_READ_BYTES`` read, the
    payload neither read nor checked); None when there is none."""
    header = _parse_header(data[:HEADER_READ_BYTES])
    return None if header is None else header[0]


def _parse_header(data: bytes) -> tuple[Header, int] | None:
    if not data.startswith(MAGIC):
        return None
    at = len(MAGIC)
    size = int.from_bytes(data[at : at + _HEADER_LEN_BYTES], "little")
    start = at + _HEADER_LEN_BYTES + size
    if start > len(data):
        return None  # cut short, or a header longer than a reader of its head reads
    try:
        fields: dict[str, Any] = json.loads(data[at + _HEADER_LEN_BYTES : start])
        return Header(**fields), start
    except (ValueError, TypeError):
        return None
