"""Where a rank's paged KV cache lives in host memory: on transparent huge pages.

A decode step reads every running request's K/V blocks, scattered over the cache; on 4 KiB pages
each 16-token block of a layer is a page or more of its own, so the walk misses the TLB at most
blocks and the hardware prefetchers stop at every page boundary. Each CPU layer's cache is
therefore an anonymous mapping aligned to 2 MiB and advised ``MADV_HUGEPAGE`` (the kernel's
``madvise`` mode of transparent huge pages, the common default, gives huge pages only to such
regions), zeroed at once so that its pages are faulted in at startup rather than in a step.
Where the platform has no such advice (not Linux, THP ``never``, a device cache) the tensor is
an ordinary ``torch.zeros``: the same bytes, only its pages differ.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def zeros_on_huge_pages(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A zeroed tensor of ``shape``: for a CPU tensor of 2 MiB or more, on huge pages if advised."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE or advice is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    # private and anonymous (a shared one is shmem, whose huge pages are a separate setting)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping while it lives
    start = -raw.data_ptr() % HUGE_PAGE
    try:
        region.madvise(advice, start, nbytes + (-nbytes % mmap.PAGESIZE))
    except OSError:  # THP compiled out: ordinary pages, the same bytes
        pass
    tensor = raw[start : start + nbytes].view(dtype).view(shape)
    tensor.zero_()  # fault the pages in now (an anonymous mapping reads zeros already)
    return tensor
