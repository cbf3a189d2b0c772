"""/health's defaults, apart from the app so that ``trillm serve --help`` can show them
without importing quart (``http/app.py`` applies them)."""

# /health's bound on one engine step (--health-step-timeout): far above any step of a model
# this server runs well (a full 8,192-token prefill chunk of a 135M model: ~20 s on 2 cores).
DEFAULT_HEALTH_STEP_TIMEOUT_S = 60.0
