"""The reasoning parsers of more families (vLLM's names: glm45, step3, kimi_k2, mistral,
hunyuan_a13b, granite) on outputs in each family's own format, non-streamed and streamed at
every split point alike; outputs cut off while reasoning, and outputs with no reasoning. Where
structured outputs start (engine side), or that they are refused."""

from __future__ import annotations

import pytest

from trillm.parsers.reasoning import (
    ENDED,
    REASONING,
    UNDECIDED,
    get_reasoning_parser,
    reasoning_parser_names,
)

NAMES = ["glm45", "step3", "kimi_k2", "mistral", "hunyuan_a13b", "granite"]
GLM_OPEN = "<|user|>\nhi<|assistant|>\n<think>"
GLM_CLOSED = "<|user|>\nhi<|assistant|>\n<think></think>\n"
KIMI_CALLS = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
KIMI_CALLS += '<|tool_call_argument_begin|>{"x": 1}<|tool_call_end|><|tool_calls_section_end|>'
HUNYUAN = (
    "<think>\nThe user wants 2 + 2.\nThat is 4.\n</think>\n<answer>\n2 + 2 = **4**.\n</answer>"
)

# (parser, chat_template_kwargs, rendered prompt, output, reasoning, content)
CASES = [
    ("glm45", {}, "", "<think>Hmm, 2 + 2 = 4.</think>\nIt's 4.", "Hmm, 2 + 2 = 4.", "\nIt's 4."),
    ("glm45", {}, GLM_OPEN, "Still thinking about ünïcode", "Still thinking about ünïcode", None),
    ("glm45", {}, GLM_CLOSED, "It's 4.", None, "It's 4."),
    ("step3", {}, "", "Let me add.\n</think>\n4", "Let me add.\n", "\n4"),
    ("step3", {}, "", "Cut off while thinking", "Cut off while thinking", None),
    ("kimi_k2", {}, "", "<think>Add them.</think>4", "Add them.", "4"),
    ("kimi_k2", {}, "", "I need the tool." + KIMI_CALLS, "I need the tool.", KIMI_CALLS),
    ("kimi_k2", {"thinking": False}, "", "<think>x</think>4", None, "<think>x</think>4"),
    (
        "mistral",
        {},
        "",
        "[THINK]Add: 2 + 2 = 4.[/THINK]The answer is 4.",
        "Add: 2 + 2 = 4.",
        "The answer is 4.",
    ),
    ("mistral", {}, "", "[THINK]Cut off [while] thinking", "Cut off [while] thinking", None),
    ("mistral", {}, "", "No thinking [here].", None, "No thinking [here]."),
    ("mistral", {}, "", "Stray[/THINK] end", None, "Stray end"),
    ("hunyuan_a13b", {}, "", HUNYUAN, "The user wants 2 + 2.\nThat is 4.", "2 + 2 = **4**."),
    ("hunyuan_a13b", {}, "", "<think>\n\n</think>\n<answer>\nFast: 4\n</answer>", None, "Fast: 4"),
    ("hunyuan_a13b", {}, "", "<think>\nCut off <answer", "Cut off <answer", None),
    ("hunyuan_a13b", {}, "", "Just 4.", None, "Just 4."),
    (
        "granite",
        {},
        "",
        "Here is my thought process:\n2 + 2 is 4. Here it is.\nHere is my response:\nIt's 4.",
        "\n2 + 2 is 4. Here it is.\n",
        "\nIt's 4.",
    ),
    (
        "granite",
        {},
        "",
        "Here's my thought process: cut off. Here's my",
        " cut off. Here's my",
        None,
    ),
    ("granite", {}, "", "Here you go: 4.", None, "Here you go: 4."),
]


def parser(name: str, kwargs: dict, prompt: str):
    return get_reasoning_parser(name)(prompt, kwargs)


def stream(name: str, kwargs: dict, prompt: str, parts: list[str]) -> tuple[str | None, str | None]:
    streamer = parser(name, kwargs, prompt).streamer()
    reasoning = content = ""
    for part in [*parts, None]:
        r, c = streamer.feed(part) if part is not None else streamer.finish()
        reasoning, content = reasoning + r, content + c
    return reasoning or None, content or None


def test_registered_under_vllms_names():
    assert set(NAMES) <= set(reasoning_parser_names())


@pytest.mark.parametrize(("name", "kwargs", "prompt", "text", "reasoning", "content"), CASES)
def test_split_at_every_point(name, kwargs, prompt, text, reasoning, content):
    assert parser(name, kwargs, prompt).extract(text) == (reasoning, content)
    assert stream(name, kwargs, prompt, list(text)) == (reasoning, content)
    for k in range(len(text) + 1):
        assert stream(name, kwargs, prompt, [text[:k], text[k:]]) == (reasoning, content), k


class Vocab:
    def __init__(self, *tokens: str) -> None:
        self.vocab = {t: i + 100 for i, t in enumerate(tokens)}

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def test_where_structured_outputs_start():
    mistral = get_reasoning_parser("mistral")
    ids = mistral.token_ids(Vocab("[THINK]", "[/THINK]"))
    assert ids == (100, 101)
    assert mistral.prompt_state([1, 2], ids) == UNDECIDED  # [THINK] first, or content
    assert mistral.prompt_state([1, 100], ids) == REASONING
    step3 = get_reasoning_parser("step3")
    assert step3.prompt_state([1, 2], step3.token_ids(Vocab("<think>", "</think>"))) == REASONING
    glm = get_reasoning_parser("glm45")
    assert glm.prompt_state([100, 101], glm.token_ids(Vocab("<think>", "</think>"))) == ENDED
    with pytest.raises(ValueError, match=r"'mistral' needs \[THINK\] and \[/THINK\]"):
        mistral.token_ids(Vocab("<think>", "</think>"))


@pytest.mark.parametrize("name", ["hunyuan_a13b", "granite"])
def test_structured_outputs_are_refused_where_reasoning_ends_at_plain_text(name):
    cls = get_reasoning_parser(name)
    assert not cls.structured_outputs
    assert cls.token_ids(Vocab()) == (-1, -1)  # the engine asks for no tags
