"""A tiny gpt-oss checkpoint that speaks harmony: the tiny random ``gpt_oss`` model of
``tiny_models`` with harmony's special tokens added to its tokenizer (inside the model's
vocabulary), ``<|return|>`` and ``<|call|>`` as its end-of-sequence tokens (as gpt-oss's
generation config has them), and a minimal harmony chat template.

gpt-oss's own template ships in the tokenizer config of its checkpoints, which cannot be
downloaded here; ``HARMONY_TEMPLATE`` renders the same message layout for what trillm's chat
path passes: the system message (identity, reasoning effort, channels), a developer message
(the request's system prompt as instructions, function tools as a TypeScript namespace),
user turns, assistant turns (``final``; tool calls to ``commentary`` with ``to=functions.NAME``
and ``<|constrain|>json``), tool results from ``functions.NAME``, and ``<|start|>assistant``
to generate.
"""

from __future__ import annotations

import json
from pathlib import Path

from trillm.parsers import harmony
from trillm.testing.tiny_models import build_tiny_model

VOCAB_SIZE = 4112  # the shipped tokenizer's 4096 tokens, harmony's 7, rounded up to 16

HARMONY_TEMPLATE = """\
{%- set first = messages[0] if messages else none -%}
{%- set instructions = first.content if first and first.role in ("system", "developer") else none -%}
{{- "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n" -}}
{{- "Knowledge cutoff: 2024-06\\n\\nReasoning: " + (reasoning_effort or "medium") + "\\n\\n" -}}
{{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." -}}
{%- if tools -%}
{{- "\\nCalls to these tools must go to the commentary channel: 'functions'." -}}
{%- endif -%}
{{- "<|end|>" -}}
{%- if instructions or tools -%}
{{- "<|start|>developer<|message|>" -}}
{%- if instructions -%}
{{- "# Instructions\\n\\n" + instructions -}}
{%- if tools %}{{ "\\n\\n" }}{% endif -%}
{%- endif -%}
{%- if tools -%}
{{- "# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n" -}}
{%- for tool in tools -%}
{{- "// " + (tool.function.description or "") + "\\ntype " + tool.function.name -}}
{{- " = (_: " + (tool.function.parameters | tojson) + ") => any;\\n\\n" -}}
{%- endfor -%}
{{- "} // namespace functions" -}}
{%- endif -%}
{{- "<|end|>" -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == "user" -%}
{{- "<|start|>user<|message|>" + message.content + "<|end|>" -}}
{%- elif message.role == "assistant" and message.tool_calls -%}
{%- for call in message.tool_calls -%}
{{- "<|start|>assistant<|channel|>commentary to=functions." + call.function.name -}}
{{- " <|constrain|>json<|message|>" + (call.function.arguments | tojson) + "<|call|>" -}}
{%- endfor -%}
{%- elif message.role == "assistant" -%}
{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" -}}
{%- elif message.role == "tool" -%}
{{- "<|start|>functions." + message.name + " to=assistant<|channel|>commentary<|message|>" -}}
{{- (message.content | tojson) + "<|end|>" -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<|start|>assistant" -}}{%- endif -%}"""


def build_harmony_gpt_oss(out_dir: str | Path) -> Path:
    """The tiny gpt-oss checkpoint with harmony's tokens and template, in ``out_dir``."""
    from transformers import AutoTokenizer

    out = build_tiny_model("gpt_oss", out_dir, vocab_size=VOCAB_SIZE)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_special_tokens({"additional_special_tokens": list(harmony.SPECIAL)})
    if len(tok) > VOCAB_SIZE:
        raise ValueError(f"The harmony tokenizer has {len(tok)} tokens, over {VOCAB_SIZE}.")
    tok.chat_template = HARMONY_TEMPLATE
    tok.save_pretrained(str(out))
    vocab = tok.get_vocab()
    eos = [vocab[harmony.RETURN], vocab[harmony.CALL]]
    for name in ("config.json", "generation_config.json"):
        config = json.loads((out / name).read_text())
        config["eos_token_id"] = eos
        (out / name).write_text(json.dumps(config, indent=2) + "\n")
    return out
