"""Hugging Face transformers as the numerics reference: greedy continuations and logprobs."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=8)
def load_hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    # NOTE: generate() fills unset options from the model's own generation config, so EOS
    # is switched off there: references run to max_new_tokens, like ignore_eos.
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation with EOS ignored the way vLLM's ``ignore_eos`` does
    it: EOS may be generated, it just does not stop generation (``min_new_tokens`` would
    instead forbid EOS, a different distribution)."""
    import torch
    from transformers import GenerationConfig

    model = load_hf_model(path)
    gen_config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            generation_config=gen_config,
        )
    tokens = out[0, len(prompt_ids) :].tolist()
    assert len(tokens) == max_new_tokens, "the reference must not stop at EOS"
    return tokens
