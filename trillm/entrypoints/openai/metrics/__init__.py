"""Prometheus metrics (vLLM's series and names), the ``http_*`` series, per-request recording and the periodic stats line."""
