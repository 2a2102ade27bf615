"""The Llama-family configuration the native backend understands, read from a Hugging Face config.json.

It reads the raw JSON rather than a transformers config class so that the native backend does not depend
on which transformers release wrote the file: older releases save `rope_theta` + `rope_scaling`, newer
ones a `rope_parameters` dict; both are accepted. Anything the native forward would compute differently
from transformers (sliding windows, unusual RoPE types, other activations) is refused here with a
message saying what is supported, so the loader can fall back to the generic backend instead.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specdec.errors import InvalidArgument

# architectures[0] in config.json -> our short name. SmolLM ships as LlamaForCausalLM.
NATIVE_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_ROPE_THETA = 10_000.0  # transformers' default when a config names none


class UnsupportedModel(InvalidArgument):
    """The native backend cannot run this configuration exactly; the message says why and what works."""


@dataclass(frozen=True)
class LlamaConfig:
    architecture: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama when attention_bias
    o_bias: bool  # Llama attention_bias only (Qwen2 has no o_proj bias)
    mlp_bias: bool
    rope_theta: float
    rope_type: str  # one of SUPPORTED_ROPE_TYPES
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    sliding_window: int | None = None  # only set when the window is really active

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "LlamaConfig":
        architectures = raw.get("architectures") or []
        arch = NATIVE_ARCHITECTURES.get(architectures[0] if architectures else "")
        if arch is None:
            raise UnsupportedModel(
                f"architecture {architectures or raw.get('model_type')!r} is not native; "
                f"supported: {sorted(NATIVE_ARCHITECTURES)} (use backend='hf' for others)"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"hidden_act {raw['hidden_act']!r} is not supported; only 'silu'")
        if raw.get("pretraining_tp", 1) != 1:
            raise UnsupportedModel("pretraining_tp != 1 is not supported")
        num_heads = int(raw["num_attention_heads"])
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            # Mistral-Nemo style configs set head_dim explicitly (not hidden / heads).
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or attention_bias,
            o_bias=arch != "qwen2" and attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=_active_sliding_window(arch, raw),
            **_rope_fields(raw),
        )

    @classmethod
    def load(cls, directory: str | Path) -> "LlamaConfig":
        with open(Path(directory) / "config.json", encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def check_context(self, max_context: int) -> None:
        """Refuse a context the native attention would compute differently from the trained model."""
        if max_context > self.max_position_embeddings:
            raise InvalidArgument(
                f"max_context {max_context} exceeds the model's max_position_embeddings "
                f"{self.max_position_embeddings}; choose a smaller max_context"
            )
        if self.sliding_window is not None and self.sliding_window < max_context:
            raise UnsupportedModel(
                f"{self.architecture} uses a sliding attention window of {self.sliding_window} tokens, "
                f"which the native backend does not implement; choose max_context <= {self.sliding_window} "
                f"(then the window never applies) or backend='hf'"
            )

    def rope_inv_freq(self) -> torch.Tensor:
        """Inverse frequencies [head_dim // 2], float32, computed the way transformers computes them."""
        dim = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if self.rope_type == "linear":
            return inv_freq / self.rope_factor
        if self.rope_type == "llama3":
            return _llama3_scale(inv_freq, self)
        return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, cfg: LlamaConfig) -> torch.Tensor:
    # Llama 3.1 context extension: long wavelengths (beyond the original context) are slowed by `factor`,
    # short ones kept, the band between interpolated smoothly (Meta's reference, as transformers does it).
    low_freq_wavelen = cfg.rope_original_max_position / cfg.rope_low_freq_factor
    high_freq_wavelen = cfg.rope_original_max_position / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / cfg.rope_factor, inv_freq)
    smooth = (cfg.rope_original_max_position / wavelen - cfg.rope_low_freq_factor) / (
        cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rope_fields(raw: dict[str, Any]) -> dict[str, Any]:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModel("per-layer-type RoPE parameters are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModel(
            f"rope type {rope_type!r} is not supported natively; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UnsupportedModel(f"partial_rotary_factor {partial} is not supported; only 1.0")
    fields: dict[str, Any] = {
        "rope_type": rope_type,
        "rope_theta": float(params.get("rope_theta") or raw.get("rope_theta") or DEFAULT_ROPE_THETA),
    }
    if rope_type in ("linear", "llama3"):
        fields["rope_factor"] = float(params["factor"])
    if rope_type == "llama3":
        fields["rope_low_freq_factor"] = float(params["low_freq_factor"])
        fields["rope_high_freq_factor"] = float(params["high_freq_factor"])
        fields["rope_original_max_position"] = int(
            params.get("original_max_position_embeddings") or raw.get("max_position_embeddings", 8192)
        )
    return fields


def _active_sliding_window(arch: str, raw: dict[str, Any]) -> int | None:
    window = raw.get("sliding_window")
    if not window:
        return None
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        # Newer configs say per layer whether the window applies; that list is authoritative.
        return int(window) if "sliding_attention" in layer_types else None
    if arch == "qwen2":
        # Qwen2 carries a window size but only applies it with use_sliding_window, from max_window_layers on.
        first_windowed = raw.get("max_window_layers", 0)
        active = raw.get("use_sliding_window", False) and first_windowed < raw["num_hidden_layers"]
        return int(window) if active else None
    if arch == "llama":
        return None  # Llama never had a window; the key would be a leftover
    return int(window)
