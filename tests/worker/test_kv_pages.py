"""The KV cache's host memory: a zeroed tensor on 2 MiB-aligned, huge-page-advised pages."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from trillm.worker.kv_pages import HUGE_PAGE, zeros_on_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(address: int) -> dict[str, str] | None:
    """The fields of the /proc/self/smaps entry whose range holds ``address``."""
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            if entry is not None:
                return entry
            entry = {} if lo <= address < hi else None
        elif entry is not None and ":" in head:
            entry[head.rstrip(":")] = line.split(None, 1)[1].strip()
    return entry


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_large_cpu_layer_is_zeroed_aligned_and_writable(dtype: torch.dtype) -> None:
    shape = (2, 700, 16, 3, 64)  # planes, blocks, block size, kv heads, head dim: > 2 MiB
    t = zeros_on_huge_pages(shape, dtype, torch.device("cpu"))
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.float().any()
    t[1, 699, 15, 2, 63] = 1.5
    t[0, 0, 0, 0, 0] = -2.0
    assert t.float().sum().item() == -0.5
    assert t.untyped_storage().nbytes() >= t.numel() * t.element_size()


def test_a_small_layer_or_a_device_cache_is_plain_zeros() -> None:
    t = zeros_on_huge_pages((4, 16, 2, 8), torch.float32, torch.device("cpu"))
    assert t.shape == (4, 16, 2, 8) and not t.any()
    t += 1  # an ordinary resizable tensor
    assert t.sum().item() == 4 * 16 * 2 * 8


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here"
)
def test_the_mapping_is_advised_for_huge_pages_and_unmapped_when_dropped() -> None:
    t = zeros_on_huge_pages((8 * HUGE_PAGE // 4,), torch.float32, torch.device("cpu"))
    address = t.data_ptr()
    fields = _mapping_of(address)
    assert fields is not None
    assert "hg" in fields.get("VmFlags", "").split(), fields.get("VmFlags")  # MADV_HUGEPAGE
    if "THPeligible" in fields:
        assert fields["THPeligible"].startswith("1")
    del t
    gc.collect()
    assert _mapping_of(address) is None  # the cache's memory goes back when its tensor does
