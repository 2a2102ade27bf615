"""Read a Hugging Face Llama-family checkpoint (safetensors, single file or sharded) into fused tensors.

q/k/v are fused into one matrix and gate/up into another: fewer, larger matmuls mean fewer kernel
launches per layer. Each matrix is then handed to the linear kernel's `prepare` (linear_kernels.py),
which stores it in whatever layout that kernel streams fastest; the comments give the logical shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from specdec.errors import InvalidArgument
from specdec.models.linear_kernels import DenseLinear, OneDnnLinear
from specdec.models.llama_config import LlamaConfig


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    bqkv: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim]
    wo: torch.Tensor  # [hidden, heads * head_dim]
    bo: torch.Tensor | None  # [hidden]
    mlp_norm: torch.Tensor  # [hidden]
    w_gate_up: torch.Tensor  # [2 * intermediate, hidden]
    b_gate_up: torch.Tensor | None  # [2 * intermediate]
    w_down: torch.Tensor  # [hidden, intermediate]
    b_down: torch.Tensor | None  # [hidden]


@dataclass
class LlamaWeights:
    embed: torch.Tensor  # [vocab, hidden] (row lookup)
    lm_head: torch.Tensor  # [vocab, hidden] (prepared separately from embed even when tied)
    final_norm: torch.Tensor  # [hidden]
    layers: list[LayerWeights]
    # With a reduced lm_head: the whole vocabulary's output rows, so that a few ids outside the reduced
    # head (a session's own context tokens) can still be scored. None with a full head.
    full_head: torch.Tensor | None = None


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

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.contiguous().to(self.device)


def load_weights(
    directory: Path, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device, linear: DenseLinear | OneDnnLinear,
    head_token_ids: torch.Tensor | None = None,
) -> LlamaWeights:
    r = _Reader(directory, dtype, device)
    embed = r.get("model.embed_tokens.weight")  # [vocab, hidden]
    if cfg.tie_word_embeddings or not r.has("lm_head.weight"):
        if not cfg.tie_word_embeddings:
            raise InvalidArgument(f"{directory}: untied embeddings but no lm_head.weight in the checkpoint")
        lm_head = embed
    else:
        lm_head = r.get("lm_head.weight")
    embed = r.place(embed)
    full_head = None
    if head_token_ids is not None:  # a reduced output head: only these rows are scored every step
        full_head = embed if cfg.tie_word_embeddings else r.place(lm_head)
        lm_head = full_head.index_select(0, head_token_ids.to(full_head.device))
    return LlamaWeights(
        embed=embed, lm_head=linear.prepare(r.place(lm_head)), full_head=full_head,
        final_norm=r.place(r.get("model.norm.weight")), layers=[_load_layer(r, cfg, i, linear) for i in range(cfg.num_layers)],
    )


def _load_layer(r: _Reader, cfg: LlamaConfig, i: int, linear: DenseLinear | OneDnnLinear) -> LayerWeights:
    p = f"model.layers.{i}."
    qkv = [r.get(f"{p}self_attn.{n}_proj.weight") for n in "qkv"]  # each [out, hidden]
    gate_up = [r.get(f"{p}mlp.gate_proj.weight"), r.get(f"{p}mlp.up_proj.weight")]
    return LayerWeights(
        attn_norm=r.place(r.get(f"{p}input_layernorm.weight")),
        wqkv=linear.prepare(r.place(torch.cat(qkv))),
        bqkv=_bias(r, [f"{p}self_attn.{n}_proj.bias" for n in "qkv"], cfg.qkv_bias),
        wo=linear.prepare(r.place(r.get(f"{p}self_attn.o_proj.weight"))),
        bo=_bias(r, [f"{p}self_attn.o_proj.bias"], cfg.o_bias),
        mlp_norm=r.place(r.get(f"{p}post_attention_layernorm.weight")),
        w_gate_up=linear.prepare(r.place(torch.cat(gate_up))),
        b_gate_up=_bias(r, [f"{p}mlp.gate_proj.bias", f"{p}mlp.up_proj.bias"], cfg.mlp_bias),
        w_down=linear.prepare(r.place(r.get(f"{p}mlp.down_proj.weight"))),
        b_down=_bias(r, [f"{p}mlp.down_proj.bias"], cfg.mlp_bias),
    )


def _bias(r: _Reader, names: list[str], present: bool) -> torch.Tensor | None:
    # The config says whether biases exist; a checkpoint that lacks a declared one is an error, not zeros.
    return r.place(torch.cat([r.get(name) for name in names])) if present else None
