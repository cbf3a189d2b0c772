"""The Ray executor over two Ray nodes on this machine (a head and a worker raylet, one CPU
each, so the placement group cannot pack both ranks on one): TP=2 with one rank per node gives
one in-process rank's greedy tokens. Skipped where Ray is not installed."""

from __future__ import annotations

import pytest
from parallel_reference import LIMITS, PROMPTS, SHARDED_LLAMA, greedy, reference_tokens
from ray_marks import RAY_TESTS
from worker_processes import pid_alive

from trillm.engine.llm import LLM

pytestmark = RAY_TESTS


@pytest.fixture(scope="module")
def two_nodes(ray):
    """A head and a worker node (Ray's own test cluster: its processes, and only they, are
    stopped at the end), this process its driver."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_tp2_with_one_rank_per_node_equals_one_rank(tiny_model_factory, two_nodes, ray):
    llama = tiny_model_factory("llama", **SHARDED_LLAMA)
    expected = reference_tokens(llama)
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    with LLM(llama, distributed_executor_backend="ray", tensor_parallel_size=2, **LIMITS) as llm:
        executor = llm.engine.executors[0]
        nodes, pids = list(executor.worker_nodes), list(executor.worker_pids)
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert len(set(nodes)) == 2, nodes  # one rank per node
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    assert not any(pid_alive(p) for p in pids)
