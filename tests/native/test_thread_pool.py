"""The native kernels' thread pool (ext/cpu_common.h): items are claimed from one word, (call
number << 32) | items left, so a call waits for its items, not for its workers. The claims are
raced hardest where the threads share a core: in a subprocess held to one CPU, its threads but
the caller's at SCHED_IDLE (a worker runs only now and then, often in the middle of a call,
as on a host with more runnable threads than cores), 400 pooled RMSNorms of 64 x 4,096 (8
items on 2 threads) and 400 of 4,096 x 64 (8 items of short rows) each give the 1-thread result
bit for bit: every item ran once, none of an earlier call's worker ran into a later call."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from trillm._native import cpu_kernels
from trillm.kernels import paged_attention_cpu, rms_norm_cpu

pytestmark = pytest.mark.skipif(
    not rms_norm_cpu.available(), reason="trillm._ext.cpu_kernels is not built"
)

_PROBE = textwrap.dedent(
    """
    import os, threading
    import torch
    from trillm.kernels import rms_norm_cpu
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    g = torch.Generator().manual_seed(0)
    cases = [(torch.randn(r, c, generator=g), torch.randn(c, generator=g))
             for r, c in [(64, 4096), (4096, 64)]]
    torch.set_num_threads(1)
    refs = [rms_norm_cpu.rms_norm(x, w, 1e-6) for x, w in cases]
    torch.set_num_threads(2)
    rms_norm_cpu.rms_norm(*cases[0], 1e-6)  # makes the pool: its worker thread
    main = threading.get_native_id()
    for tid in map(int, os.listdir("/proc/self/task")):
        if tid != main:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    for i in range(800):
        x, w = cases[i % 2]
        out = rms_norm_cpu.rms_norm(x, w, 1e-6)
        assert torch.equal(out, refs[i % 2]), f"call {i} differs from the 1-thread result"
    print("ok")
    """
)


def test_every_item_runs_once_when_the_threads_share_a_core() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["ok"]


_THREAD_COUNTS = textwrap.dedent(
    """
    import os
    import torch
    from trillm.kernels import rms_norm_cpu
    x, w = torch.randn(64, 4096), torch.randn(4096)
    def tasks():
        return len(os.listdir("/proc/self/task"))
    for n in (2, 3):  # a pool of each size
        torch.set_num_threads(n)
        rms_norm_cpu.rms_norm(x, w, 1e-6)
    before = tasks()
    for i in range(20):
        torch.set_num_threads(2 + i % 2)
        rms_norm_cpu.rms_norm(x, w, 1e-6)
    print(before, tasks())
    """
)


def test_alternating_thread_counts_reuse_their_pools() -> None:
    # A pool per change of thread count, the old one's threads left parked, grew the process by
    # 30 threads over these 20 alternations; each count's pool is now made once.
    done = subprocess.run(
        [sys.executable, "-c", _THREAD_COUNTS], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = map(int, done.stdout.split())
    assert after == before, f"threads {before} -> {after} over 20 thread-count changes"


_FAILING_ITEM = textwrap.dedent(
    """
    import resource
    import torch
    from trillm.kernels import paged_attention_cpu

    def run(context, query, seed):  # one request, 4 kv heads of 16, contiguous blocks of 16
        g = torch.Generator().manual_seed(seed)
        blocks = -(-(context + query) // 16)
        cache = torch.randn(2, blocks, 16, 4, 16, generator=g).to(torch.bfloat16)
        q = torch.randn(query, 4, 16, generator=g).to(torch.bfloat16)
        qsl = torch.tensor([0, query], dtype=torch.int32)
        seqs = torch.tensor([context + query], dtype=torch.int32)
        table = torch.arange(blocks, dtype=torch.int32)[None]
        plan = paged_attention_cpu.PagedAttentionPlan(qsl, seqs, table, q.shape, cache.shape)
        return lambda: plan.run(q, cache, 0.25, None)

    torch.set_num_threads(2)
    small = run(100, 96, seed=1)
    want = small()  # the pool and its threads, their buffers sized for this
    long = run(200_000, 96, seed=2)  # each item's scores: 96 x 200,096 fp32 (77 MB)
    vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (vm * 1024 + 32 * 2**20, resource.RLIM_INFINITY))
    try:
        long()
        print("ran")
    except MemoryError:
        print("MemoryError")
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print(torch.equal(small(), want))
    """
)


def test_an_item_that_throws_fails_its_call_not_the_process() -> None:
    # 4 pooled items (kv heads) whose score buffers cannot be allocated under the address-space
    # limit: std::bad_alloc thrown on the worker aborted the process ('terminate called after
    # throwing an instance of std::bad_alloc', SIGABRT); now every item runs, the caller raises
    # MemoryError and the pool serves the next call.
    attention = paged_attention_cpu.cpu_kernels("attention")
    if attention.paged_chunk_kernel() == "tile":
        pytest.skip("the long-chunk kernels (AVX2 or AVX512-BF16) allocate per item")
    done = subprocess.run(
        [sys.executable, "-c", _FAILING_ITEM], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["MemoryError", "True"]


def _thread_cpu_seconds(tids: set[int]) -> float:
    """User + system CPU seconds of this process's threads ``tids`` (those still alive)."""
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def test_idle_workers_sleep_instead_of_polling() -> None:
    """Between calls a worker polls ~0.5 ms, then sleeps on a condition variable: a pool left
    polling would take cores from every other process (on a host with more runnable threads
    than cores, from its own caller too). Pools of 11 and 13 threads made here (their 22 workers,
    the threads that appear) run calls for 0.3 s each, then sit idle: over the next second the
    workers take no CPU (a worker polling for good would take a core's share)."""
    x, w = torch.randn(64, 4096), torch.randn(4096)
    threads = torch.get_num_threads()
    before = set(map(int, os.listdir("/proc/self/task")))
    try:
        for n in (11, 13):  # counts no other test uses: new pools
            torch.set_num_threads(n)
            start = time.monotonic()
            while time.monotonic() - start < 0.3:  # calls for 0.3 s: the workers take items
                rms_norm_cpu.rms_norm(x, w, 1e-6)
    finally:
        torch.set_num_threads(threads)
    workers = set(map(int, os.listdir("/proc/self/task"))) - before
    assert len(workers) >= 22, workers  # the two pools' workers (more: another thread's)
    time.sleep(0.3)  # past any poll after the last call
    idle_from = _thread_cpu_seconds(workers)
    time.sleep(1.0)
    idle = _thread_cpu_seconds(workers) - idle_from
    assert idle <= 0.03, f"idle workers took {idle:.2f} s of CPU in 1 s"


def _run_ns(threads: set[int]) -> int:
    """The time these threads have run on a CPU, in ns (/proc schedstat; finer than stat's
    clock ticks)."""
    total = 0
    for tid in threads:
        try:
            total += int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError):
            pass  # a thread that ended meanwhile
    return total


@pytest.mark.skipif(
    not Path("/proc/self/schedstat").exists(), reason="needs /proc/<pid>/task/<tid>/schedstat"
)
def test_parked_workers_sleep_at_once_until_the_next_call() -> None:
    """``park_pools`` (the model worker's step has ended, trillm/worker/worker_main.py): the
    workers polling for the next call sleep at once instead of holding a core for the rest of
    their ~0.5 ms poll, which the engine and the HTTP server need between two steps; the next
    call wakes them and runs every item."""
    program = cpu_kernels("program")
    main = threading.get_native_id()
    spun = []
    for _ in range(7):
        program.pool_dispatch_ns(2, 4, 3)  # makes the 2-thread pool; its worker polls ...
        program.park_pools()  # ... until this
        others = set(map(int, os.listdir("/proc/self/task"))) - {main}
        before = _run_ns(others)
        time.sleep(0.01)
        spun.append(_run_ns(others) - before)
    # without park_pools the worker polled on for 500-560 us each time here; parked, 4-21 us
    assert sorted(spun)[3] < 100_000, spun
    wall, _ = program.pool_dispatch_ns(2, 8, 50)  # woken again: the calls return
    assert 0 < wall < 1e8
