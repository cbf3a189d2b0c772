"""The runner (generate or pooling) and a pooling model's ``PoolerConfig`` (vLLM's fields),
checked."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from trillm.config.values import CONVERTS

RUNNERS = ("auto", "generate", "pooling")


POOLING_TYPES = ("LAST", "MEAN", "CLS")


class PoolingConfigError(ValueError):
    """A runner / convert / pooler setting trillm cannot honour."""


@dataclass
class PoolerConfig:
    """How a pooling model turns a prompt's hidden states into one vector
    (``trillm/model_executor/pooling.py``)."""

    pooling_type: Literal["LAST", "MEAN", "CLS"] = "LAST"
    normalize: bool = True
    matryoshka: bool = False  # the model may be truncated to fewer ``dimensions``
    # "classify": a *ForSequenceClassification model (model_executor/classification.py): the
    # pooled LAST row through its score head, softmax over ``labels``
    task: Literal["embed", "classify"] = "embed"
    labels: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> PoolerConfig:
        """vLLM's ``pooler_config`` keys that trillm honours; others are refused."""
        unknown = set(cfg) - {"pooling_type", "normalize"}
        if unknown:
            raise PoolingConfigError(
                f"pooler_config: unsupported key(s) {sorted(unknown)}; "
                "supported: pooling_type, normalize."
            )
        kind = str(cfg.get("pooling_type", "LAST")).upper()
        if kind not in POOLING_TYPES:
            raise PoolingConfigError(
                f"pooler_config.pooling_type must be one of "
                f"{', '.join(POOLING_TYPES)}, got {kind!r}."
            )
        normalize = cfg.get("normalize", True)
        if not isinstance(normalize, bool):
            raise PoolingConfigError(
                f"pooler_config.normalize must be true or false, got {normalize!r}."
            )
        return cls(pooling_type=kind, normalize=normalize)  # type: ignore[arg-type]


def check_runner(runner: str, convert: str, pooler_config: dict[str, Any] | None) -> None:
    if runner not in RUNNERS:
        extra = " ('draft' models are part of speculative decoding)" if runner == "draft" else ""
        raise PoolingConfigError(
            f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}{extra}."
        )
    if convert not in CONVERTS:
        raise PoolingConfigError(
            f"convert must be one of {', '.join(CONVERTS)} (reward models are not "
            f"implemented), got {convert!r}."
        )
    if runner == "generate" and convert in ("embed", "classify"):
        raise PoolingConfigError(
            f"convert={convert!r} makes a pooling model: it contradicts runner='generate'."
        )
    if pooler_config is not None:
        if not isinstance(pooler_config, dict):
            raise PoolingConfigError("pooler_config must be a JSON object.")
        PoolerConfig.from_dict(pooler_config)


def is_pooling(runner: str, convert: str) -> bool:
    return runner == "pooling" or convert in ("embed", "classify")
