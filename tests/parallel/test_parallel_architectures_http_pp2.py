"""PP=2 over HTTP on every registered architecture but Llama (issue 14; Llama's:
tests/parallel/test_pipeline_parallel.py): one ``trillm serve -pp 2`` per family (its 2 layers one per
stage), whose greedy tokens for one /v1/completions request of two prompts equal the
single-rank Python API's ("uni"), token for token. The models are
tests/parallel/test_parallel_architectures.py's; the whole matrix of layouts is in
tests/parallel/test_parallel_architectures_http.py's docstring.
"""

from __future__ import annotations

import pytest
from parallel_models import ARCHITECTURES, served_matches_uni


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_pp2_over_http_matches_pp1(model, arch, tmp_path):  # noqa: F811
    served_matches_uni(model(arch), ["-pp", "2"], tmp_path / "server.log")
