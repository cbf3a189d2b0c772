"""One prompt's beam search, step by step, deciding as transformers' ``_beam_search`` does.

vLLM runs beam search above the engine (``trillm/engine/beam_request.py`` does too): each
step, every running beam is one engine request of one token asking for the top ``K``
logprobs, and prefix caching shares the beams' common prefix. This module holds what is
decided with those logprobs, with transformers as the reference (``generate(num_beams=W,
do_sample=False, length_penalty=..., early_stopping=...)``), which differs from vLLM's own
bookkeeping in three places kept here on purpose:

- candidates: the best ``K = max(2, 1 + #EOS ids) * W`` continuations over all running beams
  by cumulative logprob; a candidate that ends (EOS, a stop string, the last token) is a
  finished hypothesis only when it ranks in the best ``W``; the best ``W`` that do not end
  run on (ranked by cumulative logprob, no length penalty);
- a finished hypothesis scores ``cum_logprob / generated_len ** length_penalty``
  (``generated_len`` counts the EOS, never the prompt); the ``W`` best are kept;
- the search ends early per ``early_stopping`` (``BeamSearchParams``' docstring).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from trillm.outputs import Logprob
from trillm.sampling_params import BeamSearchParams

# A beam's next-token candidates: {token_id: Logprob} (its top K at least).
NextLogprobs = dict[int, Logprob]
# What ends a candidate: its generated tokens -> (finish_reason, stop_reason) or None.
# (finish_reason, stop_reason): "stop" with the EOS id or stop string, "length" with None.
End = tuple[str, int | str | None]
# What ends a candidate: its generated tokens -> its End, or None while it runs on.
EndRule = Callable[[list[int]], End | None]


@dataclass(slots=True)
class Beam:
    tokens: list[int]  # generated so far (no prompt)
    cum_logprob: float
    logprobs: list[NextLogprobs]  # per generated token: the candidates it was chosen among
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class Hypothesis:
    """A finished beam and its length-penalized score."""

    beam: Beam
    score: float


def candidates_per_beam(beam_width: int, num_eos_ids: int) -> int:
    """K: continuations kept per step (transformers': enough that W survive the EOS ones)."""
    return max(2, 1 + num_eos_ids) * beam_width


class PromptSearch:
    """The running beams and finished hypotheses of one prompt; ``advance`` with each
    running beam's next-token logprobs until ``done``."""

    def __init__(
        self, params: BeamSearchParams, num_eos_ids: int, ends: EndRule, keep_logprobs: bool
    ) -> None:
        self.params = params
        self.keep_logprobs = keep_logprobs  # each token's candidates, kept on its beam
        self.width = params.beam_width
        self.k = candidates_per_beam(params.beam_width, num_eos_ids)
        self.ends = ends
        self.running = [Beam([], 0.0, [])]  # transformers' W-1 others start at -1e9: unused
        self.finished: list[Hypothesis] = []  # best first, at most W
        self.generated = 0  # tokens each running beam holds
        self.improvable = True  # transformers' early-stop heuristic, not yet satisfied
        self.done = False

    def advance(self, next_logprobs: Sequence[NextLogprobs]) -> None:
        """``next_logprobs[i]``: running beam i's next-token logprobs."""
        length = self.generated + 1
        last = length == self.params.max_tokens
        top = self._top_candidates(next_logprobs)
        ended = [self._end_of(beam, last) for beam in top]
        if self._accepts_hypotheses():
            for beam, end in zip(top[: self.width], ended[: self.width], strict=True):
                if end is not None:
                    beam.finish_reason, beam.stop_reason = end
                    self._add(beam, length)
        self.running = [b for b, e in zip(top, ended, strict=True) if e is None][: self.width]
        self.generated = length
        self._update_done(last)

    def best(self) -> list[Hypothesis]:
        """The result, best first: the W finished hypotheses of a search that ran to its
        end; an interrupted one's fewer, with its running beams as they stand."""
        if len(self.finished) == self.width:
            return self.finished
        rest = [Hypothesis(b, self._score(b.cum_logprob, self.generated)) for b in self.running]
        return sorted(self.finished + rest, key=lambda h: -h.score)[: self.width]

    # ------------------------------------------------------------------ one step
    def _top_candidates(self, next_logprobs: Sequence[NextLogprobs]) -> list[Beam]:
        """The K best continuations of all running beams by cumulative logprob (a stable
        sort: the earlier beam, then the more likely token, wins a tie)."""
        scored: list[tuple[float, Beam, int, NextLogprobs]] = []
        for beam, logprobs in zip(self.running, next_logprobs, strict=True):
            ranked = sorted(logprobs.items(), key=lambda item: -item[1].logprob)[: self.k]
            for token, entry in ranked:
                scored.append((beam.cum_logprob + entry.logprob, beam, token, logprobs))
        scored.sort(key=lambda item: -item[0])
        return [
            Beam([*beam.tokens, token], cum, self._logprobs(beam, logprobs))
            for cum, beam, token, logprobs in scored[: self.k]
        ]

    def _logprobs(self, beam: Beam, logprobs: NextLogprobs) -> list[NextLogprobs]:
        return [*beam.logprobs, logprobs] if self.keep_logprobs else beam.logprobs

    def _end_of(self, beam: Beam, last: bool) -> End | None:
        end = self.ends(beam.tokens)
        return ("length", None) if end is None and last else end

    def _accepts_hypotheses(self) -> bool:
        full = len(self.finished) == self.width
        return self.improvable and not (full and self.params.early_stopping is True)

    def _add(self, beam: Beam, length: int) -> None:
        self.finished.append(Hypothesis(beam, self._score(beam.cum_logprob, length)))
        self.finished.sort(key=lambda h: -h.score)  # stable: the earlier one wins a tie
        del self.finished[self.width :]

    def _score(self, cum_logprob: float, length: int) -> float:
        if length == 0:  # a search ended before its first token: nothing to normalize
            return cum_logprob
        penalty: float = float(length) ** self.params.length_penalty
        return cum_logprob / penalty

    def _update_done(self, last: bool) -> None:
        """transformers' stopping rule: the heuristic (can the best running beam still beat
        the worst finished one?) once W hypotheses are in, or W in with early_stopping."""
        full = len(self.finished) == self.width
        if full and self.improvable and self.running:
            penalty, reach = self.params.length_penalty, self.generated
            if self.params.early_stopping == "never" and penalty > 0:
                reach = self.params.max_tokens  # the longest it can grow, the best it can be
            best_possible = self._score(self.running[0].cum_logprob, reach)
            self.improvable = best_possible > self.finished[-1].score
        # One beam is transformers' greedy decoding: it ends at its first end.
        early = full and (self.params.early_stopping is True or self.width == 1)
        self.done = last or not self.improvable or early or not self.running
