"""A draft's matrices stored in float8 (e4m3): half the bytes of bf16, so a draft twice as large fits
issue 4's 32 MB limit (at bf16 the tied 49,152-row embedding alone holds a width-256 draft to 25 MB).
transformers and the native backend load a float8 safetensors tensor into a bf16 or fp32 model by
upcasting it, which is exact, so the checkpoint stays an ordinary HF Llama directory.

e4m3 keeps 3 mantissa bits between 2^-6 and 448, and fewer in the subnormals below; a trained draft's
weights sit around 0.001-0.3, much of them in the subnormals. So before rounding every matrix is moved
into the normal range by rescalings that leave the model's function unchanged in exact arithmetic:
- RMSNorm ignores its input's scale but for its epsilon: the residual stream can run s times larger
  (the embedding and the output and down projections x s) with the config's rms_norm_eps x s^2, and
  the final norm's weight / s keeps the tied head's logits;
- a norm's weight / t with the matrices it feeds x t (q, k and v share the attention norm; gate and up
  the MLP norm);
- attention scores are q . k: q x a with k / a;
- attention output is linear in v and the MLP output in up: v x c with o / c, up x b with down / b.
The 1-D norm weights stay bf16. `quantization_error` measures what the rounding itself changes.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
TOP = 224.0  # every matrix's largest entry is put here: half of e4m3's 448, so rounding cannot overflow
NORM_DTYPE = torch.bfloat16


def _max(w: torch.Tensor) -> float:
    return float(w.abs().max())


def rescaled(state: dict[str, torch.Tensor], num_layers: int) -> tuple[dict[str, torch.Tensor], float]:
    """The state dict (HF Llama names, tied head) rescaled as the module docstring says, in float32,
    and the residual stream's scale s (the config's rms_norm_eps must grow by s^2): the same function,
    every matrix's largest entry at most TOP."""
    w = {k: v.float() for k, v in state.items() if k != "lm_head.weight"}
    layer = lambda i, name: f"model.layers.{i}.{name}.weight"  # noqa: E731
    scales = []
    for i in range(num_layers):
        q, k, v, o = (_max(w[layer(i, f"self_attn.{p}_proj")]) for p in "qkvo")
        gate, up, down = (_max(w[layer(i, f"mlp.{p}_proj")]) for p in ("gate", "up", "down"))
        t = TOP / math.sqrt(q * k)  # the attention norm's weight / t, and q and k at TOP together:
        a = math.sqrt(k / q)        # q x t a, k x t / a
        u = TOP / gate              # the MLP norm's weight / u, gate x u
        scales.append((t, a, u, q, k, v, o, gate, up, down))
    # The residual scale s sets the embedding (x s); v / o and up / down then share what is left:
    # the pair's two largest entries meet at sqrt(t v s o), which must stay within TOP.
    s = TOP / _max(w["model.embed_tokens.weight"])
    for t, a, u, q, k, v, o, gate, up, down in scales:
        s = min(s, TOP ** 2 / (t * v * o), TOP ** 2 / (u * up * down))
    w["model.embed_tokens.weight"] *= s
    w["model.norm.weight"] /= s
    for i, (t, a, u, q, k, v, o, gate, up, down) in enumerate(scales):
        c = math.sqrt(s * o / (t * v))  # v x t c and o x s / c: equal largest entries
        b = math.sqrt(s * down / (u * up))
        w[layer(i, "input_layernorm")] /= t
        w[layer(i, "self_attn.q_proj")] *= t * a
        w[layer(i, "self_attn.k_proj")] *= t / a
        w[layer(i, "self_attn.v_proj")] *= t * c
        w[layer(i, "self_attn.o_proj")] *= s / c
        w[layer(i, "post_attention_layernorm")] /= u
        w[layer(i, "mlp.gate_proj")] *= u
        w[layer(i, "mlp.up_proj")] *= u * b
        w[layer(i, "mlp.down_proj")] *= s / b
    return w, s


def to_fp8(state: dict[str, torch.Tensor], num_layers: int) -> tuple[dict[str, torch.Tensor], float]:
    """Rescaled matrices rounded to e4m3 (nearest), norms in bf16; and the residual scale."""
    exact, scale = rescaled(state, num_layers)
    return {name: t.to(FP8) if t.dim() == 2 else t.to(NORM_DTYPE) for name, t in exact.items()}, scale


def quantization_error(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, float]:
    """Per matrix: RMS of (rounded - rescaled) / RMS of rescaled, the rounding's relative error."""
    exact, _ = rescaled(state, num_layers)
    return {name: float((t.to(FP8).float() - t).pow(2).mean().sqrt() / t.pow(2).mean().sqrt())
            for name, t in exact.items() if t.dim() == 2}


def write_fp8_checkpoint(source: str | Path, out: str | Path) -> int:
    """Copy HF draft directory `source` to `out` with model.safetensors in float8 (every other file as
    is but config.json's rms_norm_eps, x s^2; it keeps its dtype, which the matrices are upcast to when
    loaded). Returns the bytes of the new weights file."""
    import json
    import shutil

    from specdec.models.registry import MANIFEST_NAME, write_manifest

    source, out = Path(source), Path(out)
    config = json.loads((source / "config.json").read_text())
    if not config.get("tie_word_embeddings", False) or config.get("model_type") != "llama":
        raise ValueError(f"{source}: float8 storage is written for Llama drafts with a tied embedding")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError(f"{source}: biases are not rescaled here; a draft with biases is not supported")
    state = load_file(source / "model.safetensors")
    converted, scale = to_fp8(state, config["num_hidden_layers"])
    out.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and item.name not in ("model.safetensors", "config.json", MANIFEST_NAME):
            shutil.copy2(item, out / item.name)
    config["rms_norm_eps"] = config.get("rms_norm_eps", 1e-6) * scale ** 2
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (source / MANIFEST_NAME).is_file():  # the source's checksums no longer hold: the copy's own
        origin = json.loads((source / MANIFEST_NAME).read_text()).get("source")
        write_manifest(out, {"source": {"kind": "float8 copy", "converted_by": "specdec distill to-fp8",
                                        "of": origin}})
    save_file(converted, out / "model.safetensors", metadata={"format": "pt"})
    return (out / "model.safetensors").stat().st_size
