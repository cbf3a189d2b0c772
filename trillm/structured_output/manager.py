"""The engine core's side of structured outputs: one xgrammar matcher per engine request.

- ``add_request`` (stage 4 -> 5): the matcher is made at once when the grammar is compiled
  (the frontend compiled it before submitting); otherwise the request waits for ``poll``.
- ``fill_bitmask`` (while the worker runs P2): one packed int32 row per constrained request
  that samples this step, sent as that row's bytes (``SampleRequest.bitmask``).
- ``accept_tokens`` (P4): advances the matcher; True once it has terminated (the engine then
  finishes the request with ``stop``). ``rollback`` undoes accepted tokens (rejected drafts of
  speculative decoding).

Reasoning models (``reasoning_parser``, vLLM's rule): the constraint starts after the reasoning
section. A request whose output starts in reasoning gets no row and feeds no token to its
matcher until a step's tokens hold ``</think>``; the tokens after it are fed, and its rows
apply from the next step. With qwen3 and no tag in the prompt the first row also allows
``<think>`` (the model may open reasoning or write the constrained content at once).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np

from trillm.config.structured_outputs import StructuredOutputsConfig
from trillm.messages import SampleRequest, SchedulerOutput
from trillm.parsers.reasoning import ENDED, REASONING, UNDECIDED, get_reasoning_parser
from trillm.structured_output.compiler import MAX_FILL_CPU_S, GrammarCache
from trillm.structured_output.spec import GrammarSpec, StructuredOutputError, check_params
from trillm.utils import cdiv

if TYPE_CHECKING:
    import xgrammar as xgr

    from trillm.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(
        self,
        cache: GrammarCache,
        reasoning_parser: str | None = None,
        config: StructuredOutputsConfig | None = None,
    ) -> None:
        self.cache = cache
        self.config = config or StructuredOutputsConfig()
        # The reasoning parser and its (<think>, </think>) ids: refused here, at engine start,
        # when the tokenizer lacks them, but for a parser that matches its tags in the text
        # (``text_tags``): then structured outputs are refused per request.
        self.reasoner = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        self.tags_missing = (
            self.reasoner is not None
            and self.reasoner.text_tags
            and not self.reasoner.tags_are_tokens_of(cache.tokenizer)
        )
        self.think_ids = (
            self.reasoner.token_ids(cache.tokenizer)
            if self.reasoner is not None and not self.tags_missing
            else (-1, -1)
        )
        # req_id -> REASONING or UNDECIDED while its output is not past the reasoning
        self._thinking: dict[str, str] = {}
        self.matchers: dict[str, xgr.GrammarMatcher] = {}
        # req_id -> its grammar's compile, running
        self._pending: dict[str, Future[xgr.CompiledGrammar]] = {}
        self._broken: set[str] = set()  # xgrammar failed on them: they end at the next P4
        # req_id -> words ANDed into its rows (JSON: no raw control characters), if any
        self._extra_masks: dict[str, np.ndarray] = {}
        words = cdiv(cache.vocab_size, 32)
        self._rows = np.zeros((0, words), dtype=np.int32)  # reused across steps, grown
        self.num_words = words

    # ------------------------------------------------------------------ requests

    async def precompile(self, spec: StructuredOutputsParams | None) -> None:
        """A request's structured_outputs compiled off the event loop (time-limited, cached)
        before the engine sees it, so a bad schema / regex / grammar is refused at once. A
        cached grammar costs no await."""
        checked = check_params(spec, self.config)
        # NOTE: with enable_in_reasoning the grammar applies from the first token (vLLM's
        # rule): the engine never waits for the reasoning's end, so neither refusal applies
        waits = None if self.config.enable_in_reasoning else self.reasoner
        if waits is not None and not waits.structured_outputs:
            raise StructuredOutputError(
                "structured_outputs",
                f"Structured outputs with the {waits.name} reasoning parser are not "
                "implemented yet (its reasoning ends at a multi-token header the engine cannot "
                "wait for); structured_outputs_config's enable_in_reasoning constrains the "
                "output from its first token instead.",
            )
        if waits is not None and self.tags_missing:
            raise StructuredOutputError(
                "structured_outputs",
                f"Structured outputs with the {waits.name} reasoning parser need "
                f"{waits.start_tag} and {waits.end_tag} as single tokens of the "
                "tokenizer (the engine waits for the end of the reasoning); this model's "
                "tokenizer has no such tokens. structured_outputs_config's enable_in_reasoning "
                "constrains the output from its first token instead.",
            )
        if self.cache.get(checked) is None:
            await self.cache.compile(checked)

    def add_request(
        self,
        req_id: str,
        params: StructuredOutputsParams | None,
        prompt_token_ids: Sequence[int] = (),
    ) -> bool:
        """Start tracking ``req_id``: True when its matcher is ready now, False when the
        grammar is still compiling (or failed: ``poll`` reports it)."""
        spec: GrammarSpec = check_params(params, self.config)
        fut = self.cache.submit(spec)
        if (
            self.reasoner is not None
            and not self.tags_missing
            and not self.config.enable_in_reasoning
        ):
            state = self.reasoner.prompt_state(prompt_token_ids, self.think_ids)
            if state != ENDED:
                self._thinking[req_id] = state
        if spec.kind in ("json", "json_object"):
            self._extra_masks[req_id] = self.cache.json_safe_mask(spec.any_whitespace)
        if fut.done() and fut.exception() is None:
            self.matchers[req_id] = self._matcher(fut.result())
            return True
        self._pending[req_id] = fut
        return False

    def poll(self) -> tuple[list[str], list[tuple[str, str]]]:
        """Requests whose grammar finished compiling since the last call:
        (ready ids, [(failed id, message)])."""
        ready: list[str] = []
        failed: list[tuple[str, str]] = []
        for req_id, fut in list(self._pending.items()):
            if not fut.done():
                continue
            del self._pending[req_id]
            exc = fut.exception()
            if exc is not None:
                failed.append((req_id, str(exc)))
                continue
            try:
                self.matchers[req_id] = self._matcher(fut.result())
            except Exception as err:  # pragma: no cover - xgrammar refusing a compiled grammar
                failed.append((req_id, f"{type(err).__name__}: {err}"))
                continue
            ready.append(req_id)
        return ready, failed

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    @property
    def num_pending(self) -> int:
        """Requests whose grammar is still compiling (each waits in the scheduler)."""
        return len(self._pending)

    def remove(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)
        self._pending.pop(req_id, None)
        self._broken.discard(req_id)
        self._extra_masks.pop(req_id, None)
        self._thinking.pop(req_id, None)

    def retain(self, live: Callable[[str], bool]) -> None:
        """Drop the state of every request for which ``live(req_id)`` is false (aborted,
        failed or finished by another path)."""
        for req_id in [r for r in self.matchers if not live(r)]:
            del self.matchers[req_id]
            self._broken.discard(req_id)
            self._extra_masks.pop(req_id, None)
            self._thinking.pop(req_id, None)
        for req_id in [r for r in self._pending if not live(r)]:
            del self._pending[req_id]
            self._extra_masks.pop(req_id, None)
            self._thinking.pop(req_id, None)

    @staticmethod
    def _matcher(compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    # ------------------------------------------------------------------ P2: bitmask

    def fill_bitmask(self, sched: SchedulerOutput, samples: Callable[[str], bool]) -> SampleRequest:
        """The bitmask rows of ``sched``'s constrained requests for which ``samples(req_id)``
        is true (the step reaches the end of their tokens, so the worker samples them); none
        for a request still reasoning."""
        thinking = self._thinking
        req_ids = [
            r
            for r in sched.num_scheduled_tokens
            if r in self.matchers
            and thinking.get(r) != REASONING
            and not self.matchers[r].is_terminated()
            and samples(r)
        ]
        if len(req_ids) > len(self._rows):
            self._rows = np.zeros(
                (max(len(req_ids), 2 * len(self._rows)), self.num_words), np.int32
            )
        rows = self._rows
        bitmask: dict[str, bytes | list[int]] = {}
        for i, req_id in enumerate(req_ids):
            try:
                start = time.thread_time()
                # NOTE: False means every token is allowed here: no row needed.
                if self.matchers[req_id].fill_next_token_bitmask(rows, i):
                    extra = self._extra_masks.get(req_id)
                    if extra is not None:
                        np.bitwise_and(rows[i], extra, out=rows[i])
                    if thinking.get(req_id) == UNDECIDED:  # it may still open reasoning
                        think = self.think_ids[0]
                        rows.view(np.uint32)[i, think >> 5] |= np.uint32(1 << (think & 31))
                    bitmask[req_id] = rows[i].tobytes()
                cost = time.thread_time() - start
                if cost > MAX_FILL_CPU_S:
                    # This runs on the engine's loop: one slow grammar stalls every request.
                    # The request keeps this step's row and ends (abort) at the next P4.
                    logger.warning(
                        "request %s: its grammar's mask took %.0f ms of CPU (limit %.0f ms); "
                        "ending it",
                        req_id,
                        cost * 1000,
                        MAX_FILL_CPU_S * 1000,
                    )
                    self._broken.add(req_id)
            except Exception:  # one request's grammar, never the engine
                logger.exception("request %s: filling its grammar bitmask failed", req_id)
                self._broken.add(req_id)
        return SampleRequest(step_id=sched.step_id, bitmask=bitmask)

    # ------------------------------------------------------------------ P4: advance

    def accept_tokens(self, req_id: str, tokens: list[int]) -> tuple[bool, bool]:
        """Advance ``req_id``'s matcher -> (accepted all, terminated)."""
        matcher = self.matchers.get(req_id)
        if matcher is None:
            return True, False
        if req_id in self._broken:
            self._broken.discard(req_id)
            return False, False
        if req_id in self._thinking:
            tokens = self._past_reasoning(req_id, tokens)
        for token in tokens:
            try:
                ok = not matcher.is_terminated() and matcher.accept_token(token)
            except Exception:  # pragma: no cover - xgrammar refusing a token id
                ok = False
            if not ok:
                logger.error("request %s: token %d is outside its grammar", req_id, token)
                return False, matcher.is_terminated()
        return True, matcher.is_terminated()

    def _past_reasoning(self, req_id: str, tokens: list[int]) -> list[int]:
        """The tokens of ``tokens`` after the reasoning section (none while it goes on)."""
        start, end = self.think_ids
        if self._thinking[req_id] == UNDECIDED and tokens:
            if tokens[0] != start:  # content at once: all of it is constrained
                del self._thinking[req_id]
                return tokens
            self._thinking[req_id] = REASONING
            tokens = tokens[1:]
        if end in tokens:
            del self._thinking[req_id]
            return tokens[tokens.index(end) + 1 :]
        return []

    def is_reasoning(self, req_id: str) -> bool:
        """Whether ``req_id``'s output is still before the end of its reasoning section."""
        return req_id in self._thinking

    def rollback(self, req_id: str, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative drafts; the
        count is of tokens fed to the matcher, not of reasoning tokens)."""
        matcher = self.matchers.get(req_id)
        if matcher is not None and num_tokens > 0:
            matcher.rollback(num_tokens)

    def is_terminated(self, req_id: str) -> bool:
        matcher = self.matchers.get(req_id)
        return matcher is not None and matcher.is_terminated()
