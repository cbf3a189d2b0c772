"""The server the field-effect tests share (test_field_effects.py, test_field_effects_chat.py):
the embedded default model, room for the longer prompts, request chat templates allowed."""

from __future__ import annotations

import pytest
from server_harness import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("field-effects") / "server.log"
    srv = ServerProcess(
        [
            "--max-model-len",
            "512",
            "--kv-cache-memory",
            "64MiB",
            "--trust-request-chat-template",
            "--enable-prompt-tokens-details",  # usage's cached_tokens (the cache_salt test)
        ],
        log,
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log()
