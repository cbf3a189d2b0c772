"""Pooling models (embeddings): which engines pool, and how a prompt becomes one vector.

``--runner pooling`` (or ``--convert embed``, vLLM's names) turns a decoder checkpoint into an
embedding model: the prompt runs through the model, and the final norm's hidden states are
pooled -- the last token's (LAST), their mean (MEAN) or the first token's (CLS) -- and
L2-normalized when the model says so. The model folder's sentence-transformers files say how
(``modules.json``: a ``Pooling`` module and its ``config.json``, a ``Normalize`` module);
``pooler_config`` overrides them; without either, LAST + normalize (vLLM's default for
decoder embedding models). Other pooling modes (max, weighted mean, ...) are refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trillm.config import PoolerConfig, PoolingConfigError

if TYPE_CHECKING:  # the frontend resolves the pooler without torch; the worker pools with it
    import torch

# sentence-transformers' Pooling config key -> our type
_ST_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_ST_UNSUPPORTED = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


def resolve_pooler(
    folder: str,
    override: dict[str, Any] | None,
    hf_config: dict[str, Any],
    default_type: str = "LAST",
) -> PoolerConfig:
    """The override, else the folder's sentence-transformers config, else ``default_type``
    (LAST for a decoder, CLS for an encoder, as vLLM) + normalize."""
    matryoshka = bool(hf_config.get("is_matryoshka") or hf_config.get("matryoshka_dimensions"))
    if override is not None:
        pooler = PoolerConfig.from_dict(override)
    else:
        default = PoolerConfig(pooling_type=default_type)  # type: ignore[arg-type]
        pooler = _from_sentence_transformers(Path(folder)) or default
    pooler.matryoshka = matryoshka
    return pooler


def _from_sentence_transformers(folder: Path) -> PoolerConfig | None:
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
    normalize = "Normalize" in kinds
    pooling = kinds.get("Pooling")
    if pooling is None:
        return PoolerConfig(normalize=normalize)
    cfg = json.loads((folder / pooling.get("path", "") / "config.json").read_text())
    for key in _ST_UNSUPPORTED:
        if cfg.get(key):
            raise PoolingConfigError(
                f"The model's sentence-transformers pooling {key} is not "
                "implemented (LAST, MEAN and CLS are)."
            )
    chosen = [kind for key, kind in _ST_MODES.items() if cfg.get(key)]
    if len(chosen) != 1:
        raise PoolingConfigError(
            f"The model's sentence-transformers Pooling config selects {chosen or 'no mode'}; "
            "trillm pools with exactly one of LAST, MEAN, CLS."
        )
    return PoolerConfig(pooling_type=chosen[0], normalize=normalize)  # type: ignore[arg-type]


def finish_pooling(
    pooler: PoolerConfig,
    summed: torch.Tensor,
    count: int,
    first: torch.Tensor,
    last: torch.Tensor,
) -> torch.Tensor:  # [H] float32
    """One prompt's vector from what its chunks accumulated (the sum and number of rows, the
    first and the last row)."""
    if pooler.pooling_type == "MEAN":
        vec = summed / count
    elif pooler.pooling_type == "CLS":
        vec = first
    else:
        vec = last
    vec = vec.float()
    if pooler.normalize:
        import torch

        vec = torch.nn.functional.normalize(vec, p=2, dim=-1)
    return vec
