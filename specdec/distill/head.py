"""An EAGLE-style draft head: one decoder layer that drafts from the target's own hidden states.

EAGLE (Li et al., 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty") drafts at
the feature level. Entry t of the head's sequence is

    input_t = fc(concat(embed(x_{t+1}), f_t))          # 2H -> H
    g_t     = decoder_layer(input_t | entries <= t)    # the predicted feature f_{t+1}
    logits  = lm_head(g_t)                             # scores for x_{t+2}

where f_t is the target's feature at position t, and embed and lm_head (and, for pre-norm features, the
final norm) are the target's own: frozen, shared, not stored in the head's checkpoint. When drafting
several tokens in one step, the features of the drafted tokens are unknown (the target has not read them
yet), so the head feeds its own prediction g back in as the next f.

Which feature: f is the target's final hidden state AFTER its final norm (lm_head's input), and the
head's output g goes to lm_head directly, as in EAGLE: a perfect prediction then gives exactly the target's
logits, and g is the same kind of quantity as f, so a predicted feature can stand in for a true one in the
next drafting step. Before the norm, this target's residual stream carries massive activations (rms 34,
single values over 4,000, against rms 1.9 after the norm), which would swamp the token embedding in the fc
and make the feature regression a fit of a few outlier dimensions. feature="pre_norm" (the head's output
then goes through the target's final norm) is kept as an option for comparison.

Attention runs over an explicit set of keys so one forward can stand for many drafting steps at once
(`unrolled`): pass p (p = 1..passes) at base index t is the p-th drafted token of a step whose last true
feature is f_t; it sees the true entries 0..t (pass 1) and its own chain's entries of passes 2..p, which is
exactly the context the head has at drafting time. This is EAGLE-3's "training-time test" (Li et al., 2025)
and also how the evaluation scores every drafting step of a sequence in one batch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FEATURES = ("post_norm", "pre_norm")


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    target: str = ""  # which target the head belongs to (its name or path; the frozen parts come from it)
    feature: str = "post_norm"  # f after the target's final norm (lm_head's input), or "pre_norm" (before it)

    def __post_init__(self):
        if self.feature not in FEATURES:
            raise ValueError(f"feature {self.feature!r}: choose one of {FEATURES}")

    @classmethod
    def from_target(cls, target_config, target: str = "", feature: str = "post_norm") -> "HeadConfig":
        rope = getattr(target_config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta") or getattr(target_config, "rope_theta", None) or 10_000.0
        heads = target_config.num_attention_heads
        return cls(
            hidden_size=target_config.hidden_size, num_attention_heads=heads,
            num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
            intermediate_size=target_config.intermediate_size, vocab_size=target_config.vocab_size,
            rope_theta=float(theta), rms_norm_eps=float(target_config.rms_norm_eps), target=target,
            feature=feature,
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (Su et al., 2021), the Llama half-split layout.
    x: [B, heads, T, D]; positions: [B, T]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.float()[:, None, :, None] * inv_freq  # [B, 1, T, D/2]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class DecoderLayer(nn.Module):
    """A Llama decoder layer (pre-norm attention with GQA and rotary positions, SwiGLU MLP) whose
    attention takes an explicit key/value set and boolean mask, so chained drafting steps can share
    one forward."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normed input, rotated keys [B, kv_heads, T, D] and values of entries x [B, T, H]."""
        b, t, _ = x.shape
        normed = self.input_norm(x)
        k = self.k_proj(normed).view(b, t, self.cfg.num_key_value_heads, -1).transpose(1, 2)
        v = self.v_proj(normed).view(b, t, self.cfg.num_key_value_heads, -1).transpose(1, 2)
        return normed, _rotate(k, positions, self.cfg.rope_theta), v

    def forward(self, x: torch.Tensor, normed: torch.Tensor, positions: torch.Tensor,
                keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x, normed: [B, T, H] (normed = input_norm(x)); keys, values: [B, kv_heads, S, D];
        mask: [T, S] bool, True where a query may attend."""
        b, t, _ = x.shape
        q = self.q_proj(normed).view(b, t, self.cfg.num_attention_heads, -1).transpose(1, 2)
        q = _rotate(q, positions, self.cfg.rope_theta)
        groups = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        attn = F.scaled_dot_product_attention(q, keys, values.to(q.dtype), attn_mask=mask)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        mlp_in = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(mlp_in)) * self.up_proj(mlp_in))


class DraftHead(nn.Module):
    """fc + one decoder layer; the target's embedding, final norm and lm_head are attached, frozen."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.layer = DecoderLayer(cfg)
        self._frozen: tuple[nn.Module, ...] = ()  # a tuple, so the target's modules are not submodules

    def attach(self, target) -> "DraftHead":
        """Share the target's (frozen) embedding, final norm and lm_head."""
        self._frozen = (target.get_input_embeddings(), target.model.norm, target.get_output_embeddings())
        for module in self._frozen:
            module.requires_grad_(False)
        return self

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._frozen[0](ids)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """The target's own map from a feature to next-token scores."""
        if self.cfg.feature == "pre_norm":
            features = self._frozen[1](features)
        return self._frozen[2](features)

    def pick(self, pre_norm: torch.Tensor, post_norm: torch.Tensor) -> torch.Tensor:
        """Of the target's two final hidden states (evaluate_head.target_features), the head's feature."""
        return pre_norm if self.cfg.feature == "pre_norm" else post_norm

    def unrolled(self, features: torch.Tensor, next_ids: torch.Tensor, passes: int) -> list[torch.Tensor]:
        """Predicted features of `passes` chained drafting steps from every base index.

        features: [B, L, H], f_t (true); next_ids: [B, L + passes - 1], x_{t+1} for t = 0..L+passes-2
        (pad beyond the sequence with any id: those entries only feed outputs past its end).
        Returns one [B, L, H] per pass: out[p-1][:, t] is g of the p-th drafted token of the step whose
        last true feature is f_t, i.e. it scores x_{t+p+1}; its inputs are f_t (p = 1) or out[p-2][:, t],
        with token x_{t+p}."""
        b, length, _ = features.shape
        base = torch.arange(length, device=features.device)
        causal = base[None, :] <= base[:, None]  # [L, L] pass-1 keys a query may see
        diagonal = torch.eye(length, dtype=torch.bool, device=features.device)
        keys, values, outputs = [], [], []
        feature = features
        for p in range(passes):
            x = self.fc(torch.cat([self.embed(next_ids[:, p:p + length]).to(feature.dtype), feature], dim=-1))
            positions = (base + p).expand(b, length)
            normed, k, v = self.layer.keys_values(x, positions)
            keys.append(k)
            values.append(v)
            mask = torch.cat([causal] + [diagonal] * p, dim=1)  # [L, (p+1) L]
            feature = self.layer(x, normed, positions, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask)
            outputs.append(feature)
        return outputs


def save_head(head: DraftHead, out_dir: str | Path, meta: dict | None = None) -> Path:
    """config.json (the head's shape, its target, `meta`) + model.safetensors (the head's own weights)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt", "target": head.cfg.target})
    (out / CONFIG_NAME).write_text(json.dumps({"architecture": "eagle_draft_head", **asdict(head.cfg),
                                               **({"meta": meta} if meta else {})}, indent=2))
    return out


def load_head(path: str | Path, target=None) -> DraftHead:
    from safetensors.torch import load_file

    raw = json.loads((Path(path) / CONFIG_NAME).read_text())
    fields = set(HeadConfig.__dataclass_fields__)
    head = DraftHead(HeadConfig(**{k: v for k, v in raw.items() if k in fields}))
    head.load_state_dict(load_file(str(Path(path) / WEIGHTS_NAME)))
    return head.attach(target) if target is not None else head


def num_parameters(head: DraftHead) -> int:
    return sum(p.numel() for p in head.parameters())
