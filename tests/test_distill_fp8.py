"""A draft stored in float8 (specdec/distill/fp8.py): the rescaling leaves the model's function as it
was, the file is half the bytes, and transformers and the native backend load it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from specdec.distill.fp8 import FP8, TOP, quantization_error, rescaled, write_fp8_checkpoint
from specdec.models.llama import LlamaModel

PROMPT = [[5, 17, 99, 3, 250, 42, 7, 1, 8, 300]]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A tiny tied Llama with weights at a trained draft's small magnitudes (std 0.02, a few larger)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=128)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms away from 1, so that moving scale into them is tested
                p.uniform_(0.5, 2.0)
    path = tmp_path_factory.mktemp("draft")
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def logits_of(path, dtype=torch.float32):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return model(torch.tensor(PROMPT)).logits[0].float()


def test_rescaling_keeps_the_function_and_bounds_every_matrix(draft_dir, tmp_path):
    state = load_file(draft_dir / "model.safetensors")
    exact, scale = rescaled(state, 3)
    assert all(t.abs().max() <= TOP * (1 + 1e-5) for t in exact.values() if t.dim() == 2)
    # the embedding (and with it the residual stream) grew a lot: the rescaling did something
    assert exact["model.embed_tokens.weight"].abs().max() > 100 * state["model.embed_tokens.weight"].float().abs().max()
    model = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    for norm in [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]:
        norm.variance_epsilon *= scale ** 2  # what write_fp8_checkpoint puts in the config
    model.load_state_dict({**exact, "lm_head.weight": exact["model.embed_tokens.weight"]})
    with torch.no_grad():
        got = model(torch.tensor(PROMPT)).logits[0]
    want = logits_of(draft_dir)
    assert torch.allclose(got, want, atol=1e-4 * want.abs().max().item()), (got - want).abs().max()


def test_the_float8_checkpoint_is_half_the_bytes_and_both_loaders_read_it(draft_dir, tmp_path):
    out = tmp_path / "fp8"
    size = write_fp8_checkpoint(draft_dir, out)
    assert size < 0.55 * (draft_dir / "model.safetensors").stat().st_size
    stored = load_file(out / "model.safetensors")
    assert stored["model.embed_tokens.weight"].dtype == FP8 and stored["model.norm.weight"].dtype == torch.bfloat16
    config, original = (json.loads((d / "config.json").read_text()) for d in (out, draft_dir))
    assert config["rms_norm_eps"] > 1e3 * original["rms_norm_eps"]
    assert {k: v for k, v in config.items() if k != "rms_norm_eps"} == \
        {k: v for k, v in original.items() if k != "rms_norm_eps"}
    # the rounding's error is e4m3's (3 mantissa bits: at most 1/16 of a value, about 2-3% RMS)
    assert max(quantization_error(load_file(draft_dir / "model.safetensors"), 3).values()) < 0.05
    want, got = logits_of(draft_dir), logits_of(out)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    native = LlamaModel(out, dtype="float32", num_slots=1, max_context=64)
    slot = native.allocate()
    logits = torch.cat(native.forward([slot], PROMPT, [len(PROMPT[0])]))
    assert torch.allclose(logits, got, atol=1e-4 * got.abs().max().item())


def test_a_packaged_drafts_copy_gets_its_own_manifest(draft_dir, tmp_path):
    import shutil

    from specdec.models.registry import MANIFEST_NAME, verify_model, write_manifest

    source = tmp_path / "packaged"
    shutil.copytree(draft_dir, source)
    write_manifest(source, {"source": {"kind": "packaged"}})
    write_fp8_checkpoint(source, tmp_path / "copy")
    manifest = json.loads((tmp_path / "copy" / MANIFEST_NAME).read_text())
    assert manifest["source"] == {"kind": "float8 copy", "converted_by": "specdec distill to-fp8",
                                  "of": {"kind": "packaged"}}
    assert verify_model(str(tmp_path / "copy")).ok


def test_untied_or_biased_drafts_are_refused(tmp_path):
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "untied")
    with pytest.raises(ValueError, match="tied embedding"):
        write_fp8_checkpoint(tmp_path / "untied", tmp_path / "out")


def test_the_command_writes_the_copy_and_reports_its_error(draft_dir, tmp_path, capsys):
    from specdec.cli import main

    assert main(["distill", "to-fp8", "--draft", str(draft_dir), "--out", str(tmp_path / "copy")]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["fp8_bytes"] == (tmp_path / "copy" / "model.safetensors").stat().st_size
    assert report["fp8_bytes"] < 0.55 * report["source_bytes"]
    assert 0 < report["relative_rms_error_mean"] <= report["relative_rms_error_max"] < 0.05
