"""PEFT LoRA adapters for the tiny test models, written by ``peft`` itself.

``build_peft_adapter(model_dir, out_dir, seed=..)`` wraps the transformers model with a PEFT
``LoraConfig``, fills A and B with seeded random values large enough to change greedy output
(PEFT's own init makes B zero: a no-op adapter), and saves it the way PEFT users ship
adapters (``adapter_config.json`` + ``adapter_model.safetensors``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_peft_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    seed: int = 0,
    rank: int = 8,
    alpha: int = 16,
    targets: list[str] | None = None,
    magnitude: float = 0.15,
    **lora_kwargs: Any,
) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets or ALL_TARGETS,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        **lora_kwargs,
    )
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * magnitude)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    return out


def peft_greedy(
    model_dir: str | Path, adapter_dir: str | Path, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """transformers + PEFT greedy continuations of each prompt (EOS ignored, as
    ``ignore_eos``)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, GenerationConfig

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    gen_config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0
    )
    outs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(
                input_ids=torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                generation_config=gen_config,
            )
            outs.append(out[0, len(ids) :].tolist())
    return outs
