"""The draft model: a small Llama with the target's vocabulary, initialised from the target.

Sizes are named by a spec string, e.g. "h256-l3-i768-kv2": hidden 256, 3 layers, MLP width 768, 2 KV
heads (query heads = hidden / 64). The embedding is tied to the output head (one 49152 x hidden matrix is
most of a small draft) and initialised with the target's embedding projected on its top principal
directions, so the draft starts from the target's token geometry instead of noise.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

HEAD_DIM = 64
DEFAULT_DRAFT = "h256-l3-i768-kv2"
_SPEC = re.compile(r"h(\d+)-l(\d+)-i(\d+)-kv(\d+)")


@dataclass(frozen=True)
class DraftSpec:
    hidden: int
    layers: int
    intermediate: int
    kv_heads: int

    @classmethod
    def parse(cls, text: str) -> "DraftSpec":
        m = _SPEC.fullmatch(text)
        if not m:
            raise ValueError(f"draft spec {text!r} is not of the form h<hidden>-l<layers>-i<mlp>-kv<kv heads>")
        spec = cls(*map(int, m.groups()))
        heads = spec.hidden // HEAD_DIM
        if spec.hidden % HEAD_DIM or heads % spec.kv_heads:
            raise ValueError(f"hidden must be a multiple of {HEAD_DIM} and its heads ({heads}) of kv heads")
        return spec

    @property
    def name(self) -> str:
        return f"h{self.hidden}-l{self.layers}-i{self.intermediate}-kv{self.kv_heads}"


def draft_config(target_config, spec: DraftSpec) -> LlamaConfig:
    rope = getattr(target_config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))
    return LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.hidden // HEAD_DIM,
        num_key_value_heads=spec.kv_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-5),
        rope_theta=theta,
        tie_word_embeddings=True,
        bos_token_id=target_config.bos_token_id,
        eos_token_id=target_config.eos_token_id,
        pad_token_id=getattr(target_config, "pad_token_id", None),
    )


def pca_embedding(target_embedding: torch.Tensor, dim: int) -> torch.Tensor:  # [V, H] -> [V, dim]
    """The target's token embeddings on their top-`dim` principal directions (variance kept)."""
    emb = target_embedding.detach().float().cpu()
    centered = emb - emb.mean(dim=0, keepdim=True)
    _, _, v = torch.linalg.svd(centered, full_matrices=False)  # v: [H, H], rows are directions
    return centered @ v[:dim].T if dim <= v.shape[0] else torch.cat(
        [centered @ v.T, torch.zeros(emb.shape[0], dim - v.shape[0])], dim=1)


def build_draft(target, spec: DraftSpec, seed: int) -> LlamaForCausalLM:
    """A fresh draft for `target` (an HF causal LM), seeded, with the PCA embedding initialisation."""
    torch.manual_seed(seed)
    draft = LlamaForCausalLM(draft_config(target.config, spec))
    with torch.no_grad():
        emb = pca_embedding(target.get_input_embeddings().weight, spec.hidden)
        # Rescale so a row's RMS matches the random init's: the tied head's logits keep a sane scale.
        emb = emb * (draft.config.initializer_range / emb.pow(2).mean().sqrt())
        draft.get_input_embeddings().weight.copy_(emb)
    return draft


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def save_draft(draft: LlamaForCausalLM, tokenizer, out_dir: str | Path, meta: dict | None = None) -> int:
    """Write an HF checkpoint (bf16 safetensors, config, the target's tokenizer); returns its bytes."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    copy = LlamaForCausalLM(draft.config)
    copy.load_state_dict(draft.state_dict())
    copy.to(torch.bfloat16).save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
        tok_json = out / "tokenizer.json"
        if tok_json.exists():  # compact JSON: same tokenizer, about a third smaller on disk
            tok_json.write_text(json.dumps(json.loads(tok_json.read_text(encoding="utf-8")),
                                           ensure_ascii=False, separators=(",", ":")), encoding="utf-8")
    if meta is not None:
        (out / "distill_meta.json").write_text(json.dumps(meta, indent=2))
    return sum(f.stat().st_size for f in out.iterdir() if f.is_file())
