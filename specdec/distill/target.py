"""Load the target (teacher) for distillation: an HF model directory, a .gguf file, or a registry name."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def _resolve(path: str) -> tuple[str, dict]:
    p = Path(path)
    if p.suffix == ".gguf":
        return str(p.parent), {"gguf_file": p.name}
    if p.exists():
        return str(p), {}
    try:  # a registry name such as "smollm2-135m-instruct" (specdec.models.registry, when present)
        from specdec.models.registry import resolve_model
    except ImportError as exc:
        raise FileNotFoundError(f"target {path!r} is neither a path nor a known model name") from exc
    return str(resolve_model(path)), {}


def load_target(path: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The target as an HF causal LM in eval mode (GGUF weights are dequantized by transformers)."""
    where, kwargs = _resolve(path)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kwargs)
    if getattr(model.config, "quantization_config", None) is not None and "gguf_file" in kwargs:
        del model.config.quantization_config  # dequantized: it is a plain float model now
    return model.to(device=device, dtype=dtype).eval()


def load_tokenizer(path: str):
    where, kwargs = _resolve(path)
    return AutoTokenizer.from_pretrained(where, **kwargs)


def export_hf(path: str, out_dir: str) -> str:
    """Write the target as a plain HF directory (fp32 safetensors, config, tokenizer): a GGUF is
    dequantized once instead of at every load. transformers refuses save_pretrained on a model loaded
    from GGUF, so the state dict, config and tokenizer are written separately."""
    from safetensors.torch import save_file

    model = load_target(path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tied = getattr(model.config, "tie_word_embeddings", False)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]  # a GGUF-loaded config lacks it; loaders need it
    model.config.save_pretrained(out)
    load_tokenizer(path).save_pretrained(out)
    return str(out)
