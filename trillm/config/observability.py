"""vLLM's ``collect_detailed_traces`` (``ObservabilityConfig``): which per-request times the
ranks measure for ``--otlp-traces-endpoint``'s spans. ``model``: the model forward time
(``gen_ai.latency.time_in_model_forward``), ``worker``: the worker's execute call
(``gen_ai.latency.time_in_model_execute``), ``all``: both; each summed over the steps that ran
the request. Values may also be comma-separated, as vLLM takes them."""

from __future__ import annotations

from collections.abc import Sequence

DETAILED_TRACE_MODULES = ("model", "worker", "all")
# vLLM's own words when the endpoint is missing (ObservabilityConfig's check)
NEEDS_ENDPOINT = "collect_detailed_traces requires `--otlp-traces-endpoint` to be set."


def detailed_trace_modules(values: str | Sequence[str]) -> list[str]:
    """The modules named, in order, once each; ValueError naming a value vLLM does not take."""
    parts = [values] if isinstance(values, str) else list(values)
    modules: list[str] = []
    for value in parts:
        for part in str(value).split(","):
            module = part.strip()
            if module not in DETAILED_TRACE_MODULES:
                raise ValueError(
                    f"collect_detailed_traces: invalid choice: {module!r} (choose from "
                    f"{', '.join(DETAILED_TRACE_MODULES)})"
                )
            if module not in modules:
                modules.append(module)
    return modules


def collected_times(modules: Sequence[str]) -> tuple[bool, bool]:
    """-> (the model forward time is collected, the worker's execute time is)."""
    return (
        "model" in modules or "all" in modules,
        "worker" in modules or "all" in modules,
    )
