"""``FakeModelRunner`` that writes a given output: deterministic tests of what the engine
constrains (reasoning first, then structured output) without a trained model.

Output token ``k`` of every request is ``script[k]`` while the script lasts, then EOS. Where
the step's grammar bitmask forbids the scripted token, the fake runner's own choice among the
allowed tokens replaces it, so a test sees exactly where a constraint applied. The script is
the ``script`` runner argument, else ``scripted_output.json`` (a list of token ids) in the
model folder (how ``trillm serve --runner trillm.testing.scripted_runner:ScriptedRunner``
gets one).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from trillm.worker.fake_runner import FakeModelRunner, _allowed, _Request

SCRIPT_FILE = "scripted_output.json"


class ScriptedRunner(FakeModelRunner):
    def __init__(self, config: Any, rank: int = 0, *, script: list[int] | None = None, **kw: Any):
        super().__init__(config, rank, **kw)
        if script is None:
            path = Path(config.model.model) / SCRIPT_FILE
            script = json.loads(path.read_text()) if path.is_file() else []
        self.script = [int(t) for t in script]

    def _next_token(self, req: _Request, bitmask: bytes | list[int] | None) -> int:
        k = req.num_output_tokens
        token = self.script[k] if k < len(self.script) else self.eos_token_ids[0]
        if bitmask is None:
            return token
        words = (
            np.frombuffer(bitmask, dtype=np.uint32).tolist()
            if isinstance(bitmask, bytes | bytearray | memoryview)
            else list(bitmask)
        )
        return token if _allowed(words, token) else super()._next_token(req, bitmask)
