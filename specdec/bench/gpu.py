"""Model-scale runs: random-weight models of real shapes, and the memory-bandwidth floor.

No trained weights of these sizes exist here (../shared/docs/MODELS.md), so `random:<preset>` names
a Llama-family checkpoint with seeded random weights, written once into $SPECDEC_HOME/random/ with
the tiny byte-level tokenizer (prompts become byte ids, which every preset's vocabulary holds).
Acceptance then comes from the replay proposer (specdec/proposers/replay.py), never from the weights.

The floor of one target step is the time to read its weights once: weight bytes / the device's
measured device-to-device copy bandwidth (bytes read + written per second).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch

PRESETS: dict[str, dict] = {
    # Llama-3-8B: 32 layers, hidden 4096, 32 heads (8 KV), MLP 14336, vocab 128256, untied.
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                      max_position_embeddings=8192, tie_word_embeddings=False),
    # Llama-3.2-1B: 16 layers, hidden 2048, 32 heads (8 KV), MLP 8192, tied, llama3 rope scaling.
    "llama3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        intermediate_size=8192, vocab_size=128256, rope_theta=500000.0,
                        max_position_embeddings=131072, tie_word_embeddings=True,
                        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=8192)),
    # CPU-sized stand-ins with the same structure, for tests and dry runs of the GPU commands.
    "tiny-target": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=384, vocab_size=4096, rope_theta=500000.0,
                        max_position_embeddings=2048, tie_word_embeddings=False),
    "tiny-draft": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=192, vocab_size=4096, rope_theta=500000.0,
                       max_position_embeddings=2048, tie_word_embeddings=True),
}


def model_dir(name: str, dtype: str, seed: int = 0) -> Path:
    """A model's directory: `random:<preset>` written on first use (random_model_dir), anything else
    through the registry (a name, a directory, a .gguf file)."""
    if name.startswith("random:"):
        return random_model_dir(name, dtype, seed)
    from specdec.models.registry import resolve_model

    return resolve_model(name)


def random_model_dir(name: str, dtype: str, seed: int = 0, home: Path | None = None) -> Path:
    """The directory of `random:<preset>`, written on first use."""
    from specdec.models.registry import specdec_home

    preset = name.removeprefix("random:")
    if preset not in PRESETS:
        raise ValueError(f"unknown random-weight preset {preset!r}; known: {', '.join(PRESETS)}")
    directory = specdec_home(home) / "random" / f"{preset}-{dtype}-s{seed}"
    if not (directory / "config.json").is_file():
        tmp = directory.with_name(f".{directory.name}.{os.getpid()}")
        make_random_model(tmp, preset, dtype, seed)
        tmp.rename(directory)
    return directory


def _tensors(cfg: dict, layer: int | None) -> dict[str, tuple[int, ...]]:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    if layer is None:
        out = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
        if not cfg["tie_word_embeddings"]:
            out["lm_head.weight"] = (cfg["vocab_size"], h)
        return out
    p = f"model.layers.{layer}."
    return {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter)}


@torch.no_grad()
def make_random_model(directory: Path, preset: str, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Write a sharded safetensors checkpoint (one shard per layer), config.json and the tokenizer.

    The draw follows the tiny test models: embeddings N(0, 1), matrices N(0, 1.5^2 / fan_in), norms
    near 1, so logits are peaked and greedy decoding has few near-ties in bf16."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from specdec.testing.tiny_models import TINY_BOS_ID, TINY_EOS_ID, TINY_PAD_ID, make_tiny_tokenizer

    cfg = PRESETS[preset]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    weight_map, total = {}, 0
    for index, layer in enumerate([None, *range(cfg["num_hidden_layers"])]):
        shard = f"model-{index:05d}.safetensors"
        tensors = {}
        for name, shape in _tensors(cfg, layer).items():
            noise = torch.randn(shape, generator=generator, device=device)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.2 * noise
            elif "embed_tokens" in name or "lm_head" in name:
                value = noise
            else:
                value = noise * (1.5 / math.sqrt(shape[-1]))
            tensors[name] = value.to(torch_dtype).cpu()
            total += tensors[name].numel() * tensors[name].element_size()
            weight_map[name] = shard
        save_file(tensors, str(directory / shard), metadata={"format": "pt"})
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config = LlamaConfig(**cfg, head_dim=cfg["hidden_size"] // cfg["num_attention_heads"], rms_norm_eps=1e-5,
                         bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID, pad_token_id=TINY_PAD_ID,
                         architectures=["LlamaForCausalLM"], dtype=dtype)
    config.save_pretrained(directory)
    make_tiny_tokenizer(directory, cfg["vocab_size"])
    (directory / "random-weights.json").write_text(json.dumps({"preset": preset, "seed": seed, "dtype": dtype}))
    return directory


def weight_bytes(directory: Path) -> dict:
    """Bytes of all weights, and of what one decoding step reads (the embedding table only by row;
    a tied lm_head is read in full)."""
    index = json.loads((Path(directory) / "model.safetensors.index.json").read_text())
    config = json.loads((Path(directory) / "config.json").read_text())
    total = index["metadata"]["total_size"]
    element = total / sum(math.prod(s) for layer in [None, *range(config["num_hidden_layers"])]
                          for s in _tensors(config, layer).values())
    embed = config["vocab_size"] * config["hidden_size"] * element
    return {"all_weights": int(total), "read_per_step": int(total - embed + (embed if config["tie_word_embeddings"] else 0))}


def copy_bandwidth(device: str, nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sync = (lambda: torch.cuda.synchronize(src.device)) if src.is_cuda else (lambda: None)  # that device's
    for _ in range(3):
        dst.copy_(src)
    sync()
    started = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync()
    return 2 * nbytes * repeats / (time.perf_counter() - started)


def bandwidth_floor(model_dir: Path, device: str, t_step: float | None = None) -> dict:
    """The memory-bandwidth floor of one target step beside the measured step time."""
    size = weight_bytes(model_dir)
    bandwidth = copy_bandwidth(device, nbytes=(1 << 30) if "cuda" in device else (1 << 26))
    floor = size["all_weights"] / bandwidth
    out = {"device": device, "copy_bandwidth_bytes_per_s": bandwidth, "weight_bytes": size["all_weights"],
           "bytes_read_per_step": size["read_per_step"], "floor_s": floor,
           "floor_read_per_step_s": size["read_per_step"] / bandwidth}
    if t_step is not None:
        out.update(t_step_s=t_step, t_step_over_floor=t_step / floor)
    return out
