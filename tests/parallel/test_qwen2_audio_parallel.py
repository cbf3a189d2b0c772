"""Qwen2-Audio with audio under pipeline and tensor parallelism. PP=2: the audio tower and the
projector are read, built and run on the first stage only, which writes the clips' rows over
its token embeddings; the second stage gets the hidden states. TP=2: the tower is whole on
every rank (its q/k/v/out_proj and fc1/fc2 names are ones the text split would otherwise
cut). Both give the one-rank engine's greedy tokens and log-probs, and transformers', for a
batch mixing audio and text-only requests with the clips' prefill in 16-token chunks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from qwen2_audio_reference import AUDIO, RATE, hf_greedy, tone
from vlm_parallel import Family, assert_vision_on_first_stage, parallel_equals, run_uni

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOWER = ("audio_tower.", "multi_modal_projector.")


@dataclass(frozen=True)
class AudioFamily(Family):
    """Family's checks over clips: 0.5 s (12 audio tokens), then 1 s and 0.3 s in one prompt."""

    def prompts(self) -> list[Any]:
        return [
            {"prompt": f"Describe {AUDIO} now", "multi_modal_data": {"audio": self.first()}},
            "The license grants",
            {
                "prompt": f"{AUDIO} a {AUDIO} b",
                "multi_modal_data": {"audio": [(tone(1, 1.0), RATE), (tone(2, 0.3), RATE)]},
            },
        ]

    def limits(self) -> dict[str, int]:
        return {"audio": 2}

    def first(self) -> list[Any]:
        return [(tone(0, 0.5), RATE)]

    def first_items(self) -> list[Any]:
        return [clip for clip, _ in self.first()]  # transformers' processor takes 16 kHz arrays


QWEN2_AUDIO = AudioFamily(
    AUDIO,
    hf_greedy,
    vision=TOWER + tuple("model." + p for p in TOWER),
    modules=("audio_tower", "multi_modal_projector"),
)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from trillm.testing.tiny_qwen2_audio import build_tiny_qwen2_audio

    return str(build_tiny_qwen2_audio(tmp_path_factory.mktemp("tiny-qwen2-audio")))


@pytest.fixture(scope="module")
def uni(path):
    return run_uni(path, QWEN2_AUDIO)


def test_only_the_first_stage_reads_and_builds_the_tower(path):
    assert_vision_on_first_stage(path, QWEN2_AUDIO)


def test_pp2_equals_pp1_and_transformers_with_audio(path, uni):
    print("PP=2:", parallel_equals(uni, path, QWEN2_AUDIO, pipeline_parallel_size=2))


def test_each_rank_reads_the_tower_whole(path):
    from safetensors.torch import load_file

    from trillm.config import EngineArgs
    from trillm.distributed.sharding import RankShapes
    from trillm.engine.config_builder import build_config
    from trillm.model_executor.loader import iterate_weights, safetensors_files

    cfg = build_config(EngineArgs(path, tensor_parallel_size=2)).model
    whole = {k: v for f in safetensors_files(path) for k, v in load_file(f).items()}
    rank1 = dict(iterate_weights(path, shard=(cfg, RankShapes.of(cfg, 1, 2))))
    tower = [k for k in whole if k.removeprefix("model.").startswith(TOWER)]
    assert tower and all(torch.equal(rank1[k], whole[k]) for k in tower)
    text_q = next(
        k for k in whole if "language_model." in k and k.endswith("0.self_attn.q_proj.weight")
    )
    assert rank1[text_q].shape[0] * 2 == whole[text_q].shape[0]  # the text side is sharded


def test_tp2_equals_tp1_and_transformers_with_audio(path, uni):
    print("TP=2:", parallel_equals(uni, path, QWEN2_AUDIO, tensor_parallel_size=2))
