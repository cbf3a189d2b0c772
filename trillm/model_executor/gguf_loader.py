"""GGUF files (llama.cpp's format): find one, read its config, stream its tensors.

``trillm serve model.gguf`` (or a folder without config.json holding exactly one .gguf) runs the
model in the file: the config from the GGUF metadata (``llama``, ``qwen2`` and ``qwen3``
architectures: Llama, SmolLM2, Mistral, Qwen2, Qwen3 as llama.cpp converts them), the tokenizer
and chat template from the file (``engine/config_builder.load_tokenizer``), the weights here.

Tensors: F32 / F16 / BF16 are loaded in the run's dtype; Q4_0, Q4_1, Q8_0 and the K-quants
(Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) are kept quantized (``layers/quantized_linear.py``, a native
kernel on CPU; a stacked layer mixing them keeps each shard's type) unless ``dequantize_gguf``
asks for them in the run's dtype (the K-quants through ``gguf_kquants.py``); any other GGML type
is refused naming it before anything loads.
llama.cpp stores a ``llama`` model's q/k projection rows permuted for its rotary layout
(``permute`` in its converter): ``_unpermute`` puts them back in Hugging Face's order.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trillm.model_executor.registry import UnsupportedArchitectureError

if TYPE_CHECKING:  # the frontend reads a GGUF's config without torch; tensors need it
    import torch

# GGUF general.architecture -> trillm architecture
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
FLOAT_TYPES = ("F32", "F16", "BF16")
KQUANT_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # what gguf_kquants dequantizes
QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q8_0", *KQUANT_TYPES)  # kept (unless dequantize_gguf)

# GGUF tensor name (blk.N. prefix removed) -> Hugging Face name (model.layers.N. prefix added)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.x GGUFs: the rope scaling's per-pair divisors
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class GGUFError(ValueError):
    """A GGUF file trillm cannot run (architecture, tensor type, layout), or a bad path."""


def find_gguf(model: str | None) -> Path | None:
    """The GGUF file ``model`` names: a ``.gguf`` file, or a folder without config.json holding
    exactly one; None for anything else (a model folder, a hub id)."""
    if model is None:
        return None
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise GGUFError(f"GGUF file {model!r} does not exist.")
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise GGUFError(f"Folder {model!r} holds several GGUF files ({names}): name one.")
    return files[0] if files else None


@dataclass
class GGUFTensor:
    name: str  # Hugging Face name
    type_name: str  # GGML type, e.g. "Q4_1"
    shape: tuple[int, ...]  # [N, K] / [N], torch order
    data: np.ndarray  # float values, or GGML block rows [N, bytes] uint8 (a memory map)


class GGUFFile:
    """One GGUF file read once: its metadata as a Hugging Face config, its tensors."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        try:
            self.reader = GGUFReader(self.path)
        except (ValueError, OSError) as exc:
            raise GGUFError(f"{str(self.path)!r} is not a readable GGUF file: {exc}") from exc
        self.arch = str(self._field("general.architecture"))
        if self.arch not in ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"GGUF architecture {self.arch!r} is not supported; supported: "
                f"{', '.join(sorted(ARCHITECTURES))}."
            )
        self.tensor_types = {t.name: t.tensor_type.name for t in self.reader.tensors}
        known = tuple(dict.fromkeys((*FLOAT_TYPES, *QUANTIZED_TYPES, *KQUANT_TYPES)))
        unsupported = sorted({t for t in self.tensor_types.values() if t not in known})
        if unsupported:
            raise GGUFError(
                f"GGUF tensor type(s) {', '.join(unsupported)} are not supported; trillm runs "
                f"{', '.join(known)}."
            )
        scaling = self._field(f"{self.arch}.rope.scaling.type", "none")
        if scaling != "none":
            raise GGUFError(f"GGUF rope scaling {scaling!r} is not supported.")

    def _field(self, key: str, default: Any = None) -> Any:
        field = self.reader.get_field(key)
        if field is None:
            if default is None:
                raise GGUFError(f"GGUF metadata lacks {key!r}.")
            return default
        return field.contents()

    def hf_config(self) -> dict[str, Any]:
        """The metadata as a Hugging Face config.json would say it."""
        a = self.arch
        heads = int(self._field(f"{a}.attention.head_count"))
        hidden = int(self._field(f"{a}.embedding_length"))
        head_dim = int(self._field(f"{a}.attention.key_length", hidden // heads))
        rotary = int(self._field(f"{a}.rope.dimension_count", head_dim))
        if rotary != head_dim:
            raise GGUFError(f"GGUF partial rotary ({rotary} of {head_dim} dims) is not supported.")
        tokens = self.reader.get_field("tokenizer.ggml.tokens")
        vocab = self._field(f"{a}.vocab_size", len(tokens.data) if tokens is not None else None)
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[a]],
            "model_type": a,
            "hidden_size": hidden,
            "intermediate_size": int(self._field(f"{a}.feed_forward_length")),
            "num_hidden_layers": int(self._field(f"{a}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._field(f"{a}.attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "rms_norm_eps": float(self._field(f"{a}.attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self._field(f"{a}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._field(f"{a}.context_length", 2048)),
            "vocab_size": int(vocab),
            "tie_word_embeddings": "output.weight" not in self.tensor_types,
            "attention_bias": "blk.0.attn_q.bias" in self.tensor_types,
            "hidden_act": "silu",
            "torch_dtype": self.checkpoint_dtype(),
        }
        if ROPE_FREQS in self.tensor_types:  # Llama 3.x: its rope scaling, as a tensor
            tensor = next(t for t in self.reader.tensors if t.name == ROPE_FREQS)
            if tensor.tensor_type.name != "F32":
                raise GGUFError(
                    f"GGUF {ROPE_FREQS} of type {tensor.tensor_type.name}: F32 expected."
                )
            factors = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
            scaling = llama3_scaling(factors, config["rope_theta"], head_dim)
            if scaling is not None:
                config["rope_scaling"] = scaling
        for key in ("bos", "eos"):
            token = self.reader.get_field(f"tokenizer.ggml.{key}_token_id")
            if token is not None:
                config[f"{key}_token_id"] = int(token.contents())
        return config

    def checkpoint_dtype(self) -> str:
        """The embedding's float type (float32 when it is quantized): what ``--dtype auto``
        starts from."""
        kind = self.tensor_types.get("token_embd.weight", "F32")
        return {"F16": "float16", "BF16": "bfloat16"}.get(kind, "float32")

    def tensors(self) -> Iterator[GGUFTensor]:
        """Every tensor under its Hugging Face name, q/k rows back in Hugging Face's order."""
        config = self.hf_config()
        for t in self.reader.tensors:
            if t.name == ROPE_FREQS:  # read into the config's rope_scaling
                continue
            name = hf_name(t.name)
            data = np.asarray(t.data)
            shape = tuple(int(s) for s in reversed(t.shape.tolist()))
            if self.arch == "llama" and re.search(r"\.(q|k)_proj\.", name):
                heads = config[
                    "num_attention_heads" if ".q_proj." in name else "num_key_value_heads"
                ]
                data = _unpermute(data, heads)
            yield GGUFTensor(name, t.tensor_type.name, shape, data)


def llama3_factors(scaling: dict[str, Any], base: float, dim: int) -> np.ndarray:
    """What each rotary pair's frequency is divided by under Hugging Face's ``llama3`` rope
    scaling (``layers/rotary.py``): 1 for short wavelengths, ``factor`` for long ones, a smooth
    blend between. llama.cpp's converter stores these as the ``rope_freqs`` tensor."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * np.pi * base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    with np.errstate(divide="ignore", invalid="ignore"):  # outside the smooth band: not used
        smooth = (original / wavelen - low) / (high - low)
        medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(
        wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, medium)
    )


def llama3_scaling(factors: np.ndarray, base: float, dim: int) -> dict[str, Any] | None:
    """The ``llama3`` rope scaling whose ``rope_freqs`` are ``factors`` (None: all 1, none).

    The factors fix the long-wavelength ``factor`` and the two band edges (``original / low``,
    ``original / high``); the smooth band's values fix the edges exactly when it holds two or
    more pairs (Llama 3.1 / 3.2 have 3 to 6), else they lie anywhere in the gaps around it.
    Read with ``low_freq_factor`` 1 (Llama 3's), so ``original_max_position_embeddings`` is the
    low edge. Factors of any other shape are refused."""
    wavelen = 2 * np.pi * base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    factor = float(factors.max())
    refuse = GGUFError(
        f"GGUF {ROPE_FREQS} does not follow Llama 3's rope scaling; no other is supported."
    )
    if factors.shape != wavelen.shape or factors.min() < 1 - 1e-6:
        raise refuse
    if factor < 1 + 1e-6:
        return None
    kept, scaled = factors < 1 + 1e-6, factors > factor * (1 - 1e-6)
    medium = ~kept & ~scaled
    if medium.sum() >= 2:  # 1/f = (1 - s)/factor + s, s = original / (high - low) / wavelen - ...
        s = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelen[medium], s, 1)
        low_edge, high_edge = slope / -intercept, slope / (1 - intercept)
    elif medium.sum() == 0 and kept.any() and scaled.any():
        below, above = wavelen[kept].max(), wavelen[scaled].min()  # one gap: edges in it
        high_edge, low_edge = (
            below ** (2 / 3) * above ** (1 / 3),
            below ** (1 / 3) * above ** (2 / 3),
        )
    else:
        raise refuse
    original = float(round(low_edge)) if abs(low_edge - round(low_edge)) < 1e-3 else float(low_edge)
    high = round(float(original / high_edge), 6)
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": high,
        "original_max_position_embeddings": int(original) if original.is_integer() else original,
    }
    if not np.allclose(llama3_factors(scaling, base, dim), factors, rtol=1e-4):
        raise refuse
    return scaling


def hf_name(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    base, _, kind = name.rpartition(".")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{kind}"
    raise GGUFError(f"GGUF tensor {name!r} has no place in the model.")


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head permutation of q/k rows: within each head, row i of the
    interleaved halves goes back to HF's [first half; second half]. Works on float rows and
    on GGML block rows alike (whole rows move)."""
    n = rows.shape[0]
    rest = rows.shape[1:]
    return np.ascontiguousarray(
        rows.reshape(heads, n // heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows.shape)
    )


def float_tensor(t: GGUFTensor) -> torch.Tensor:
    """An F32 / F16 / BF16 tensor's values (a copy) in its own dtype."""
    import torch

    data = np.ascontiguousarray(t.data)
    if t.type_name == "BF16":
        return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).reshape(t.shape)
    return torch.from_numpy(data.copy()).reshape(t.shape)


def dequantized_tensor(t: GGUFTensor) -> torch.Tensor:
    """A quantized tensor's values in fp32 (K-quants: ``gguf_kquants``; the others: the gguf
    package's dequantizer)."""
    import torch

    if t.type_name in KQUANT_TYPES:
        from trillm.model_executor import gguf_kquants

        raw = torch.from_numpy(np.array(t.data, dtype=np.uint8))  # a copy: the file is read-only
        return gguf_kquants.dequantize(raw, t.type_name).reshape(t.shape)
    from gguf import GGMLQuantizationType, quants

    values = quants.dequantize(np.ascontiguousarray(t.data), GGMLQuantizationType[t.type_name])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(t.shape)
