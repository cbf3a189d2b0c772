"""The API key: which keys are in force, and which requests need one.

vLLM reads ``--api-key`` (one or more keys) and otherwise the ``VLLM_API_KEY`` environment
variable; empty values count as none. A request carries the key as vLLM's clients send it,
``Authorization: Bearer KEY``; on Anthropic's Messages routes also as Anthropic's clients do,
``x-api-key: KEY`` (the gate hands it over only there). Where vLLM then guards only the path
prefixes ``/v1``, ``/v2``, ``/inference`` and ``/cohere`` (so ``/invocations``, ``/tokenize``,
``/pooling`` ... run open), trillm inverts the rule: with a key in force every request needs
it except the few routes a load balancer or a metrics scraper probes without credentials
(``KEYLESS_PATHS``), matched exactly, so no spelling of another path, known or not, gets past
the gate.
"""

from __future__ import annotations

import hmac
import logging

import attrs

from trillm import envs

logger = logging.getLogger("trillm.server")

API_KEY_ENV = envs.API_KEY.name
# Liveness, readiness, the version and Prometheus scrapes: as open as in vLLM. Nothing here
# runs the model or tells anything about a request.
KEYLESS_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})


@attrs.frozen
class ApiKeys:
    """The keys in force (none: every route is open) and where they came from."""

    keys: tuple[str, ...] = ()
    source: str = ""  # "--api-key" or API_KEY_ENV; "" without keys

    @classmethod
    def resolve(cls, cli_keys: list[str] | None) -> ApiKeys:
        """``--api-key`` wins; without it ``VLLM_API_KEY``; empty strings are no key."""
        cli = tuple(key for key in cli_keys or () if key)
        if cli:
            return cls(cli, "--api-key")
        env_key = envs.API_KEY.get()
        return cls((env_key,), API_KEY_ENV) if env_key else cls()

    def describe(self) -> str:
        """The start-up line: which setting is in force, never a key."""
        if not self.keys:
            return (
                f"API key: none (neither --api-key nor {API_KEY_ENV} is set); every route is open."
            )
        count = f"{len(self.keys)} keys" if len(self.keys) > 1 else "1 key"
        open_paths = ", ".join(sorted(KEYLESS_PATHS))
        return f"API key: required on every route but {open_paths} ({count} from {self.source})."

    def needs_key(self, path: str) -> bool:
        return bool(self.keys) and path not in KEYLESS_PATHS

    def admits(self, authorization: bytes, x_api_key: bytes = b"") -> bool:
        """Whether an ``Authorization`` header value is ``Bearer KEY``, or an ``x-api-key``
        header value (Anthropic's clients send it) is ``KEY``, for a key in force. Every key is
        compared (``hmac.compare_digest``), so the time does not tell which came close."""
        matched = False
        for key in self.keys:
            raw = key.encode()
            matched |= hmac.compare_digest(authorization, b"Bearer " + raw)
            matched |= hmac.compare_digest(x_api_key, raw)  # never empty: keys are not
        return matched
