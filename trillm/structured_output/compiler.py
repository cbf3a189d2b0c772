"""Compiling grammars with xgrammar, off the event loop, behind a cache keyed by the spec.

One ``GrammarCache`` per engine, shared by the frontend (which compiles a request's grammar
before submitting it, so a bad spec is a 400 and the engine never compiles it) and the engine
core (which finds it compiled, or waits for it in ``WAITING_FOR_GRAMMAR``). Compilation runs
on a small thread pool: a compile is a ``concurrent.futures.Future`` that both sides can wait
on, the frontend through a Trio event with a time limit, the engine core by polling it
between steps. xgrammar holds the tokenizer's vocabulary (``TokenizerInfo``), built lazily on
the first compile (it walks the whole vocabulary).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import trio

from trillm.config import DEFAULT_GRAMMAR_CACHE_BYTES
from trillm.structured_output.spec import GrammarSpec, StructuredOutputError
from trillm.utils import cdiv

if TYPE_CHECKING:
    import numpy as np
    import xgrammar as xgr

    from trillm.tokenizer_protocol import Tokenizer

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 30.0
# CPU seconds one token's bitmask may cost (the engine fills masks on its event loop, so a
# slower grammar stalls every request). Ordinary grammars take well under 1 ms; nested
# ambiguous regexes ("(a*)*" repeated) grow cubically: 0.14 s at 300 repeats, 3 s at 1,000.
MAX_FILL_CPU_S = 0.05
# One grammar may take at most this share of the cache, so the cache always holds several
# and one request cannot claim unbounded memory (refused with a 400 before it is cached).
GRAMMAR_SHARE_OF_CACHE = 4
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the message.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] [^:]+:\d+: ")
_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "structural_tag": "structural tag",
}


def choice_grammar(choices: list[str]) -> str:
    """Exactly one of the strings: an EBNF alternation of JSON-escaped string literals."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCache:
    """Compiled grammars by ``GrammarSpec``; compiles on a thread pool. Bounded in bytes
    (``cache_bytes``: compiled grammars by xgrammar's count, plus the spec texts), least
    recently used out; a count bound alone let one client fill memory (a schema of 3,000
    optional properties compiles to ~16 MiB, ~21 MiB of RSS)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        *,
        max_threads: int = 2,
        cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES,
    ) -> None:
        self.tokenizer = tokenizer
        # NOTE: the model's vocabulary can be larger than the tokenizer's (padded embeddings):
        # the bitmask covers the model's; ids past the tokenizer are never allowed.
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.stop_token_ids = list(stop_token_ids)
        self.cache_bytes = cache_bytes
        self.max_grammar_bytes = cache_bytes // GRAMMAR_SHARE_OF_CACHE
        self._max_threads = max_threads
        # NOTE: _futures, _sizes and cached_bytes change together under _cache_lock: the
        # Trio thread submits, the grammar threads account for what they finished.
        self._futures: OrderedDict[GrammarSpec, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._sizes: dict[GrammarSpec, int] = {}  # bytes of each finished entry
        self.cached_bytes = 0
        self._cache_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="trillm-grammar")
        self._lock = threading.Lock()  # guards the lazily built xgrammar compiler
        self._compiler: xgr.GrammarCompiler | None = None
        self._tokenizer_info: xgr.TokenizerInfo | None = (
            None  # the vocabulary, as xgrammar reads it
        )
        self._json_masks: dict[bool, np.ndarray] = {}
        self.num_compiles = 0  # compilations started (cache misses)

    # ------------------------------------------------------------------ xgrammar

    def compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                # xgrammar's own cache is off (unbounded by default): this one, bounded in
                # bytes, is the only owner of compiled grammars.
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=self._max_threads, cache_enabled=False
                )
                self._tokenizer_info = info
            return self._compiler

    def compile_now(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """Compile in the calling thread -> ``xgr.CompiledGrammar``; ``StructuredOutputError``
        naming the problem when xgrammar refuses the spec."""
        try:
            compiler = self.compiler()
        except Exception as exc:  # the tokenizer is one xgrammar cannot read
            raise StructuredOutputError(
                "structured_outputs",
                f"Structured outputs are unavailable for this tokenizer: {type(exc).__name__}: "
                f"{exc}",
            ) from None
        try:
            compiled = _compile(compiler, spec)
            self._check_size(compiled, spec)
            extra = None
            if spec.kind in ("json", "json_object"):
                extra = self.json_safe_mask(spec.any_whitespace)  # a vocabulary walk: off the loop
            _check_first_mask(compiled, spec, self.vocab_size, extra)
            return compiled
        except StructuredOutputError:
            raise
        except RecursionError:
            raise StructuredOutputError(
                f"structured_outputs.{spec.kind}", f"The {_WHAT[spec.kind]} nests too deeply."
            ) from None
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError/its own types
            message = _CPP_PREFIX.sub("", str(exc)).strip() or type(exc).__name__
            raise StructuredOutputError(
                f"structured_outputs.{spec.kind}", f"Invalid {_WHAT[spec.kind]}: {message}"
            ) from None

    def _check_size(self, compiled: xgr.CompiledGrammar, spec: GrammarSpec) -> None:
        size = compiled.memory_size_bytes
        if size > self.max_grammar_bytes:
            raise StructuredOutputError(
                f"structured_outputs.{spec.kind}",
                f"The {_WHAT[spec.kind]} compiles to a grammar of {_mib(size)}, more than the "
                f"{_mib(self.max_grammar_bytes)} one grammar may take on this server (1/"
                f"{GRAMMAR_SHARE_OF_CACHE} of --structured-outputs-cache-bytes).",
            )

    def json_safe_mask(self, any_whitespace: bool) -> np.ndarray:
        """int32 words [ceil(V / 32)]: every token but those holding a raw control character
        (U+0000-U+001F, less tab/newline/return when whitespace is free). ANDed into the rows
        of JSON grammars: JSON never has such characters raw, but xgrammar's rule for strings
        with ``maxLength`` lets them in, and strict parsers (``json.loads``, pydantic) refuse
        the result."""
        key = bool(any_whitespace)
        mask = self._json_masks.get(key)
        if mask is None:
            import numpy as np

            bad = set(range(0x20)) - ({0x09, 0x0A, 0x0D} if key else set())
            words = cdiv(self.vocab_size, 32)
            bits = np.ones(words * 32, dtype=np.uint8)
            self.compiler()
            assert self._tokenizer_info is not None  # built with the compiler
            vocab = self._tokenizer_info.decoded_vocab
            for token_id, piece in enumerate(vocab):
                if not bad.isdisjoint(piece):
                    bits[token_id] = 0
            mask = np.packbits(bits, bitorder="little").view(np.int32).copy()
            self._json_masks[key] = mask
        return mask

    # ------------------------------------------------------------------ cache

    def submit(self, spec: GrammarSpec) -> Future[xgr.CompiledGrammar]:
        """The compile of ``spec``: cached (done, or still running) or started now.
        Called from the Trio thread only (frontend and engine core)."""
        with self._cache_lock:
            fut = self._futures.get(spec)
            if fut is not None:
                self._futures.move_to_end(spec)
                return fut
            self.num_compiles += 1
            fut = self._pool.submit(self._compile_entry, spec)
            self._futures[spec] = fut
        return fut

    def _compile_entry(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """``compile_now`` for the cache (on a grammar thread): the entry's bytes are
        counted before its future is done: its key's text and the compiled grammar
        (xgrammar's count; the process's RSS grows ~1.3x that), or the failure's message."""
        try:
            compiled = self.compile_now(spec)
        except Exception as exc:
            self._account(spec, len(spec.text) + len(str(exc)))
            raise
        self._account(spec, len(spec.text) + int(compiled.memory_size_bytes))
        return compiled

    def _account(self, spec: GrammarSpec, size: int) -> None:
        """Count a finished entry's bytes, then evict the least recently used finished
        entries until the cache fits ``cache_bytes``. An evicted grammar lives on in the
        matchers of the requests using it (and in its future, for whoever awaits it), and is
        compiled again when a new request asks for it."""
        with self._cache_lock:
            self._sizes[spec] = size
            self.cached_bytes += size
            victims = []
            excess = self.cached_bytes - self.cache_bytes
            for old in self._futures:  # oldest first; a running compile has no size yet
                if excess <= 0:
                    break
                if old in self._sizes:
                    victims.append(old)
                    excess -= self._sizes[old]
            for old in victims:
                del self._futures[old]
                self.cached_bytes -= self._sizes.pop(old)

    def get(self, spec: GrammarSpec) -> xgr.CompiledGrammar | None:
        """The compiled grammar when it is ready; None while compiling or after a failure."""
        with self._cache_lock:
            fut = self._futures.get(spec)
        if fut is None or not fut.done() or fut.exception() is not None:
            return None
        return fut.result()

    async def compile(
        self, spec: GrammarSpec, timeout_s: float = COMPILE_TIMEOUT_S
    ) -> xgr.CompiledGrammar:
        """Wait (without blocking the event loop) for ``spec`` to compile, at most
        ``timeout_s``; raises ``StructuredOutputError`` for a bad spec or a timeout."""
        fut = self.submit(spec)
        if not fut.done():
            done = trio.Event()
            token = trio.lowlevel.current_trio_token()

            def wake(_: Future[xgr.CompiledGrammar]) -> None:
                try:
                    token.run_sync_soon(done.set)
                except trio.RunFinishedError:  # pragma: no cover - the loop is gone
                    pass

            fut.add_done_callback(wake)
            with trio.move_on_after(timeout_s):
                await done.wait()
            if not fut.done():
                # The thread cannot be interrupted; it finishes in the background (and the
                # result stays cached), but this request is refused now.
                raise StructuredOutputError(
                    f"structured_outputs.{spec.kind}",
                    f"Compiling the {_WHAT[spec.kind]} took longer than {timeout_s:g} s.",
                )
        exc = fut.exception()
        if exc is not None:
            raise exc
        return fut.result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"


def _check_first_mask(
    compiled: xgr.CompiledGrammar, spec: GrammarSpec, vocab_size: int, extra_mask: np.ndarray | None
) -> None:
    """Refuse a grammar whose first bitmask costs more than ``MAX_FILL_CPU_S`` of CPU (measured
    here, on the grammar thread; xgrammar releases the GIL), or allows no token at all (the
    engine could only abort it: a schema that refers to itself before any text, a regex
    that matches nothing). ``extra_mask`` is what the engine ANDs into every row (JSON's).
    A grammar cheap at its start and slow later is caught per step by
    ``StructuredOutputManager.fill_bitmask``."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    start = time.thread_time()
    restricted = matcher.fill_next_token_bitmask(bitmask)  # False: every token is allowed
    cost = time.thread_time() - start
    if cost > MAX_FILL_CPU_S:
        raise StructuredOutputError(
            f"structured_outputs.{spec.kind}",
            f"The {_WHAT[spec.kind]} is too expensive to enforce: one token's mask takes "
            f"{cost * 1000:.0f} ms of CPU (limit {MAX_FILL_CPU_S * 1000:.0f} ms).",
        )
    row = bitmask.numpy()[0]
    if extra_mask is not None:
        row = row & extra_mask
    if restricted and not row.any():
        raise StructuredOutputError(
            f"structured_outputs.{spec.kind}",
            f"The {_WHAT[spec.kind]} cannot be satisfied: no token can start an output that "
            "matches it.",
        )


def _compile(compiler: xgr.GrammarCompiler, spec: GrammarSpec) -> xgr.CompiledGrammar:
    import xgrammar as xgr

    kind, text = spec.kind, spec.text
    if kind == "json":
        return compiler.compile_json_schema(text, any_whitespace=spec.any_whitespace)
    if kind == "json_object":
        return compiler.compile_json_schema(
            '{"type": "object"}', any_whitespace=spec.any_whitespace
        )
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(json.loads(text)))
    if kind == "grammar":
        # EBNF (GBNF, ``rule ::= ...``) as vLLM documents; otherwise Lark, as vLLM also takes.
        if "::=" in text:
            return compiler.compile_grammar(text)
        return compiler.compile_lark(text)
    if kind == "structural_tag":
        tag = json.loads(text)
        if isinstance(tag, dict) and "structures" in tag:  # vLLM's older {structures, triggers}
            items = [
                xgr.StructuralTagItem(
                    begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"]
                )
                for s in tag["structures"]
            ]
            return compiler.compile_structural_tag(items, tag.get("triggers", []))
        return compiler.compile_structural_tag(text)
    raise StructuredOutputError("structured_outputs", f"Unknown structured output kind {kind!r}.")
