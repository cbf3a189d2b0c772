"""The engine core's side of speculative decoding: after P4, count how the step's drafts fared
(vLLM's ``spec_decode_*`` counters) and set the next step's drafts of the running requests (the
scheduler counts them in its token budget). The n-gram proposer's back-off is owned here; a
draft model's runs in the worker, where its drafts are made (``trillm/spec_decode/``)."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from trillm.messages import ModelRunnerOutput, SchedulerOutput, SpecDecodingStats
from trillm.spec_decode.backoff import SpecBackoff

if TYPE_CHECKING:
    from trillm.core.scheduler import Scheduler
    from trillm.spec_decode.draft_setup import DraftModelDrafts
    from trillm.spec_decode.ngram import NgramProposer


class CoreSpeculation:
    def __init__(self, proposer: NgramProposer | DraftModelDrafts) -> None:
        self.proposer = proposer
        self.stats = SpecDecodingStats(num_accepted_tokens_per_pos=[0] * proposer.k)
        self.backoff: SpecBackoff | None = None if proposer.in_worker else SpecBackoff(proposer.k)

    def after_step(
        self,
        scheduler: Scheduler,
        sched: SchedulerOutput,
        out: ModelRunnerOutput,
        busy: Collection[str],
    ) -> None:
        """Counts this step's drafts, then proposes the next step's for the running requests
        that have a token to extend and no step in flight (``busy``: pipeline parallelism)."""
        drafts = sched.scheduled_spec_decode_tokens
        if drafts:
            self._count(drafts, out)
        get = scheduler.get_request
        running = [get(req_id) for req_id in scheduler.running_req_ids()]
        # NOTE: only requests past their prompt: a prefill chunk has no token to extend yet;
        # none of a step in flight (its output clears the drafts it would get now).
        ready = [
            r
            for r in running
            if r is not None
            and r.num_computed_tokens + 1 >= r.num_tokens
            and r.request_id not in busy
        ]
        if self.proposer.in_worker:  # narrows the union: in_worker is a Literal tag
            new_drafts = self.proposer.take(ready, out.draft_token_ids)
        else:
            limit = None
            if self.backoff is not None:
                self.backoff.retain({r.request_id for r in running if r is not None})
                limit = self.backoff.limit
            new_drafts = self.proposer.propose(ready, limit)
        if new_drafts:
            scheduler.update_draft_token_ids(new_drafts)

    def _count(self, drafts: dict[str, list[int]], out: ModelRunnerOutput) -> None:
        spec = self.stats
        for req_id, sampled in zip(out.req_ids, out.sampled_token_ids):
            proposed = drafts.get(req_id)
            if not proposed or not sampled:
                continue
            accepted = len(sampled) - 1  # the last token is the target's own
            spec.num_drafts += 1
            spec.num_draft_tokens += len(proposed)
            spec.num_accepted_tokens += accepted
            for pos in range(accepted):
                spec.num_accepted_tokens_per_pos[pos] += 1
            if self.backoff is not None:
                self.backoff.record(req_id, len(proposed), accepted)

    def snapshot(self) -> SpecDecodingStats:
        """A copy of the counters for one step's stats."""
        s = self.stats
        return SpecDecodingStats(
            s.num_drafts,
            s.num_draft_tokens,
            s.num_accepted_tokens,
            list(s.num_accepted_tokens_per_pos),
        )
