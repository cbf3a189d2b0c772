"""Tiny checkpoints that chat in a model family's own format: the family's role markers added
to the tokenizer as special tokens and a chat template laid out as the family's published one
(roles, markers, generation prompt), so an HTTP chat exercises the template, the special
tokens and the model together. gpt-oss's harmony format is ``tiny_harmony.py``'s."""

from __future__ import annotations

from pathlib import Path

from trillm.testing.reasoning_model import add_special_tokens

# family -> (special tokens, chat template)
FAMILIES: dict[str, tuple[list[str], str]] = {
    # DeepSeek-V3 / R1: BOS, the system text bare, then User / Assistant markers.
    "deepseek_v3": (
        ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
        "{{- '<｜begin▁of▁sentence｜>' -}}"
        "{%- for m in messages if m.role == 'system' -%}{{- m.content -}}{%- endfor -%}"
        "{%- for m in messages if m.role != 'system' -%}"
        "{%- if m.role == 'user' -%}{{- '<｜User｜>' + m.content -}}"
        "{%- else -%}{{- '<｜Assistant｜>' + m.content + '<｜end▁of▁sentence｜>' -}}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<｜Assistant｜>' -}}{%- endif -%}",
    ),
    # Llama 4: header-wrapped roles, each turn ended by <|eot|>.
    "llama4": (
        ["<|begin_of_text|>", "<|header_start|>", "<|header_end|>", "<|eot|>"],
        "{{- '<|begin_of_text|>' -}}"
        "{%- for m in messages -%}"
        "{{- '<|header_start|>' + m.role + '<|header_end|>\\n\\n' + m.content + '<|eot|>' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}"
        "{{- '<|header_start|>assistant<|header_end|>\\n\\n' -}}{%- endif -%}",
    ),
    # IBM Granite (Granite 4.0-H, Bamba): role markers, each turn ended by <|end_of_text|>.
    "granite": (
        ["<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"],
        "{%- for m in messages -%}"
        "{{- '<|start_of_role|>' + m.role + '<|end_of_role|>' + m.content "
        "+ '<|end_of_text|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}"
        "{{- '<|start_of_role|>assistant<|end_of_role|>' -}}{%- endif -%}",
    ),
}


def with_family_chat(src: str | Path, out: str | Path, family: str) -> Path:
    """Copy the checkpoint ``src`` to ``out`` speaking ``family``'s chat format."""
    from transformers import AutoTokenizer

    tokens, template = FAMILIES[family]
    add_special_tokens(src, out, tokens)
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.chat_template = template
    tok.save_pretrained(str(out))
    return Path(out)
