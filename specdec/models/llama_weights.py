"""Read a Hugging Face Llama-family checkpoint (safetensors, single file or sharded) into fused tensors.

The native forward multiplies activations by weights stored transposed, [in, out] contiguous, because on
CPU `x @ w` with that layout runs a decode step's matrix-vector products markedly faster than
`F.linear(x, w)` with HF's [out, in] layout (measured on the project's 2-core machine). q/k/v are fused
into one matrix and gate/up into another: fewer, larger matmuls mean fewer kernel launches per layer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from specdec.errors import InvalidArgument
from specdec.models.llama_config import LlamaConfig


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [hidden, (heads + 2 * kv_heads) * head_dim]
    bqkv: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim]
    wo: torch.Tensor  # [heads * head_dim, hidden]
    bo: torch.Tensor | None  # [hidden]
    mlp_norm: torch.Tensor  # [hidden]
    w_gate_up: torch.Tensor  # [hidden, 2 * intermediate]
    b_gate_up: torch.Tensor | None  # [2 * intermediate]
    w_down: torch.Tensor  # [intermediate, hidden]
    b_down: torch.Tensor | None  # [hidden]


@dataclass
class LlamaWeights:
    embed: torch.Tensor  # [vocab, hidden] (row lookup)
    lm_head: torch.Tensor  # [hidden, vocab] (transposed; a copy of embed when tied)
    final_norm: torch.Tensor  # [hidden]
    layers: list[LayerWeights]


def checkpoint_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [directory / name for name in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise InvalidArgument(f"no *.safetensors checkpoint in {directory}")
    return files


class _Reader:
    """Tensors by name across all shards, opened lazily so that peak memory stays near one model."""

    def __init__(self, directory: Path, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self._handles = [safe_open(str(p), framework="pt") for p in checkpoint_files(directory)]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise InvalidArgument(f"checkpoint lacks tensor {name!r}")
        return self._where[name].get_tensor(name).to(self.dtype)

    def place(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.contiguous().to(self.device)


def load_weights(directory: Path, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device) -> LlamaWeights:
    r = _Reader(directory, dtype, device)
    embed = r.get("model.embed_tokens.weight")  # [vocab, hidden]
    if cfg.tie_word_embeddings or not r.has("lm_head.weight"):
        if not cfg.tie_word_embeddings:
            raise InvalidArgument(f"{directory}: untied embeddings but no lm_head.weight in the checkpoint")
        lm_head = embed
    else:
        lm_head = r.get("lm_head.weight")
    layers = [_load_layer(r, cfg, i) for i in range(cfg.num_layers)]
    return LlamaWeights(
        embed=r.place(embed), lm_head=r.place(lm_head.t()), final_norm=r.place(r.get("model.norm.weight")),
        layers=layers,
    )


def _load_layer(r: _Reader, cfg: LlamaConfig, i: int) -> LayerWeights:
    p = f"model.layers.{i}."
    qkv = [r.get(f"{p}self_attn.{n}_proj.weight") for n in "qkv"]  # each [out, hidden]
    gate_up = [r.get(f"{p}mlp.gate_proj.weight"), r.get(f"{p}mlp.up_proj.weight")]
    return LayerWeights(
        attn_norm=r.place(r.get(f"{p}input_layernorm.weight")),
        wqkv=r.place(torch.cat(qkv).t()),
        bqkv=_bias(r, [f"{p}self_attn.{n}_proj.bias" for n in "qkv"], cfg.qkv_bias),
        wo=r.place(r.get(f"{p}self_attn.o_proj.weight").t()),
        bo=_bias(r, [f"{p}self_attn.o_proj.bias"], cfg.o_bias),
        mlp_norm=r.place(r.get(f"{p}post_attention_layernorm.weight")),
        w_gate_up=r.place(torch.cat(gate_up).t()),
        b_gate_up=_bias(r, [f"{p}mlp.gate_proj.bias", f"{p}mlp.up_proj.bias"], cfg.mlp_bias),
        w_down=r.place(r.get(f"{p}mlp.down_proj.weight").t()),
        b_down=_bias(r, [f"{p}mlp.down_proj.bias"], cfg.mlp_bias),
    )


def _bias(r: _Reader, names: list[str], present: bool) -> torch.Tensor | None:
    # The config says whether biases exist; a checkpoint that lacks a declared one is an error, not zeros.
    return r.place(torch.cat([r.get(name) for name in names])) if present else None
