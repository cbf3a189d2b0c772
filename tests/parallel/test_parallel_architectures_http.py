"""TP=2 x PP=2 over HTTP on every registered architecture (issue 14): one ``trillm serve -tp 2
-pp 2`` per family (4 ranks: two stages of two tensor-parallel ranks each), whose greedy tokens
for one /v1/completions request of two prompts equal the single-rank Python API's ("uni"),
token for token. Llama's is tests/parallel/test_multinode.py's TP=2 x PP=2 server (over two nodes).
``served_matches_uni`` is shared with the TP=2 alone and PP=2 alone servers
(tests/parallel/test_parallel_architectures_http_tp2.py, tests/parallel/test_parallel_architectures_http_pp2.py).

The issue-14 matrix (greedy tokens equal TP=1's, token for token; non-Llama families use the
2-layer models of tests/parallel/test_parallel_architectures.py, Llama its own):

=============  =======================================  =======================================
layout         Python API                               HTTP (``trillm serve``)
=============  =======================================  =======================================
TP=2           test_parallel_architectures.py;          test_parallel_architectures_http_tp2.py;
               Llama: test_tensor_parallel.py           Llama: test_tensor_parallel.py
PP=2           test_parallel_architectures.py;          test_parallel_architectures_http_pp2.py;
               Llama, Gemma 2: test_pipeline_parallel   Llama: test_pipeline_parallel.py
TP=2 x PP=2    test_parallel_architectures_tp2xpp2.py;  this file;
               Llama: test_pipeline_parallel.py         Llama: test_multinode.py (two nodes)
=============  =======================================  =======================================

The models are tests/parallel/test_parallel_architectures.py's (2 layers: one per stage; its overrides
and random biases), so a wrong shard or a wrong stage hand-off changes the tokens; each
reference is checked to be more than one repeated token. A file per layout so that xdist
(``--dist loadfile``) runs them beside each other; 4 ranks on 2 cores are slow, so 2 prompts x
8 tokens, one server per family.
"""

from __future__ import annotations

import pytest
from parallel_models import ARCHITECTURES, served_matches_uni


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tp2_x_pp2_over_http_matches_tp1(model, arch, tmp_path):  # noqa: F811
    served_matches_uni(model(arch), ["-tp", "2", "-pp", "2"], tmp_path / "server.log")
