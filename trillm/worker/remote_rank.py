"""A rank on a node other than node 0 (``trillm serve --headless``): it builds its config from
its own node's engine flags, joins the world at the master address, and then hears the
executor through rank 0 (``trillm/distributed/node_link.py``). Node 0's config must match its
own: a node started with other engine flags is refused by name, never run half-agreeing."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from trillm.config import TrillmConfig
from trillm.distributed.node_link import NodeLink

# Node 0's server's choices, not engine flags a headless node is started with: a remote rank
# takes node 0's (--collect-detailed-traces).
_FRONTEND_FIELDS = ("collect_model_forward_time", "collect_model_execute_time")
# Per node, not per world: the node's own rank, and the folders of the model and the draft
# (the same checkpoint may live at another path on another machine; its config.json must
# still agree) with the name the API reports by default (the path; node 0's alone is used).
_NODE_FIELDS = (
    "parallel.node_rank",
    "model.model",
    "model.tokenizer",
    "model.served_model_name",
    "draft_model.model",
    "draft_model.tokenizer",
    "draft_model.served_model_name",
    *_FRONTEND_FIELDS,
)


class NodeConfigMismatchError(ValueError):
    """A headless node's engine flags differ from node 0's."""


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flat(item, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def check_same_config(node0: TrillmConfig, own: TrillmConfig) -> None:
    """Raise NodeConfigMismatchError naming every field where node 0's config and this
    node's differ (but the per-node ones)."""
    theirs, mine = _flat(asdict(node0)), _flat(asdict(own))
    keys = sorted(set(theirs) | set(mine))
    diffs = [
        f"{key}: node 0 has {theirs.get(key)!r}, this node {mine.get(key)!r}"
        for key in keys
        if key not in _NODE_FIELDS and theirs.get(key) != mine.get(key)
    ]
    if diffs:
        raise NodeConfigMismatchError(
            "This node was started with other engine flags than node 0 (start every node "
            "with the same flags):\n  " + "\n  ".join(diffs)
        )


def with_frontend_choices(own: TrillmConfig, node0: TrillmConfig) -> TrillmConfig:
    """This node's config with node 0's frontend choices (``_FRONTEND_FIELDS``)."""
    return replace(own, **{name: getattr(node0, name) for name in _FRONTEND_FIELDS})


def join_from_node(engine_args: dict[str, Any], rank: int) -> tuple[TrillmConfig, NodeLink]:
    """Build this node's config, join the world as ``rank`` (blocks until every rank has
    joined) -> (the config, the link to rank 0)."""
    from trillm.config import EngineArgs
    from trillm.config.batch_defaults import UsageContext
    from trillm.distributed.parallel_state import get_tp_group
    from trillm.distributed.worker import join_tensor_parallel
    from trillm.engine.config_builder import build_config

    # A headless node is ``trillm serve --headless``: the server's defaults, as node 0's.
    config = build_config(EngineArgs(**engine_args), UsageContext.OPENAI_API_SERVER)
    join_tensor_parallel(config, rank)
    return config, NodeLink(get_tp_group(), config.parallel.remote_ranks())
