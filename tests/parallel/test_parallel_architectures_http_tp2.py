"""TP=2 over HTTP on every registered architecture but Llama (issue 14; Llama's:
tests/parallel/test_tensor_parallel.py): one ``trillm serve -tp 2`` per family, whose greedy tokens for
one /v1/completions request of two prompts equal the single-rank Python API's ("uni"), token
for token. The models (2 layers, random biases on GPT-NeoX and Qwen2, one KV head replicated
on OLMo 2) are tests/parallel/test_parallel_architectures.py's; the whole matrix of layouts is in
tests/parallel/test_parallel_architectures_http.py's docstring.
"""

from __future__ import annotations

import pytest
from parallel_models import ARCHITECTURES, served_matches_uni


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tp2_over_http_matches_tp1(model, arch, tmp_path):  # noqa: F811
    served_matches_uni(model(arch), ["-tp", "2"], tmp_path / "server.log")
