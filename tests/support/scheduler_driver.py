"""``Driver``: plays the scheduler for an executor over the fake runner (two requests, a
chunked prefill, then decode steps)."""

from __future__ import annotations

from trillm.messages import CachedRequestData, NewRequestData, SchedulerOutput
from trillm.sampling_params import SamplingParams

BLOCK = 16


class Driver:
    """Plays the scheduler: two requests, a chunked prefill, then decode steps."""

    def __init__(self, prompt_lens: dict[str, int]) -> None:
        self.prompt_lens = prompt_lens
        self.computed = dict.fromkeys(prompt_lens, 0)
        self.blocks = {r: [] for r in prompt_lens}
        self.next_block = 0
        self.sent: set[str] = set()
        self.outputs: dict[str, list[int]] = {r: [] for r in prompt_lens}
        self.step_id = 0

    def _grow(self, req_id: str, n: int) -> list[int]:
        new = []
        while len(self.blocks[req_id]) * BLOCK < self.computed[req_id] + n:
            self.blocks[req_id].append(self.next_block)
            new.append(self.next_block)
            self.next_block += 1
        return new

    def step(self, chunk: int = 8, wait_for_bitmask: bool = False) -> SchedulerOutput:
        self.step_id += 1
        new, cached, num_sched = [], CachedRequestData(), {}
        for r, plen in self.prompt_lens.items():
            total = plen + len(self.outputs[r])
            n = min(chunk, total - self.computed[r])
            new_blocks = self._grow(r, n)
            if r not in self.sent:
                sp = SamplingParams(logprobs=2 if r == "b" else None)
                prompt = list(range(plen))
                new.append(NewRequestData(r, prompt, [], sp, list(self.blocks[r]), 0))
                self.sent.add(r)
            else:
                cached.req_ids.append(r)
                cached.new_block_ids.append(new_blocks)
                cached.num_computed_tokens.append(self.computed[r])
            num_sched[r] = n
        return SchedulerOutput(
            self.step_id,
            new,
            cached,
            num_sched,
            sum(num_sched.values()),
            wait_for_bitmask=wait_for_bitmask,
        )

    def update(self, sched: SchedulerOutput, out) -> None:
        assert out.step_id == sched.step_id
        assert out.req_ids == list(sched.num_scheduled_tokens)
        for r, tokens in zip(out.req_ids, out.sampled_token_ids):
            self.computed[r] += sched.num_scheduled_tokens[r]
            self.outputs[r].extend(tokens)
