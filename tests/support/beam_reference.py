"""transformers' beam search as the reference for ``LLM.beam_search``, and a tiny checkpoint
that ends its beams with EOS now and then."""

from __future__ import annotations

from pathlib import Path


def eos_prone_checkpoint(base: str, out_dir: Path, scale: float = 3.0) -> str:
    """``base`` (an untied tiny checkpoint) with its two EOS rows of lm_head scaled: EOS
    becomes a likely candidate at some positions, so beams end at different lengths."""
    import torch
    from transformers import AutoModelForCausalLM

    from trillm.testing.tiny_models import EOS_IDS, save_text_checkpoint

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        for eos in EOS_IDS:
            model.lm_head.weight[eos] *= scale
    return str(save_text_checkpoint(model, out_dir))


def hf_beam_search(
    model,
    prompt_ids: list[int],
    width: int,
    max_new_tokens: int,
    eos_ids: list[int] | None,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
) -> tuple[list[list[int]], list[float]]:
    """(generated tokens of each returned beam, its score), best first, from
    ``generate(num_beams=width, num_return_sequences=width, do_sample=False)``. One beam is
    transformers' greedy decoding, whose score is computed here the way beams score."""
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False,
        num_beams=width,
        num_return_sequences=width,
        max_new_tokens=max_new_tokens,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        eos_token_id=eos_ids,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            generation_config=config,
        )
    n = len(prompt_ids)
    if width == 1:
        tokens = out.sequences[0, n:].tolist()
        steps = zip(out.scores, tokens, strict=True)
        cum = sum(torch.log_softmax(s[0].float(), -1)[t].item() for s, t in steps)
        return [tokens], [cum / len(tokens) ** length_penalty]
    lengths = (out.beam_indices != -1).sum(-1).tolist()
    rows = out.sequences.tolist()
    return [
        row[n : n + k] for row, k in zip(rows, lengths, strict=True)
    ], out.sequences_scores.tolist()
