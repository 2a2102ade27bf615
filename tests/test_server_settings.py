"""ServerSettings / ClientSettings: validation, flags > env > defaults, tokens never in a repr."""

from __future__ import annotations

import dataclasses
import argparse
from pathlib import Path

import pytest

from specdec.server.settings import (
    ClientSettings,
    ConfigError,
    ServerSettings,
    add_client_arguments,
    add_server_arguments,
    client_settings_from_args,
    server_settings_from_args,
)


def parse(argv: list[str], environ: dict[str, str], **defaults) -> ServerSettings:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser, environ=environ, **{"port": 50052, **defaults})
    return server_settings_from_args(parser.parse_args(argv), service="target", environ=environ)


def test_tls_is_required_unless_plaintext_is_explicit():
    with pytest.raises(ConfigError, match="--plaintext"):
        ServerSettings()
    with pytest.raises(ConfigError, match="exclude"):
        ServerSettings(plaintext=True, tls_cert=Path("c"), tls_key=Path("k"))
    with pytest.raises(ConfigError, match="clear"):
        ServerSettings(plaintext=True, auth_tokens=frozenset({"t"}))
    assert ServerSettings(plaintext=True).plaintext
    mtls = ServerSettings(tls_cert=Path("c"), tls_key=Path("k"), tls_client_ca=Path("ca"), health_port=9)
    assert mtls.mutual_tls and mtls.serves_separate_health_port


@pytest.mark.parametrize(
    "kwargs",
    [
        {"port": 70000},
        {"port": 1, "health_port": 1},
        {"health_port": 5, "metrics_port": 5},
        {"max_message_bytes": 0},
        {"grace_period_s": -1},
    ],
)
def test_out_of_range_values_are_refused(kwargs):
    with pytest.raises(ConfigError):
        ServerSettings(plaintext=True, **kwargs)


def test_flags_override_env_which_overrides_defaults(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("# accepted tokens\nfile-token\n\n")
    env = {
        "SPECDEC_PORT": "6000",
        "SPECDEC_METRICS_PORT": "9100",
        "SPECDEC_TLS_CERT": "/tls/c.pem",
        "SPECDEC_TLS_KEY": "/tls/k.pem",
        "SPECDEC_AUTH_TOKENS": "env-a, env-b",
        "SPECDEC_TRACE_SAMPLING_RATIO": "0.25",
        "OTEL_SERVICE_NAME": "target-eu",
    }
    s = parse(
        ["--port", "7000", "--auth-tokens-file", str(tokens), "--health-port", "none"], env, health_port=50062
    )
    assert (s.port, s.metrics_port, s.health_port) == (7000, 9100, None)
    assert s.tls_cert == Path("/tls/c.pem") and not s.plaintext
    assert s.auth_tokens == {"file-token", "env-a", "env-b"}
    assert s.tracing.sampling_ratio == 0.25 and s.tracing.service_name == "target-eu"
    assert "token" not in repr(s)

    d = parse(["--plaintext"], {}, health_port=50062)
    assert (d.port, d.health_port, d.metrics_port, d.host) == (50052, 50062, None, "127.0.0.1")
    assert d.tracing.service_name == "specdec-target" and d.tracing.cycle_span_every == 1


def test_client_arguments_per_upstream(tmp_path):
    token = tmp_path / "token"
    token.write_text("secret-token\n")
    parser = argparse.ArgumentParser()
    add_client_arguments(parser, "target", environ={"SPECDEC_TARGET_TLS_CA": "/tls/ca.pem"})
    add_client_arguments(parser, "draft", environ={})
    args = parser.parse_args(
        ["--target-auth-token-file", str(token), "--draft-plaintext", "--draft-timeout", "2"]
    )
    target = client_settings_from_args(args, "target", environ={})
    draft = client_settings_from_args(args, "draft", environ={})
    assert target.tls_ca == Path("/tls/ca.pem") and target.auth_token == "secret-token"
    assert "secret" not in repr(target)
    assert draft.plaintext and draft.timeout_s == 2.0
    with pytest.raises(ConfigError):
        ClientSettings(plaintext=True, auth_token="t")
    with pytest.raises(ConfigError):
        ClientSettings(tls_cert=Path("c"))



def test_cycle_calls_stream_by_default_and_unary_on_request():
    """--<upstream>-cycle-calls (or SPECDEC_<UPSTREAM>_CYCLE_CALLS): a session's Verify / Propose as
    messages of its stream by default, one call each with unary; nothing else is accepted."""
    parser = argparse.ArgumentParser()
    add_client_arguments(parser, "target", environ={})
    add_client_arguments(parser, "draft", environ={"SPECDEC_DRAFT_CYCLE_CALLS": "unary"})
    args = parser.parse_args(["--target-plaintext", "--draft-plaintext"])
    assert client_settings_from_args(args, "target", environ={}).cycle_calls == "stream"
    assert client_settings_from_args(args, "draft", environ={}).cycle_calls == "unary"
    args = parser.parse_args(["--target-plaintext", "--target-cycle-calls", "unary"])
    assert client_settings_from_args(args, "target", environ={}).cycle_calls == "unary"
    with pytest.raises(SystemExit):  # argparse: not among the choices
        parser.parse_args(["--target-cycle-calls", "auto"])
    with pytest.raises(ConfigError, match="cycle calls must be one of stream, unary"):
        ClientSettings(plaintext=True, cycle_calls="sometimes")


def test_model_services_take_compile_layers():
    """--compile-layers reaches both model services' settings (and load_model); off by default."""
    from draft_service.main import build_parser as draft_parser, settings_from_args as draft_settings
    from target_service.main import build_parser as target_parser, settings_from_args as target_settings

    for parser, to_settings in ((target_parser, target_settings), (draft_parser, draft_settings)):
        base = ["--plaintext", "--model", "smollm2-135m-instruct"]
        assert not to_settings(parser().parse_args(base)).compile_layers
        assert to_settings(parser().parse_args([*base, "--compile-layers"])).compile_layers


def test_model_services_default_to_the_default_pair(monkeypatch):
    from draft_service.main import build_parser as draft_parser, settings_from_args as draft_settings
    from target_service.main import build_parser as target_parser, settings_from_args as target_settings

    for name in ("SPECDEC_TARGET_MODEL", "SPECDEC_DRAFT_MODEL"):
        monkeypatch.delenv(name, raising=False)
    assert target_settings(target_parser().parse_args(["--plaintext"])).model == "smollm2-135m-instruct"
    assert draft_settings(draft_parser().parse_args(["--plaintext"])).model == "smollm2-135m-draft"


def test_model_services_warm_up_cuda_graphs_unless_told_or_compiling():
    """--graph-warmup-context: 1024 tokens by default, none with --compile-layers, never negative."""
    from draft_service.main import build_parser as draft_parser, settings_from_args as draft_settings
    from specdec.server.settings import ConfigError
    from target_service.main import build_parser as target_parser, settings_from_args as target_settings

    for parser, to_settings in ((target_parser, target_settings), (draft_parser, draft_settings)):
        base = ["--plaintext", "--model", "smollm2-135m-instruct"]
        warmup = lambda *flags: to_settings(parser().parse_args([*base, *flags])).graph_warmup_context  # noqa: E731
        assert warmup() == 1024 and warmup("--compile-layers") == 0
        assert warmup("--graph-warmup-context", "0") == 0
        assert warmup("--compile-layers", "--graph-warmup-context", "512") == 512
        with pytest.raises(ConfigError, match="--graph-warmup-context must be >= 0"):
            warmup("--graph-warmup-context", "-1")


def test_the_target_takes_a_trimming_margin_within_bounds():
    from specdec.server.settings import ConfigError
    from target_service.main import build_parser, settings_from_args

    base = ["--plaintext", "--model", "smollm2-135m-instruct"]
    assert settings_from_args(build_parser().parse_args(base)).trim_margin == 0.0
    assert settings_from_args(build_parser().parse_args([*base, "--trim-margin", "0.2"])).trim_margin == 0.2
    for bad in ("-0.1", "11", "nan"):
        with pytest.raises(ConfigError, match="--trim-margin must be in"):
            settings_from_args(build_parser().parse_args([*base, "--trim-margin", bad]))
    # --draft-trimming: goodput (the default) prices steps and drafted sessions' cycles, step the steps only.
    modes = {mode: settings_from_args(build_parser().parse_args([*base, "--draft-trimming", mode]))
             for mode in ("goodput", "step", "off")}
    assert [(m.trim_drafts, m.trim_cycles) for m in modes.values()] == [(True, True), (True, False), (False, False)]
    assert settings_from_args(build_parser().parse_args(base)).trim_cycles
    # --step-pricing: auto (as the backend runs a batch) unless told; anything else is refused.
    assert settings_from_args(build_parser().parse_args(base)).step_pricing == "auto"
    assert settings_from_args(build_parser().parse_args([*base, "--step-pricing", "padded"])).step_pricing == "padded"
    with pytest.raises(ConfigError, match="--step-pricing must be one of auto, packed, padded"):
        dataclasses.replace(settings_from_args(build_parser().parse_args(base)), step_pricing="rows")


def test_the_coordinator_takes_local_ngram_as_a_draft_only():
    """--draft local:ngram: prompt lookup inside the coordinator; no other name stands for a replica."""
    import argparse

    from coordinator.settings import add_arguments, settings_from_args
    from specdec.server.settings import ConfigError

    parser = argparse.ArgumentParser()
    add_arguments(parser, environ={})
    base = ["--plaintext", "--tokenizer", "t", "--redis-url", "redis://x", "--target-plaintext", "--draft-plaintext"]
    settings = settings_from_args(parser.parse_args([*base, "--target", "t:1", "--draft", "local:ngram"]))
    assert settings.drafts == ("local:ngram",)
    for bad in (["--target", "local:ngram"], ["--draft", "local:eagle"], ["--draft", "d"]):
        with pytest.raises(ConfigError, match="an endpoint is host:port"):
            settings_from_args(parser.parse_args([*base, *bad]))


def test_an_unknown_log_level_is_refused_before_the_service_starts(monkeypatch, capsys):
    """SPECDEC_LOG_LEVEL: any case of the standard levels; anything else exits 2 with what is allowed."""
    from specdec.server import service
    from target_service.main import build_parser

    started = []
    monkeypatch.setenv("SPECDEC_LOG_LEVEL", "verbose")
    assert service.main(build_parser(), started.append, ["--plaintext", "--model", "m"]) == 2
    assert started == [] and "use DEBUG, INFO, WARNING, ERROR or CRITICAL" in capsys.readouterr().err
    monkeypatch.setenv("SPECDEC_LOG_LEVEL", "debug")
    assert service.main(build_parser(), lambda args: 0, ["--plaintext", "--model", "m"]) == 0
