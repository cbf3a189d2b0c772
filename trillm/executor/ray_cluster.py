"""The Ray side of ``RayExecutor``: the cluster (joined or started), one placement group, the
rank actors. Every function here blocks (Ray's client API is synchronous): the executor calls
them from a thread.

Cluster: a Ray already initialised in this process is used as it is; otherwise ``ray.init``
joins the cluster ``RAY_ADDRESS`` names, else the one ``ray start --head`` runs on this
machine (as ``ray.init()`` finds it), else starts a local one for this engine and stops it at
shutdown.

Placement: vLLM's layout, one bundle ``{"CPU": 1}`` per rank (``{"GPU": 1}`` on CUDA), the
first also asking for a sliver of this node's ``node:<ip>`` resource so that rank 0 runs
beside the engine; PACK strategy. Rank r's actor takes bundle r.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from trillm import envs
from trillm.errors import EngineStartupError
from trillm.executor.ray_actor import RankActor

PLACEMENT_TIMEOUT_S = 60.0
EXIT_WAIT_S = 10.0  # a killed actor's process is gone within this (Ray kills asynchronously)
# The variables a rank reads that a joined cluster's raylet may not have (a cluster this
# engine starts inherits the whole environment anyway).
_FORWARDED_PREFIXES = ("TRILLM_", "VLLM_", "OMP_", "MKL_", "GOMP_", "GLOO_", "PYTHONPATH")


def _ray() -> Any:
    import ray

    return ray


def reclaim_signal_handlers() -> None:
    """Put back this process's own SIGINT / SIGTERM handlers after ``ray.init``.

    ``ray.init`` (in a thread) installs Ray's C++ failure-signal handler for SIGTERM, over the
    handler the server's Trio signal receiver set: a SIGTERM then printed Ray's
    "*** SIGTERM received" and ended ``trillm serve`` with SIGABRT instead of draining. The
    Python-level handlers are still recorded by the ``signal`` module; setting them again
    makes them the process's handlers once more. Only the main thread may set handlers.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(signum)
        if handler is not None:  # None: set outside Python, nothing of ours to put back
            signal.signal(signum, handler)


def rank_env(env: dict[str, str]) -> dict[str, str]:
    """The part of ``env`` (``worker_env()``) each rank actor gets through its runtime_env."""
    return {k: v for k, v in env.items() if k.startswith(_FORWARDED_PREFIXES)}


class RayCluster:
    """One engine's placement group and rank actors; ``close`` leaves no actor behind."""

    def __init__(self, world_size: int, device: str) -> None:
        self.world_size = world_size
        self.resource = "GPU" if device == "cuda" else "CPU"
        self.started_ray = False  # this engine started the cluster: it stops it too
        self.placement: Any = None
        self.actors: list[Any] = []
        self.local_pids: list[
            int
        ] = []  # the actors' processes on this machine (set by the executor)

    def open(self) -> None:
        ray = _ray()
        if not ray.is_initialized():
            self._join_or_start(ray)
        self._place()

    def _join_or_start(self, ray: Any) -> None:
        if envs.RAY_ADDRESS.get():
            ray.init(log_to_driver=True)  # Ray reads the address itself
            return
        try:
            ray.init(address="auto", log_to_driver=True)  # `ray start --head` on this machine
        except ConnectionError:  # none runs here
            ray.init(address="local", log_to_driver=True, **self._local_cluster_args())
            self.started_ray = True

    def _local_cluster_args(self) -> dict[str, Any]:
        # NOTE: at least one CPU per rank: on a 2-core machine TP x PP = 4 ranks still place
        # (the ranks split the cores between them as the multiprocessing backend's do).
        cpus = max(self.world_size, os.cpu_count() or 1)
        return {"num_cpus": cpus, "include_dashboard": False}

    def _place(self) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group

        bundles: list[dict[str, float]] = [{self.resource: 1.0} for _ in range(self.world_size)]
        bundles[0][f"node:{ray.util.get_node_ip_address()}"] = 0.001
        self.placement = placement_group(bundles, strategy="PACK")
        ready, _ = ray.wait([self.placement.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise EngineStartupError(
                f"The Ray cluster could not place {self.world_size} rank(s) of "
                f"{{{self.resource!r}: 1}} within {PLACEMENT_TIMEOUT_S:g} s (it has "
                f"{ray.available_resources()} available): add nodes or resources, or lower "
                "tensor_parallel_size x pipeline_parallel_size."
            )

    def start_actors(self, env: dict[str, str]) -> list[Any]:
        """Rank r's actor in bundle r (created, not yet known to be running)."""
        ray = _ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpus = 1 if self.resource == "GPU" else 0
        remote = ray.remote(num_cpus=0 if gpus else 1, num_gpus=gpus, max_restarts=0)(RankActor)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.placement, placement_group_bundle_index=rank
            )
            options = {"scheduling_strategy": strategy, "runtime_env": {"env_vars": env}}
            self.actors.append(remote.options(**options).remote(rank))
        return self.actors

    def close(self) -> None:
        """Kill the actors, remove the placement group, stop the cluster this engine started."""
        ray = _ray()
        if not ray.is_initialized():
            return
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        _wait_gone(self.local_pids, EXIT_WAIT_S)
        if self.placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement)
            self.placement = None
        if self.started_ray:
            ray.shutdown()


def _wait_gone(pids: list[int], limit_s: float) -> None:
    """Until none of ``pids`` runs (``ray.kill`` returns before the process has exited, and
    a stopped engine must leave no rank behind)."""
    deadline = time.monotonic() + limit_s
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
