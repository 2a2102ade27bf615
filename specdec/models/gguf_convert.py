"""Convert a GGUF checkpoint into a plain Hugging Face directory (float32 safetensors).

transformers can load GGUF (it dequantizes every tensor on each load, ~20 s for SmolLM2-135M on two
CPU cores) but refuses to save such a model. Converting once, here, makes every later load take about a
second and gives backends an ordinary HF checkpoint: config.json, generation_config.json,
model.safetensors and the tokenizer files (with the chat template).

The conversion is lossless with respect to transformers' own GGUF loader: the safetensors file holds
exactly the float32 tensors that loader produced, so logits of the converted model equal those of the
GGUF-loaded one bit for bit (tests/test_registry.py checks this).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

logger = logging.getLogger(__name__)

SAFETENSORS_NAME = "model.safetensors"


def load_gguf_model(gguf_path: Path) -> torch.nn.Module:
    """The model as transformers' GGUF loader dequantizes it, float32, on the CPU, in eval mode."""
    from transformers import AutoModelForCausalLM

    gguf_path = Path(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


def load_gguf_tokenizer(gguf_path: Path):
    """The tokenizer (vocabulary, merges, special tokens, chat template) stored in the GGUF file."""
    from transformers import AutoTokenizer

    gguf_path = Path(gguf_path)
    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def untie_state_dict(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state dict with every tensor stored once, and {dropped name: name it aliases}.

    safetensors refuses tensors that share memory. A tied pair (SmolLM2 ties lm_head.weight to
    model.embed_tokens.weight) is stored once, under the first name, as HF checkpoints do; the loader
    re-ties it from config.tie_word_embeddings. A shared pair the config does not declare tied would
    load as two independent tensors, so it is refused rather than silently written once.
    """
    state_dict = model.state_dict()
    declared = _declared_tied_keys(model)
    kept: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    first_by_storage: dict[tuple[int, tuple[int, ...], tuple[int, ...]], str] = {}
    for name, tensor in state_dict.items():
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
        if key in first_by_storage:
            if name not in declared:
                raise ValueError(
                    f"{name} shares memory with {first_by_storage[key]} but the config does not tie them"
                )
            tied[name] = first_by_storage[key]
            continue
        first_by_storage[key] = name
        kept[name] = tensor.detach().contiguous()
    return kept, tied


def _declared_tied_keys(model: torch.nn.Module) -> set[str]:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not getattr(config, "tie_word_embeddings", False):
        return set()
    output = model.get_output_embeddings()
    if output is None:
        return set()
    prefix = next(name for name, module in model.named_modules() if module is output)
    return {f"{prefix}.weight"}


def save_hf_directory(model: torch.nn.Module, tokenizer, out_dir: Path) -> dict[str, str]:
    """Write config, generation config, float32 weights and tokenizer into out_dir.

    Returns {dropped tied tensor name: the name it aliases}, for the manifest.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state_dict, tied = untie_state_dict(model)
    size_mb = sum(t.numel() * t.element_size() for t in state_dict.values()) / 1e6
    logger.info("saving %s (%d tensors, %.0f MB) to %s", SAFETENSORS_NAME, len(state_dict), size_mb, out_dir)
    save_file(state_dict, str(out_dir / SAFETENSORS_NAME), metadata={"format": "pt"})
    _plain_config(model).save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    logger.info("saved config, generation config and tokenizer to %s", out_dir)
    return tied


def _plain_config(model: torch.nn.Module):
    """The model's config without the GGUF quantization entry, declaring float32 weights.

    Left in, quantization_config would make transformers look for the GGUF file again on load.
    """
    config_dict = model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["dtype"] = "float32"
    config_dict["architectures"] = [type(model).__name__]
    return type(model.config).from_dict(config_dict)


def align_special_tokens(tokenizer, config) -> None:
    """Make the tokenizer's eos and pad tokens the ones the model config names, where they differ.

    Both come from the same GGUF metadata, but transformers 5.17's GGUF tokenizer conversion names
    SmolLM2's <|im_start|> (id 1) as eos and drops the pad, while the config (and transformers 5.24)
    says eos = pad = <|im_end|> (id 2). The special tokens are part of the vocab fingerprint that a
    coordinator compares with each draft's, so a target converted by 5.17 refused the packaged draft
    and every session silently decoded without it (seen on the GPU machine, reproduced here with 5.17).
    The config's ids win, so the converted directory does not depend on the converting version.
    """
    for role in ("eos", "pad"):
        token_id = getattr(config, f"{role}_token_id", None)
        if isinstance(token_id, int) and getattr(tokenizer, f"{role}_token_id", None) != token_id:
            token = tokenizer.convert_ids_to_tokens(token_id)
            logger.warning("GGUF tokenizer %s token %r -> %r (id %d, the model config's)", role,
                           getattr(tokenizer, f"{role}_token", None), token, token_id)
            setattr(tokenizer, f"{role}_token", token)


def convert_gguf(gguf_path: Path, out_dir: Path) -> dict[str, str]:
    """Dequantize gguf_path with transformers and write an HF directory; returns the tied-name map."""
    logger.info("dequantizing %s (float32)", Path(gguf_path).name)
    model = load_gguf_model(gguf_path)
    tokenizer = load_gguf_tokenizer(gguf_path)
    align_special_tokens(tokenizer, model.config)
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("%s carries no chat template; prompts will be encoded as plain text", gguf_path)
    return save_hf_directory(model, tokenizer, out_dir)
