"""benchmarks/engine/eagle_train.py trains a head on one forward and trillm serves it with
another: the head it writes must draft, under the dense EAGLE reference that trillm's
proposals are checked against (tests/spec_decode/test_spec_decode_eagle.py), what the training
module itself predicts from the states it was trained on."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
import transformers
from eagle_reference import reference_drafts

from benchmarks.engine import eagle_train
from trillm.config import EngineArgs
from trillm.model_executor.model_config import load_model_config
from trillm.spec_decode.config import parse_speculative_config
from trillm.spec_decode.eagle_config import build_eagle_head_config
from trillm.testing.tiny_models import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
K = 4


@torch.no_grad()
def training_drafts(
    head: eagle_train.EagleHead,
    target: transformers.LlamaForCausalLM,
    prompt: list[int],
    next_token: int,
) -> list[int]:
    """K drafts by the training module: the target's final states over the prompt, then the
    head's own output fed back for each draft."""
    hidden = eagle_train.final_states(target, torch.tensor([prompt]))  # [1, P, H]
    ids = prompt[1:] + [next_token]
    drafts: list[int] = []
    for _ in range(K):
        out = head(torch.tensor([ids]), hidden)  # [1, len(ids), H]
        drafts.append(int(target.lm_head(out[0, -1]).argmax()))
        ids.append(drafts[-1])
        hidden = torch.cat([hidden, out[:, -1:]], dim=1)
    return drafts


def test_the_written_head_drafts_what_the_training_module_predicts(tmp_path: Path) -> None:
    # a rope theta of its own: a head config without the target's would rotate differently
    folder = str(build_tiny_model("llama", tmp_path / "target", rope_theta=500.0))
    target = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    target.requires_grad_(False)  # as in training: only the head's own weights move
    head = eagle_train.EagleHead(target)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a head unlike its initialization (fc = [0, I], the last layer)
        for p in head.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    eagle_train.write_head(head, folder, tmp_path / "head")
    prompt = torch.randint(5, 4000, (11,), generator=gen).tolist()
    expected = reference_drafts(folder, str(tmp_path / "head"), "eagle", prompt, 7, K)
    assert training_drafts(head, target, prompt, 7) == expected
    assert len(set(expected)) > 1  # not a degenerate head
    spec = parse_speculative_config(
        {"method": "eagle", "model": str(tmp_path / "head"), "num_speculative_tokens": K}
    )
    config = build_eagle_head_config(
        EngineArgs(), spec, load_model_config(EngineArgs(model=folder))
    )
    assert config.rope_theta == 500.0  # every field trillm reads, honoured


def tiny_target(tmp_path: Path) -> tuple[str, transformers.LlamaForCausalLM]:
    folder = str(build_tiny_model("llama", tmp_path / "target"))
    return folder, eagle_train.target_model(folder)


def test_the_head_starts_as_the_least_squares_map(tmp_path: Path) -> None:
    _, target = tiny_target(tmp_path)
    head = eagle_train.EagleHead(target)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 4000, (3, 100), generator=gen)  # rows > 2 x hidden 64
    hidden = eagle_train.final_states(target, ids)
    rows = torch.ones(3, 98, dtype=torch.bool)
    rows[2, 60:] = False  # a shorter sequence: its tail is no data
    x = torch.cat([head.embed(ids[:, 1:-1]), hidden[:, :-2]], -1)
    y = hidden[:, 1:-1]

    def error() -> float:
        with torch.no_grad():
            return float((head(ids[:, 1:-1], hidden[:, :-2]) - y)[rows].square().mean())

    before = error()
    head.start_from_linear_fit(ids, hidden, rows)
    with torch.no_grad():  # the layer passes fc's output through, whatever its input
        torch.testing.assert_close(head(ids[:, 1:-1], hidden[:, :-2]), head.fc(x))
    # as close to the states at t+1 as the exact least-squares map (the ridge costs ~nothing)
    exact = torch.linalg.lstsq(x[rows].double(), y[rows].double()).solution
    best = float((x[rows].double() @ exact - y[rows]).square().mean())
    assert error() < 1.01 * best and error() < 0.5 * before
    # the least-squares fit over the rows alone: the masked tail does not move it
    changed = hidden.clone()
    changed[2, 62:] += 5.0
    refit = eagle_train.EagleHead(target)
    refit.start_from_linear_fit(ids, changed, rows)
    torch.testing.assert_close(refit.fc.weight, head.fc.weight)


def test_the_answers_and_states_are_made_once_and_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, target = tiny_target(tmp_path)
    calls: list[int] = []

    def generated(
        model: str, n: int, max_tokens: int, temperature: float, seed: int
    ) -> tuple[list[list[int]], list[int]]:
        calls.append(n)
        return [[1, 20, 30, 40, 50], [1, 60, 70]][:n], [2, 1][:n]

    monkeypatch.setattr(eagle_train, "self_generated", generated)
    args = argparse.Namespace(sequences=2, max_tokens=3, temperature=0.0)
    path = tmp_path / "data.pt"
    data = eagle_train.dataset(folder, args, path)
    assert calls == [2] and path.is_file()
    torch.testing.assert_close(data["hidden"], eagle_train.final_states(target, data["ids"]))
    assert data["lengths"].tolist() == [5, 3] and data["prompt_lengths"].tolist() == [2, 1]
    again = eagle_train.dataset(folder, args, path)
    assert calls == [2]  # read back, not generated again
    assert all(torch.equal(again[k], data[k]) for k in data)
    args.sequences = 1  # other settings: made again
    assert len(eagle_train.dataset(folder, args, path)["ids"]) == 1 and calls == [2, 1]
